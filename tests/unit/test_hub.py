"""Hub names without a reachable hub: one line that says what to do, after one try, and cached names still load.

Offline-safe everywhere: the hub is replaced by an address that refuses connections (``HF_ENDPOINT``), and the cache
by an empty (or hand-made) ``HF_HOME``, so no test depends on, or reaches, the network. "Fails fast" is checked by
counting the connections dialled to that address (see ``HUB_DIALS``), not with a clock: before the probe,
transformers spent ~50 s in five retries with backoff per file (142 s for a cached tokenizer), and a wall-clock
bound on a whole ``join`` mostly measured how long torch and transformers take to import on a busy machine.
"""

import http.server
import os
import socket
import subprocess
import sys
import threading

import huggingface_hub
import pytest

from p2p_diloco.config import ConfigError, ModelConfig
from p2p_diloco.training import hub
from p2p_diloco.training.model import build_model
from p2p_diloco.training.tokenizer import _byte_tokenizer

pytestmark = pytest.mark.unit

REFUSED = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
HUB_ADDRESS = ("127.0.0.1", 9)
# The dials to the hub a process may make: our probe, and huggingface_hub's own fetch of its agent registry (for
# the User-Agent header; once per process, 3 s timeout, even with local_files_only). Before the probe: 5 per file.
HUB_DIALS = range(1, 3)
# Run before a command in a child process: logs every address the process dials to the file $DIAL_LOG.
DIAL_LOGGER = ("import os, socket\n"
               "_connect = socket.socket.connect\n"
               "def _logged(self, address):\n"
               "    with open(os.environ['DIAL_LOG'], 'a') as log:\n"
               "        log.write(repr(address) + '\\n')\n"
               "    return _connect(self, address)\n"
               "socket.socket.connect = _logged\n")


def _offline_env(hf_home) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_ENDPOINT": REFUSED, "HF_HOME": str(hf_home), "P2P_DILOCO_INITIAL_PEERS": "",
            "DIAL_LOG": str(hf_home.parent / "dials.log")}


def _hub_dials(env: dict) -> int:
    """How many connections the child process that ran with ``env`` dialled to the hub's address."""
    log = env["DIAL_LOG"]
    lines = open(log).read().splitlines() if os.path.exists(log) else []
    return sum(line == repr(HUB_ADDRESS) for line in lines)


@pytest.fixture
def hub_dials(monkeypatch) -> list:
    """The addresses this process dials to the hub's address while the test runs."""
    dialled = []
    connect = socket.socket.connect

    def logged(sock, address):
        if address == HUB_ADDRESS:
            dialled.append(address)
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", logged)
    return dialled


@pytest.fixture
def refused_hub(monkeypatch):
    """This process's hub is an address that refuses connections (the probe's cached answer is reset around it)."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", REFUSED)
    hub.hub_unreachable.cache_clear()
    yield
    hub.hub_unreachable.cache_clear()


@pytest.mark.parametrize("setting, needle", [
    ("tokenizer.name_or_path=gpt2", "cannot load tokenizer gpt2: not in the local Hugging Face cache"),
    ("data.path=allenai/c4", "cannot load dataset allenai/c4: "),
])
def test_unreachable_hub_fails_fast_on_one_line_that_says_what_to_do(tmp_path, setting, needle):
    env = _offline_env(tmp_path / "hf")
    join = ("import runpy, sys\n"
            f"sys.argv = ['p2p_diloco', 'join', '--max-rounds', '1', '--set', {setting!r}]\n"
            "runpy.run_module('p2p_diloco', run_name='__main__', alter_sys=True)\n")
    r = subprocess.run([sys.executable, "-c", DIAL_LOGGER + join],
                       capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # no retry lines, no progress bars
    assert needle in lines[0] and f"{REFUSED} is unreachable" in lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0] and ("local path" in lines[0] or "local files" in lines[0])
    assert _hub_dials(env) in HUB_DIALS  # no retry by transformers or datasets


def test_a_hub_name_in_the_local_cache_loads_without_the_hub(tmp_path):
    # The hub cache's layout: models--<org>--<name>/snapshots/<revision>/ and refs/main naming the revision.
    repo = tmp_path / "hf" / "hub" / "models--p2p-test--cached-byte"
    snapshot = repo / "snapshots" / ("0" * 40)
    _byte_tokenizer().save_pretrained(snapshot)
    (snapshot / "config.json").write_text('{"model_type": "llama", "vocab_size": 257}')  # AutoTokenizer reads it
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    code = ("from p2p_diloco.config import TokenizerConfig\n"
            "from p2p_diloco.training.tokenizer import build_tokenizer\n"
            "tok = build_tokenizer(TokenizerConfig('p2p-test/cached-byte'))\n"
            "print(len(tok), tok('hi')['input_ids'])\n")
    env = _offline_env(tmp_path / "hf")
    r = subprocess.run([sys.executable, "-c", DIAL_LOGGER + code], capture_output=True, text=True, timeout=90,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["257", "[104,", "105]"]
    assert _hub_dials(env) in HUB_DIALS  # the cached files are read without asking the hub for updates


def test_unreachable_hub_model_name_is_a_one_line_config_error(refused_hub, hub_dials):
    with pytest.raises(ConfigError, match=r"^cannot load model p2p-diloco-tests/not-cached: not in the local Hugging "
                                          r"Face cache, and http://127\.0\.0\.1:9 is unreachable: ") as info:
        build_model(ModelConfig(name_or_path="p2p-diloco-tests/not-cached"), vocab_size=257, seed=0)
    assert "\n" not in str(info.value) and "HF_HUB_OFFLINE=1" in str(info.value)
    assert len(hub_dials) in HUB_DIALS  # no retry


class _Hub(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


def test_the_probe_asks_once_and_counts_any_answer_as_reachable(monkeypatch, refused_hub):
    assert hub.hub_unreachable().startswith(f"{REFUSED} is unreachable: ")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub.hub_unreachable() is not None  # remembered for the process: asked once
        hub.hub_unreachable.cache_clear()
        assert hub.hub_unreachable() is None
    finally:
        server.shutdown()
        server.server_close()


def test_offline_mode_skips_the_probe_and_leaves_cached_datasets_to_datasets(monkeypatch, refused_hub):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert hub.hub_unreachable() == "HF_HUB_OFFLINE is set"
    hub.check_hub_dataset("allenai/c4", streaming=False)  # no error: datasets reads its own cache in offline mode
    with pytest.raises(ConfigError, match='HF_HUB_OFFLINE is set and a streamed dataset is read from the hub; use '
                                          'local files .*, or set data.streaming = "false"'):
        hub.check_hub_dataset("allenai/c4", streaming=True)
    assert hub.explain("gpt2", OSError("x"), hub.hub_unreachable()) == (
        "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set: give a local path (a directory written by "
        "save_pretrained), or download it once with internet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub.hub_unreachable.cache_clear()
    for streaming in (False, True):
        with pytest.raises(ConfigError, match="HF_HUB_OFFLINE=1 to use a copy in the datasets cache"):
            hub.check_hub_dataset("allenai/c4", streaming)


def test_a_gated_repo_error_says_how_to_log_in():
    gated = OSError("You are trying to access a gated repo.\nMake sure to have access to it at "
                    "https://huggingface.co/mistralai/Mistral-7B-v0.1.\n401 Client Error.")
    reason = hub.explain("mistralai/Mistral-7B-v0.1", gated, down=None)
    assert reason.startswith("You are trying to access a gated repo.")
    assert "hf auth login" in reason and "huggingface-cli login" in reason and "HF_TOKEN" in reason
    assert hub.explain("x/y", ValueError("bad config\nmore"), down=None) == "bad config"
