"""Streaming DiLoCo (``outer.fragments``) against the in-memory swarm: blocking and overlapped fragment rounds stay
bit-identical across peers and send one fragment per round. (A joiner and a kill: tests/sim/test_rounds.py; stop
and resume: tests/sim/test_checkpoints.py; the real data plane: tests/swarm/test_swarm.py.)"""

from __future__ import annotations

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import assert_consistent, one_digest

pytestmark = pytest.mark.sim
ROUNDS = 6


def _run(sets: list[str]):
    with SimSwarm(["outer.compression=int8", *sets, f"run.max_rounds={ROUNDS}", "swarm.min_peers=3"],
                  transfer_seconds=0.5) as swarm:
        peers = [swarm.add() for _ in range(3)]
        swarm.finish()
        assert_consistent(swarm)
        return peers, one_digest(peers)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_fragment_rounds_are_bit_identical_and_send_one_fragment(overlap):
    """The fake model has two tensors of 16 values: with F = 2 a round sends half of what a whole round sends, and
    every peer commits every round with the whole group."""
    whole, whole_digest = _run([f"outer.overlap={str(overlap).lower()}"])
    peers, digest = _run(["outer.fragments=2", f"outer.overlap={str(overlap).lower()}"])
    assert digest != whole_digest  # not silently the whole-model rounds
    sent = [e["bytes_sent"] for e in whole[0].of(Event.ALLREDUCE_DONE)]
    for p in peers:
        s = p.summary()
        assert s["rounds_completed"] == s["rounds_participated"] == ROUNDS
        assert s["eval_loss_last"] < s["eval_loss_first"]
        assert [e["round"] for e in p.of(Event.OUTER_STEP)] == list(range(1, ROUNDS + 1))
        done = p.of(Event.ALLREDUCE_DONE)
        assert [e["group_size"] for e in done] == [3] * ROUNDS
        assert all(e["bytes_sent"] < 0.6 * w for e, w in zip(done, sent)), ([e["bytes_sent"] for e in done], sent)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_topk_fragment_rounds_are_bit_identical(overlap):
    """topk with fragments keeps one error feedback per fragment (outer/error_feedback.py: FragmentFeedback): every
    peer still commits every round with the whole group, to one digest, and that digest is not int8's (the codec
    in use is topk)."""
    mode = f"outer.overlap={str(overlap).lower()}"
    topk = ["outer.fragments=2", "outer.compression='topk'", "outer.aggregation='mean'", "outer.topk_bits=2", mode]
    peers, digest = _run(topk)
    _, int8_digest = _run(["outer.fragments=2", mode])
    assert digest != int8_digest
    for p in peers:
        s = p.summary()
        assert s["rounds_completed"] == s["rounds_participated"] == ROUNDS
        assert [e["group_size"] for e in p.of(Event.ALLREDUCE_DONE)] == [3] * ROUNDS
        assert s["eval_loss_last"] < s["eval_loss_first"]
