"""A checkpoint that cannot be written mid-run stops the peer with one line, once (before: an ERROR line every round,
no checkpoint ever written, and exit 0)."""

from __future__ import annotations

import errno

import pytest

from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.errors import RunError
from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimSwarm

pytestmark = pytest.mark.sim


def test_a_failed_checkpoint_write_stops_the_peer_and_names_the_last_good_one(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    real_save = CheckpointStore.save

    def disk_full_from_round_2(store, state):
        if state.round >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(store, state)

    monkeypatch.setattr(CheckpointStore, "save", disk_full_from_round_2)
    with SimSwarm(["run.max_rounds=4", f"checkpoint.dir={ckpt}"]) as swarm:
        peer = swarm.add(name="lone")
        swarm.finish()
    with pytest.raises(RunError) as excinfo:
        peer.summary()
    message = str(excinfo.value)
    assert "\n" not in message
    assert "checkpoint of round 2" in message and str(ckpt) in message and "No space left" in message, message
    assert "last checkpoint: round 1" in message and "--resume" in message, message
    assert [e["round"] for e in peer.of(Event.CHECKPOINT_SAVED)] == [0, 1]
    assert max(e["round"] for e in peer.of(Event.OUTER_STEP)) == 2  # it stopped at that round boundary
    assert [p.name for p in CheckpointStore(ckpt).paths()] == ["round-00000000.pt", "round-00000001.pt"]
