"""Swarm-wide round targets: when a round's inner training ends, from the peers' progress records."""

from dataclasses import replace

import pytest

from p2p_diloco.protocol.progress import swarm_progress
from p2p_diloco.protocol.records import Phase, PeerRecord

pytestmark = pytest.mark.unit


def _rec(round_, phase="train", round_tokens=0, step_tokens=1024, **more):
    return PeerRecord.from_wire({"round": round_, "phase": phase, "round_tokens": round_tokens,
                                 "step_tokens": step_tokens, **more})


def test_default_target_is_h_steps_of_every_live_peer_in_tokens():
    # this peer: 1024 tokens a step; the others: 1024 and 4096 (a bigger batch counts for more)
    records = {"a": _rec(3, round_tokens=10 * 1024), "b": _rec(3, round_tokens=2 * 4096, step_tokens=4096)}
    p = swarm_progress(3, own_tokens=5 * 1024, own_step_tokens=1024, view=records, inner_steps=20)
    assert p.target == 20 * (1024 + 1024 + 4096) and p.peers == 3
    assert p.done == 5 * 1024 + 10 * 1024 + 2 * 4096
    assert not p.reached and p.fraction == pytest.approx(p.done / p.target)
    # a fast peer's extra tokens make up for a slow one: reached although this peer did 5 of its H = 20 steps
    records["a"] = replace(records["a"], round_tokens=40 * 1024)
    records["b"] = replace(records["b"], round_tokens=19 * 4096)
    assert swarm_progress(3, 5 * 1024, 1024, records, 20).reached
    records["a"] = replace(records["a"], round_tokens=38 * 1024)
    assert not swarm_progress(3, 5 * 1024, 1024, records, 20).reached


def test_other_rounds_and_phases_do_not_count():
    records = {"behind": _rec(2, round_tokens=10**9), "joining": _rec(3, phase="join", round_tokens=10**9),
               "repairing": _rec(3, phase="repair", round_tokens=10**9)}
    p = swarm_progress(3, 1024, 1024, records, 20)
    assert (p.target, p.done, p.peers, p.reached) == (20 * 1024, 1024, 1, False)
    assert swarm_progress(3, 20 * 1024, 1024, records, 20).reached  # alone: H of our own steps


def test_a_peer_that_stopped_or_moved_on_ends_the_round_for_everyone():
    assert swarm_progress(3, 0, 1024, {"a": _rec(3, phase="sync", round_tokens=1024)}, 20).reached
    assert swarm_progress(3, 0, 1024, {"a": _rec(4)}, 20).reached
    assert swarm_progress(3, 0, 1024, {"a": _rec(4, phase="done")}, 20).reached  # it finished: we are behind
    assert not swarm_progress(3, 0, 1024, {"a": _rec(4, phase="join")}, 20).reached


def test_fixed_target_and_bad_records():
    p = swarm_progress(0, 100, 10, {"a": _rec(0, round_tokens=-5, step_tokens="x")}, 20, target_tokens=1000)
    assert (p.target, p.done) == (1000, 100)  # a bad count is 0 tokens done; a bad step size is ours
    p = swarm_progress(0, 100, 10, {"a": _rec(0, round_tokens=True, step_tokens=None)}, 20)
    assert (p.target, p.done) == (20 * 20, 100)


def test_training_peers_are_extrapolated_from_their_rate_and_the_records_age():
    rec = _rec(0, round_tokens=1000, tokens_per_s=500.0, t=100.0)
    assert swarm_progress(0, 0, 10, {"a": rec}, 20).done == 1000  # no `now`: no extrapolation
    assert swarm_progress(0, 0, 10, {"a": rec}, 20, now=101.0).done == 1500
    assert swarm_progress(0, 0, 10, {"a": rec}, 20, now=160.0).done == 2000  # capped at MAX_EXTRAPOLATION (2 s)
    assert swarm_progress(0, 0, 10, {"a": rec}, 20, now=90.0).done == 1000  # a clock behind ours: nothing
    stopped = replace(rec, phase=Phase.SYNC)
    assert swarm_progress(0, 0, 10, {"a": stopped}, 20, now=101.0).done == 1000  # it stopped: its count is final
    for bad in ({"tokens_per_s": "fast"}, {"tokens_per_s": float("nan")}, {"t": None}, {"tokens_per_s": -5.0}):
        assert swarm_progress(0, 0, 10, {"a": replace(rec, **bad)}, 20, now=101.0).done == 1000
