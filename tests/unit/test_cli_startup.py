"""Start-up checks and messages through the real CLI: one line on stderr, exit code 2, before any swarm is joined."""

import os
import subprocess
import sys
import time

import pytest

from p2p_diloco.checkpoint import CheckpointStore

pytestmark = pytest.mark.unit


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "p2p_diloco", *args], capture_output=True, text=True, timeout=120)


def one_line_error(r) -> str:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_a_regular_file_as_checkpoint_dir_is_refused_before_joining(tmp_path):
    """Before: the run joined, logged `checkpoint of round 0 failed ... File exists` every round and exited 0."""
    a_file = tmp_path / "ckpt"
    a_file.write_text("not a directory")
    t0 = time.monotonic()
    line = one_line_error(run_cli("join", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(a_file),
                                  "--max-rounds", "1"))
    assert f"checkpoint directory {a_file} is a file, not a directory" in line, line
    assert time.monotonic() - t0 < 60  # the peer never started its model, data or swarm
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize("command", ["eval", "export", "join"])
def test_a_garbage_or_truncated_checkpoint_is_one_line_naming_the_file(tmp_path, command):
    from tests.unit.test_checkpoint import make_state

    ckpt = tmp_path / "ckpt"
    path = CheckpointStore(ckpt).save(make_state(round_=1))
    data = path.read_bytes()
    truncated = command == "export"
    path.write_bytes(data[: len(data) // 2] if truncated else b"\xe8" + os.urandom(len(data)))
    args = {"eval": ["eval", "--checkpoint", str(path)],
            "export": ["export", "--checkpoint", str(path), "--out", str(tmp_path / "out")],
            "join": ["join", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(ckpt), "--resume"]}
    line = one_line_error(run_cli(*args[command]))
    why = "the file is truncated or corrupt" if truncated else "not a p2p-diloco checkpoint"
    assert f"cannot read checkpoint {path}: {why}" in line, line
    assert "invalid load key" not in line and "weights_only" not in line, line


def test_eval_with_another_model_shape_says_which_setting_differs(tmp_path):
    """Before: `... other shapes than this config's model: pass the run's --config` (the config is in the checkpoint;
    the --set was the problem)."""
    from tests.unit.test_export import _save_run

    _save_run(tmp_path, num_layers=1, hidden_size=64)
    line = one_line_error(run_cli("eval", "--checkpoint", str(tmp_path), "--set", "model.num_layers=4"))
    assert "model.num_layers=4 (the run's: 1)" in line and "--config" not in line, line
