"""CLI input handling: every bad input is one line on stderr and exit code 2, fast (no network needed)."""

import os
import subprocess
import sys

import pytest

from p2p_diloco.cli.launcher import format_table, parse_join_line

pytestmark = pytest.mark.unit
PEER = "12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "p2p_diloco", *args], capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.mark.parametrize("args, needle", [
    (["join", "--initial-peers", "garbage"], "invalid multiaddr"),
    (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/5"], "must end with /p2p/<peer id>"),
    (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/notapeer"], "invalid multiaddr"),
    (["join", "--host-maddrs", "/ip4/999.0.0.1/tcp/0"], "invalid multiaddr"),
    (["join", "--config", "/nonexistent.toml"], "config file not found"),
    (["join", "--set", "train.nope=1"], "unknown config key train.nope"),
    (["join", "--set", "train.lr=abc"], "train.lr must be a number"),
    (["join", "--max-rounds", "x"], "invalid int value"),
    (["join", "--bogus"], "unrecognized arguments"),
    (["swarm", "--peers", "0"], "--peers must be >= 1"),
    (["swarm", "--peers", "3", "--debug-step-delay", "0", "1"], "--debug-step-delay takes one value >= 0, or one per"),
    (["join", "--debug-step-delay", "-1"], "debug.step_delay"),
    (["join", "--set", "round.mode=fast"], "round.mode must be fixed_steps or swarm_target"),
    (["join", "--set", "round.mode=swarm_target", "--set", "outer.overlap=true"], "does not work with outer.overlap"),
    (["join", "--client-mode"], "--client-mode needs --initial-peers"),
    (["join", "--startup-timeout", "0"], "swarm.startup_timeout must be > 0"),
    (["join", "--identity-path", "/nonexistent-dir/id.key", "--max-rounds", "1"],
     "cannot create identity file /nonexistent-dir/id.key: /nonexistent-dir does not exist"),
    (["join", "--identity-path", f"{sys.executable}/id.key"], f"{sys.executable} is not a directory"),
    (["bootstrap", "--identity-path", "/nonexistent-dir/id.key"], "cannot create identity file /nonexistent-dir/"),
    (["join", "--set", "swarm.deadlines=sometimes"], "swarm.deadlines must be adaptive or fixed"),
    (["join", "--set", "outer.compression=zstd"],
     "outer.compression must be one of none, fp16, bf16, int8, int4, topk, got 'zstd'"),
    (["join", "--set", "data.streaming=maybe"], "data.streaming must be one of auto, true, false, got 'maybe'"),
    (["join", "--set", "swarm.transport=udp"], "swarm.transport must be tcp or p2p, got 'udp'"),
    (["join", "--resume"], "--resume needs --checkpoint-dir (checkpoint.dir)"),
    (["bootstrap", "--initial-peers", "/ip4/127.0.0.1/tcp/5"], "must end with /p2p/<peer id>"),
    (["join", "--debug-corrupt-pseudo-gradient", "zero"], "debug.corrupt_pseudo_gradient: bad corruption mode"),
    (["join", "--allowed-peers", "not-a-peer-id"], "swarm.allowed_peers: 'not-a-peer-id' is neither a file nor"),
    (["status"], "--initial-peers (or $P2P_DILOCO_INITIAL_PEERS) is required"),
    (["status", "--initial-peers", "/ip4/127.0.0.1/tcp/5"], "must end with /p2p/<peer id>"),
    (["status", "--initial-peers", f"/ip4/127.0.0.1/tcp/5/p2p/{PEER}", "--watch", "0"], "--watch must be > 0"),
    (["eval"], "the following arguments are required: --checkpoint"),
    (["export", "--checkpoint", "/nonexistent"], "the following arguments are required: --out"),
    (["eval", "--checkpoint", "/nonexistent/ckpt"], "checkpoint not found"),
    (["export", "--checkpoint", "/nonexistent/ckpt", "--out", "/tmp/x"], "checkpoint not found"),
    (["export", "--checkpoint", sys.executable, "--out", os.path.dirname(sys.executable)],
     f"{os.path.dirname(sys.executable)} already exists and is not an empty directory"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


def test_initial_peers_from_environment_are_validated(monkeypatch):
    import os

    env = dict(os.environ, P2P_DILOCO_INITIAL_PEERS="/ip4/127.0.0.1/tcp/5")
    r = run_cli("join", env=env)
    assert r.returncode == 2 and "must end with /p2p/" in r.stderr


def test_join_line_round_trip():
    line = f"p2p-diloco join --initial-peers /ip4/127.0.0.1/tcp/4001/p2p/{PEER} /ip4/10.0.0.2/tcp/4001/p2p/{PEER} " \
           f"--run-id my-run\n"
    maddrs, run_id = parse_join_line(line)
    assert run_id == "my-run" and len(maddrs) == 2 and maddrs[0].endswith(PEER)
    assert parse_join_line("something else") is None
    # a bootstrap node prints the same line without a run id
    maddrs, run_id = parse_join_line(f"p2p-diloco join --initial-peers /ip4/127.0.0.1/tcp/4001/p2p/{PEER}\n")
    assert run_id is None and maddrs == [f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"]


def test_table_marks_missing_values():
    table = format_table([{"peer_id": PEER, "rounds_completed": 3, "eval_loss_first": 5.0, "eval_loss_last": 3.0,
                           "tokens_trained": 1000, "bytes_sent": 2e6, "bytes_received": 2e6,
                           "global_digest": "ab" * 32, "exit_code": 0},
                          {"peer_id": None, "exit_code": 1}])
    assert "5.0000 -> 3.0000" in table and "abababababab" in table
    assert table.splitlines()[2].split()[1] == "-"
