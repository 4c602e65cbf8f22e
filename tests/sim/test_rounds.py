"""Rounds under stragglers and speeds, against the in-memory swarm: adaptive deadlines with a stuck peer
(``swarm.deadlines``), peers of different speeds (``round.mode``), and overlapped rounds (``outer.overlap``) with a
joiner and a kill."""

from __future__ import annotations

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import assert_consistent, assert_no_solo_steps, finals, one_digest

pytestmark = pytest.mark.sim
STALL, STALL_ROUND, FLOOR, ROUNDS, MATCHMAKING = 20.0, 4, 3.0, 5, 5.0


def _wait_in(peer, r: int) -> float:
    """Seconds from the peer's inner_done to its allreduce_done in round r."""
    done = peer.of(Event.INNER_DONE, round=r)[0]["t"]
    return peer.of(Event.ALLREDUCE_DONE, round=r)[0]["t"] - done


@pytest.mark.parametrize("deadlines", ["adaptive", "fixed"])
def test_stuck_straggler(deadlines):
    """Peer 2 stalls for STALL seconds before the inner steps of round STALL_ROUND while its records stay live.
    Adaptive deadlines leave it out after about the floor (it catches up afterwards); fixed ones (the control) wait
    for it, which shows that the scenario measures the wait it claims."""
    sets = [f"run.max_rounds={ROUNDS}", "swarm.min_peers=3", f"swarm.deadlines={deadlines}",
            f"swarm.straggler_floor={FLOOR}"]
    with SimSwarm(sets) as swarm:
        peers = [swarm.add(), swarm.add(), swarm.add(stalls={STALL_ROUND: STALL})]
        swarm.finish()
        one_digest(peers)  # the straggler caught up either way
        for p in peers[:2]:
            groups = {e["round"]: e["group_size"] for e in p.of(Event.ALLREDUCE_DONE)}
            dropped = p.of(Event.STRAGGLERS_DROPPED)
            starts = p.of(Event.ALLREDUCE_START, round=STALL_ROUND)
            if deadlines == "fixed":
                assert groups == {r: 3 for r in range(1, ROUNDS + 1)}, groups
                assert not dropped and _wait_in(p, STALL_ROUND) > STALL / 2
                assert all(s["straggler_s"] == 600.0 for s in starts), starts
                continue
            assert groups[STALL_ROUND] == 2 and all(groups[r] == 3 for r in range(1, STALL_ROUND)), groups
            assert [(d["round"], len(d["peers"])) for d in dropped] == [(STALL_ROUND, 1)], dropped
            assert all(FLOOR <= s["straggler_s"] < STALL / 2 for s in starts), starts
            assert dropped[0]["waited_s"] < max(starts[0]["straggler_s"], MATCHMAKING + 0.5) + 2, (dropped, starts)
            assert _wait_in(p, STALL_ROUND) < STALL / 2
        if deadlines == "adaptive":  # the stalled peer took the state of the pair instead of averaging
            assert peers[2].of(Event.STATE_LOADED)


H, FAST_STEP, SLOW_STEP, MAX_WAIT = 40, 0.07, 0.22, 3.0


def _waits(peer) -> dict[int, float]:
    done = {e["round"]: e["t"] for e in peer.of(Event.INNER_DONE)}
    return {e["round"]: e["t"] - done[e["round"]] for e in peer.of(Event.ALLREDUCE_DONE)}


@pytest.mark.parametrize("mode", ["swarm_target", "fixed_steps"])
def test_slow_peer(mode):
    """Three peers, one about 3x slower. Under swarm_target the round ends for everyone when the swarm's tokens
    reach the target: nobody waits long, every peer is in every all-reduce, and the slow peer trains fewer tokens.
    fixed_steps is the control: the fast peers wait for the slow one every round."""
    with SimSwarm([f"round.mode={mode}", f"train.inner_steps={H}", "run.max_rounds=3", "swarm.min_peers=3"]) as swarm:
        peers = [swarm.add(step_seconds=FAST_STEP), swarm.add(step_seconds=FAST_STEP),
                 swarm.add(step_seconds=SLOW_STEP)]
        swarm.finish()
        assert_consistent(swarm)
        one_digest(peers)
        for p in peers:
            assert {e["round"]: e["group_size"] for e in p.of(Event.ALLREDUCE_DONE)} == {1: 3, 2: 3, 3: 3}
        steps = [{e["round"]: e["inner_steps"] for e in p.of(Event.INNER_DONE)} for p in peers]
        worst = max(w for p in peers for w in _waits(p).values())
        if mode == "fixed_steps":
            assert all(s == {1: H, 2: H, 3: H} for s in steps), steps
            assert worst > H * (SLOW_STEP - FAST_STEP) / 2  # the control: fast peers wait for the slow one
            return
        assert worst < MAX_WAIT
        # the swarm trains its target, H steps of every peer, each round (a little more: records are read every
        # round.progress_period, and extrapolated in between)
        target = H * 3 * peers[0].training.tokens_per_step
        for r in (1, 2, 3):
            done = sum(e["tokens"] for p in peers for e in p.of(Event.INNER_DONE, round=r))
            assert target <= done <= 1.2 * target, (r, done, target)
        summaries = finals(peers)
        slow, fast = summaries[peers[2].name], [summaries[p.name] for p in peers[:2]]
        assert all(slow["tokens_trained"] < f["tokens_trained"] for f in fast), summaries
        for r in (1, 2, 3):
            assert all(steps[2][r] < steps[i][r] for i in (0, 1)), steps


def _overlapped(peer, r: int) -> bool:
    """Round r's all-reduce finished after the peer had started training round r+1."""
    started = peer.of(Event.ROUND_START, round=r + 1)
    done = peer.of(Event.ALLREDUCE_DONE, round=r)
    return bool(started and done) and done[-1]["t"] > started[0]["t"]


def test_overlapped_swarm_is_bit_identical_and_hides_the_sync():
    with SimSwarm(["outer.overlap=true", "outer.compression=int8", "run.max_rounds=4", "swarm.min_peers=3"],
                  transfer_seconds=0.5) as swarm:
        peers = [swarm.add() for _ in range(3)]
        swarm.finish()
        one_digest(peers)
        assert_consistent(swarm)
        for p in peers:
            s = p.summary()
            assert s["rounds_completed"] == 4 and s["rounds_participated"] == 4
            assert s["eval_loss_last"] < s["eval_loss_first"]
            assert [e["round"] for e in p.of(Event.OUTER_STEP)] == [1, 2, 3, 4]
            assert [e["group_size"] for e in p.of(Event.ALLREDUCE_DONE)] == [3, 3, 3, 3]
            assert len(p.of(Event.ROUND_START)) == 4  # the last round is not trained: theta(4) is the last one
            assert any(_overlapped(p, r) for r in (1, 2, 3)), "no all-reduce ran behind inner steps"
            assert sorted(e["round"] for e in p.of(Event.EVAL)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("fragments", [1, 2], ids=["eager", "streaming"])
def test_overlap_survives_a_joiner_and_a_kill(fragments):
    """Two overlapped peers; a third joins mid-run and averages with them; then one of the first two is killed
    while its all-reduce runs in the background. The other two finish with one digest and no solo step. With
    fragments (streaming, peer/streaming.py) the joiner trains while it catches up, and its training is merged,
    not thrown away."""
    rounds = 10
    sets = ["outer.overlap=true", f"outer.fragments={fragments}", "train.inner_steps=50", f"run.max_rounds={rounds}"]
    with SimSwarm(sets) as swarm:
        a, b = swarm.add(sets=["swarm.min_peers=2"]), swarm.add(sets=["swarm.min_peers=2"])
        swarm.run_until(lambda: bool([e for e in a.of(Event.OUTER_STEP) if e["round"] >= 2]))
        c = swarm.add()
        swarm.run_until(lambda: bool([e for e in c.of(Event.ALLREDUCE_DONE) if e["group_size"] == 3]))
        swarm.when(b, lambda e: e["event"] == Event.ALLREDUCE_START and e["expected_group_size"] == 3,
                   lambda: swarm.net.kill(b.name))
        swarm.finish([a, c])
        sa, sc = a.summary(), c.summary()
        assert sa["rounds_completed"] == sc["rounds_completed"] == rounds
        assert sa["global_digest"] == sc["global_digest"]
        assert c.of(Event.STATE_LOADED)
        assert_consistent(swarm, [a, c])
        assert_no_solo_steps([a, c])
