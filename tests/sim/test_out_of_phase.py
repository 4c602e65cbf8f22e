"""Two peers one attempt out of phase in the commit step (seen once in CI, tests/swarm/test_cluster_sharded.py):
every attempt of round 2 completed its all-reduce, and every commit failed with "1 of 2 members did not sign in
time", because each peer got its result about one commit window (``swarm.peer_ttl``, 6 s) after the other: its
signature came just as the other's window closed, and the other's signature blob (ttl: one window) had expired.

What brings a pair back in phase (the scenarios below): a group ends for all its members at once, and a retry
can only complete in a group with the other member's retry; so a member that failed, or whose commit window ran
out, waits in matchmaking (2 x ``swarm.matchmaking_time``, retried at once) until the other's window is over, and
the next attempt ends on both at the same instant. A lag between members of one group is absorbed by the commit
window (``peer/certifier.py``: each member waits one window from its *own* result, and its signature lives one
window), as long as it is under one window. What the protocol cannot absorb is a lag of a whole window on *every*
attempt: the pair then stays one window out of phase for good (docs/protocol.md, "Known limits").

The in-memory swarm completes a group for every member at the same virtual instant, so a member's lag is injected
here by wrapping its ``FakeSwarm.all_reduce``: the result comes back ``lag`` virtual seconds after the group ended.
"""

from __future__ import annotations

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimPeer, SimSwarm
from tests.sim.helpers import assert_consistent, assert_every_round_certified_alike

pytestmark = pytest.mark.sim
ROUNDS = 3
WINDOW = 6.0  # the commit window: swarm.peer_ttl (its default)
SHARDING = pytest.mark.parametrize("sharding", [[], ["outer.sharding=sharded", "outer.shards=3"]],
                                   ids=["whole", "sharded"])
KINDS = (Event.ALLREDUCE_START, Event.ALLREDUCE_DONE, Event.ALLREDUCE_FAILED, Event.COMMIT_FAILED, Event.OUTER_STEP)


def _pair(sharding: list[str]) -> tuple[SimSwarm, SimPeer, SimPeer]:
    swarm = SimSwarm([f"run.max_rounds={ROUNDS}", "swarm.min_peers=2", f"swarm.peer_ttl={WINDOW}", *sharding])
    a, b = swarm.add(name="a"), swarm.add(name="b")
    swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=1) and b.of(Event.OUTER_STEP, round=1)))
    return swarm, a, b


def _late(swarm: SimSwarm, peer: SimPeer, lag: float, groups: int) -> None:
    """The next ``groups`` all-reduces ``peer`` completes hand it the (complete) average ``lag`` seconds after the
    group ended for the others (a member that reads its last part late, or whose ranks agree late)."""
    fake = swarm.net.swarms[peer.name]
    inner, left = fake.all_reduce, [groups]

    def all_reduce(request):
        result = inner(request)
        if left[0] > 0:
            left[0] -= 1
            swarm.sim.clock.sleep(lag)
        return result

    fake.all_reduce = all_reduce


def _trace(*peers: SimPeer) -> str:
    rows = sorted((e["t"], p.name, e["event"], e["round"], e.get("attempt", ""), e.get("reason", ""))
                  for p in peers for e in p.events if e["event"] in KINDS)
    t0 = rows[0][0] if rows else 0.0
    return "\n" + "\n".join(f"{t - t0:8.2f} {name} {kind:16} r{r} {att} {why[:60]}"
                            for t, name, kind, r, att, why in rows)


def _done(peer: SimPeer, round_: int) -> list[float]:
    return [e["t"] for e in peer.of(Event.ALLREDUCE_DONE, round=round_)]


@SHARDING
def test_a_member_that_failed_while_the_other_signed_gets_back_in_phase(sharding):
    """b fails the all-reduce of round 2 (its answers came late) while a holds the complete average: a signs and
    waits out its commit window, b retries at once. b's retry waits in matchmaking until a's window is over; then
    one group takes both retries, it ends on both at the same instant, and both commit its round, one window after
    the first attempt."""
    swarm, a, b = _pair(sharding)
    with swarm:
        swarm.net.fail_late(b.name)
        swarm.finish()
        trace = _trace(a, b)
        first = _done(a, 2)[0]
        assert "did not sign" in a.of(Event.COMMIT_FAILED, round=2)[0]["reason"], trace
        assert len(a.of(Event.ALLREDUCE_START, round=2)) == 2 and len(b.of(Event.ALLREDUCE_START, round=2)) == 2, trace
        assert _done(a, 2)[1:] == _done(b, 2), trace  # the retry ended on both at once
        assert _done(b, 2)[0] - first < WINDOW + 1.0, trace  # right after a's window: no attempt lost in between
        assert_every_round_certified_alike([a, b], ROUNDS)
        assert_consistent(swarm)


@SHARDING
def test_a_member_whose_result_comes_late_within_the_commit_window_still_commits(sharding):
    """b gets the average of round 2 4 s after a (more than the half window in which a member may sign after its
    result, less than the window): each member counts its window from its own result and its signature lives a
    whole window, so a still reads b's signature and b still reads a's. Both commit that very attempt."""
    swarm, a, b = _pair(sharding)
    with swarm:
        _late(swarm, b, lag=4.0, groups=1)
        swarm.finish()
        trace = _trace(a, b)
        assert not a.of(Event.COMMIT_FAILED) and not b.of(Event.COMMIT_FAILED), trace
        assert len(a.of(Event.ALLREDUCE_START, round=2)) == len(b.of(Event.ALLREDUCE_START, round=2)) == 1, trace
        assert _done(b, 2)[0] - _done(a, 2)[0] == pytest.approx(4.0), trace
        assert_every_round_certified_alike([a, b], ROUNDS)
        assert_consistent(swarm)


@SHARDING
def test_a_one_off_lag_of_a_whole_commit_window_costs_one_attempt(sharding):
    """b gets the average of round 2 a whole window (6.5 s) after a, once: that is the CI picture for one attempt
    (b's result comes as a's window closes, a's signature has expired), and the attempt commits nowhere. a went back
    to matchmaking at the end of its window; b joins it at the end of its own, the retry ends on both at once, and
    both commit round 2 in their second attempt."""
    swarm, a, b = _pair(sharding)
    with swarm:
        _late(swarm, b, lag=WINDOW + 0.5, groups=1)
        swarm.finish()
        trace = _trace(a, b)
        for p, other in ((a, b.name), (b, a.name)):
            failed = p.of(Event.COMMIT_FAILED, round=2)
            assert len(failed) == 1 and f"did not sign in time: ('{other}',)" in failed[0]["reason"], trace
            assert len(p.of(Event.ALLREDUCE_START, round=2)) == 2, trace
        assert _done(a, 2)[1] == _done(b, 2)[1], trace  # back in phase
        assert _done(a, 2)[1] - _done(a, 2)[0] < 2 * WINDOW + 2.0, trace  # b's window, then one all-reduce
        assert_every_round_certified_alike([a, b], ROUNDS)
        assert_consistent(swarm)
