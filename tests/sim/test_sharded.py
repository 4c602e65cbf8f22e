"""Sharded outer state (``outer.sharding = "sharded"``) against the in-memory swarm: 1-process peers that keep
every shard, one averager per shard."""

from __future__ import annotations

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import assert_consistent, assert_every_round_certified_alike, certificates, one_digest

pytestmark = pytest.mark.sim
ROUNDS = 4
SHARDED = [f"run.max_rounds={ROUNDS}", "swarm.min_peers=3", "outer.sharding=sharded", "outer.shards=3"]


def test_sharded_peers_commit_every_round_together():
    with SimSwarm(SHARDED) as swarm:
        a, b, c = swarm.add(), swarm.add(), swarm.add()
        swarm.finish()
        for p in (a, b, c):
            assert sorted(certificates(p)) == list(range(1, ROUNDS + 1)), p.events
            assert [e["group_size"] for e in p.of(Event.ALLREDUCE_DONE)] == [3] * ROUNDS
        assert certificates(a) == certificates(b) == certificates(c)
        one_digest([a, b, c])


def test_a_round_whose_shards_met_different_peers_is_not_committed():
    """Issue 17, point 11: in round 2, a's averager of shard 1 is averaged in another group (a stranger in place of
    one round-mate) while its shards 0 and 2 meet b and c. Every shard's group had the right size, so comparing sizes
    alone let a sign and the round commit with a shard averaged by other peers. Now a refuses the round (nothing
    applied, it does not sign), so no certificate of that attempt exists anywhere; the round is retried and all
    three commit the same certified rounds."""
    with SimSwarm(SHARDED) as swarm:
        a, b, c = swarm.add(), swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=1)))
        swarm.net.mix_shard(a.name, shard=1)
        swarm.finish()
        victim = max(b.name, c.name)
        failed = a.of(Event.ALLREDUCE_FAILED, round=2)
        assert failed and failed[0]["reason"] == (
            f"the shards' groups differ: shard 1 was averaged with other peers than shard 0 (only in shard 1: "
            f"['stranger'], only in shard 0: ['{victim}'])"), a.events
        for p in (b, c):  # they signed, a did not: they drop the attempt
            dropped = p.of(Event.COMMIT_FAILED, round=2)
            assert dropped and "did not sign" in dropped[0]["reason"], p.events
        assert_every_round_certified_alike([a, b, c], ROUNDS)
        assert_consistent(swarm)
