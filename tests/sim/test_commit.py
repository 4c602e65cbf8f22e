"""The commit step against the in-memory swarm: members never end a round differently, no leader alone decides
a group, and every committed round carries a certificate signed by every member (issue 17, points 3 and 4)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.metrics.events import Event
from p2p_diloco.protocol.certificate import Certificate
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import assert_consistent, assert_every_round_certified_alike, one_digest

pytestmark = pytest.mark.sim
ROUNDS = 4


def test_a_member_failing_after_the_others_completed_commits_nothing_anywhere():
    """Member c fails the all-reduce of round 2 (its answers came too late) while a and b hold the complete
    average. a and b signed, c did not: no certificate of that group can exist, so nobody applies it; the round
    is retried and all three commit the same certified rounds. Before the commit step, a and b applied round 2
    and c had to download it (a member disagreement)."""
    with SimSwarm([f"run.max_rounds={ROUNDS}", "swarm.min_peers=3"]) as swarm:
        a, b, c = swarm.add(), swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=1)))
        swarm.net.fail_late(c.name)
        swarm.finish()
        for p in (a, b):
            failed = p.of(Event.COMMIT_FAILED, round=2)
            assert failed and "did not sign" in failed[0]["reason"], p.events
        assert_every_round_certified_alike([a, b, c], ROUNDS)
        assert_consistent(swarm)


def test_a_leader_cannot_shrink_the_group():
    """a leads the matchmaking of round 2 with a group of 2 while every member expects 3 (hivemind's followers
    accept the group a leader sends). Members that expected 3 refuse to sign; no group of 2 commits; the round is
    retried with all three. Before the commit step, the pair applied round 2 and the third peer had to catch up."""
    with SimSwarm([f"run.max_rounds={ROUNDS}", "swarm.min_peers=3"]) as swarm:
        a, b, c = swarm.add(), swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=1)))
        swarm.net.lead(a.name, size=2)
        swarm.finish()
        refused = [e for p in (a, b, c) for e in p.of(Event.ALLREDUCE_FAILED) if "refused the group" in e["reason"]]
        assert refused and "a group of 2, we expected 3" in refused[0]["reason"], [p.events for p in (a, b, c)]
        assert_every_round_certified_alike([a, b, c], ROUNDS)


def test_every_committed_round_is_certified_by_all_its_members_and_chained():
    with SimSwarm([f"run.max_rounds={ROUNDS}", "swarm.min_peers=3"]) as swarm:
        peers = [swarm.add(), swarm.add(), swarm.add()]
        swarm.finish()
        keys = swarm.net.keys
        heads = {p.summary()["chain_head"] for p in peers}
        assert len(heads) == 1 and heads != {""}
        state = peers[0].peer.ctx.state
        cert = state.certificate
        assert isinstance(cert, Certificate) and cert.problem(keys) is None
        assert cert.statement.members == tuple(sorted(p.name for p in peers)) and cert.round == ROUNDS - 1
        assert cert.statement.after == state.digest == one_digest(peers)
        for p in peers:
            assert [e["signers"] for e in p.of(Event.OUTER_STEP)] == [3] * ROUNDS


@pytest.mark.parametrize("sharding", [[], ["outer.sharding=sharded", "outer.shards=3"]], ids=["whole", "sharded"])
def test_a_retry_after_an_incomplete_commit_averages_each_members_own_pseudo_gradient(sharding):
    """c fails the all-reduce of round 2 after a and b got the complete average, so that attempt commits nothing
    and is retried. Every member must send the retry what it sent the first time: its own pseudo-gradient. (Found
    by the protocol simulator: a and b's buffer held the failed attempt's average by then, and the retry averaged
    that average with c's own.)"""
    with SimSwarm([f"run.max_rounds={ROUNDS}", "swarm.min_peers=3", *sharding]) as swarm:
        a, b, c = swarm.add(), swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=1)))
        swarm.net.fail_late(c.name)
        swarm.finish()
        completed = [g for g in swarm.net.groups if g.result and g.calls[0].request.round == 1]
        assert len(completed) >= 2, [g.failure for g in swarm.net.groups]  # the incomplete commit, then the retry
        for p in (a, b, c):
            sent = [g.sent[p.name] for g in completed]
            assert all(torch.equal(sent[0], s) for s in sent[1:]), p.name
        one_digest([a, b, c])
