"""Round-boundary checkpoints of a simulated peer: a stop and a resume continue exactly (the file format, its
atomic writes and its checks have their own tests in tests/unit/test_checkpoint.py; the real CLI's in
tests/swarm/test_checkpoints.py)."""

from __future__ import annotations

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.testing.harness import SimSwarm

pytestmark = pytest.mark.sim


TOPK = ("outer.compression='topk'", "outer.aggregation='mean'")


def _lone(tmp_path, name, extra=(), resume=None, codec=()):
    with SimSwarm(["run.max_rounds=4", "data.seed=7", *codec, *extra]) as swarm:
        peer = swarm.add(name=name, resume_from=resume)
        if resume is None and extra:
            swarm.when(peer, lambda e: e["event"] == Event.CHECKPOINT_SAVED and e["round"] == 2, peer.stop.set)
        swarm.finish()
        return peer


def test_the_error_feedback_decay_reaches_the_peer(tmp_path):
    """outer.topk_error_decay (SparseLoCo's beta) is the peer's: a decayed error sends other bits from round 2 on."""
    plain = _lone(tmp_path, "plain", codec=TOPK).summary()
    decayed = _lone(tmp_path, "decayed", codec=(*TOPK, "outer.topk_error_decay=0.5")).summary()
    assert plain["rounds_completed"] == decayed["rounds_completed"] == 4
    assert decayed["global_digest"] != plain["global_digest"]


@pytest.mark.parametrize("codec", [(), TOPK, ("outer.fragments=2",), (*TOPK, "outer.fragments=2")],
                         ids=["none", "topk", "fragments", "topk-fragments"])
def test_stop_after_round_2_and_resume_is_bit_identical(tmp_path, codec):
    """With topk, the error feedback (what the peer has not sent yet) is part of what resumes exactly: without it
    round 3 sends other bits and the digests part. With fragments, so are the local weights (they are not theta at
    a boundary: the fragments not synced in the round keep training), and with both, each fragment's error."""
    straight = _lone(tmp_path, "straight", codec=codec).summary()
    ckpt = tmp_path / "ckpt"
    first = _lone(tmp_path, "first", [f"checkpoint.dir={ckpt}"], codec=codec).summary()
    assert first["stopped_early"] and first["rounds_completed"] == 2
    saved = CheckpointStore(ckpt).load()
    assert saved.round == 2
    assert ("error_feedback" in saved.extra) == (TOPK[0] in codec)
    resumed = _lone(tmp_path, "resumed", [f"checkpoint.dir={ckpt}", "checkpoint.resume=true"], resume=saved,
                    codec=codec)
    s = resumed.summary()
    assert s["rounds_completed"] == straight["rounds_completed"] == 4
    assert s["global_digest"] == straight["global_digest"], "resume did not continue exactly"
    assert s["tokens_trained"] == straight["tokens_trained"]
    assert [e["round"] for e in resumed.of(Event.RESUMED)] == [2]
    assert len(list(ckpt.glob("round-*.pt"))) == 3  # checkpoint.keep = 3
