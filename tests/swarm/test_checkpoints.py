"""Checkpoints through the real CLI, on disk: exact resume after SIGTERM, bad checkpoints. (A restarted peer that
takes the swarm's state when the swarm is ahead: tests/sim/test_joining.py.)"""

import signal
import time

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointStore, PeerState, capture_rng
from p2p_diloco.config import Config
from p2p_diloco.outer.optimizer import digest

from p2p_diloco.metrics.events import Event
from tests.conftest import survivors
from tests.swarm.helpers import FAULT, LONE, Proc, events_of, load_json, wait_for_event

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(420)]


def _lone(tmp_path, tag, name, *args, rounds=4):
    return Proc(["join", "--run-id", f"t-ckpt-{name}", "--data-seed", "7", "--max-rounds", str(rounds),
                 "--log-dir", str(tmp_path / name), "--summary-json", str(tmp_path / f"{name}.json"), *FAULT, *LONE,
                 *args],
                tag)


def test_stop_after_round_2_and_resume_is_bit_identical(tmp_path, reap):
    """A lone peer run for 5 rounds == the same peer run with --max-rounds 4, stopped (SIGTERM) after round 2 and
    resumed with --max-rounds 5: an exact resume, and an extended one (the inner lr schedule's horizon is
    train.total_steps, left at its default here, never a peer's own --max-rounds: with a horizon of 4 rounds, the
    stopped peer's first rounds would already differ from the straight run's)."""
    straight = _lone(tmp_path, reap, "straight", rounds=5)
    ckpt = tmp_path / "ckpt"
    first = _lone(tmp_path, reap, "first", "--checkpoint-dir", str(ckpt))
    first.wait_joined()
    wait_for_event(tmp_path / "first" / first.peer_id / "events.jsonl",
                   lambda e: e["event"] == Event.CHECKPOINT_SAVED and e["round"] == 2, 240, first)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.stderr_tail()  # 128 + SIGTERM, after a clean stop
    stopped = load_json(tmp_path / "first.json")
    assert stopped["stopped_early"] and stopped["rounds_completed"] in (2, 3)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names[-1] in ("round-00000002.pt", "round-00000003.pt") and not any(n.startswith(".tmp") for n in names)
    resumed = _lone(tmp_path, reap, "resumed", "--checkpoint-dir", str(ckpt), "--resume", rounds=5)
    assert resumed.wait(240) == 0, resumed.stderr_tail()
    assert straight.wait(240) == 0, straight.stderr_tail()
    a, b = load_json(tmp_path / "straight.json"), load_json(tmp_path / "resumed.json")
    assert a["rounds_completed"] == b["rounds_completed"] == 5
    assert a["global_digest"] == b["global_digest"], "a run stopped after round 2 and extended from --max-rounds 4 " \
                                                     "to 5 did not continue exactly"
    assert a["tokens_trained"] == b["tokens_trained"]
    ev = events_of(tmp_path / "resumed", resumed)
    assert [e["round"] for e in ev if e["event"] == Event.RESUMED] == [stopped["rounds_completed"]]
    assert len(list(ckpt.glob("round-*.pt"))) == 3  # keep = 3
    assert not survivors(reap)


def _write_checkpoints(directory, rounds: int) -> None:
    """Round-boundary checkpoints of the default config, as a peer writes them (the CLI checks these before it
    builds anything; their contents are never trained on here)."""
    store = CheckpointStore(directory)
    for r in range(rounds + 1):
        theta = [torch.full((4, 4), float(r)), torch.zeros(4)]
        momentum = [torch.zeros_like(t) for t in theta]
        store.save(PeerState(round=r, fingerprint=Config().fingerprint(), global_digest=digest(theta + momentum),
                             theta=theta, momentum=momentum, model={}, inner_optimizer={}, data={},
                             rng=capture_rng(), extra={}))


@pytest.mark.light
def test_corrupt_or_mismatched_checkpoint_is_a_clear_error_and_the_good_one_stays(tmp_path, reap):
    ckpt = tmp_path / "ckpt"
    _write_checkpoints(ckpt, rounds=2)
    files = sorted(ckpt.glob("round-*.pt"))
    good, latest = files[-2], files[-1]
    good_bytes = good.read_bytes()
    latest.write_bytes(latest.read_bytes()[: len(latest.read_bytes()) // 2])  # torn write / disk corruption
    for extra in ([], ["--set", "model.num_layers=3"]):
        t0 = time.monotonic()
        bad = Proc(["join", "--run-id", "t-ckpt-bad", "--max-rounds", "4", "--checkpoint-dir", str(ckpt),
                    "--resume", *FAULT, *extra], reap)
        assert bad.wait(60) == 2
        assert time.monotonic() - t0 < 60
        err = bad.stderr_tail().strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert str(latest.name) in err[0] or "config" in err[0], err
        latest.unlink() if extra == [] else None  # second pass: the good checkpoint, but another config
    assert good.read_bytes() == good_bytes, "a failed resume touched the good checkpoint"
    assert not survivors(reap)
