"""Invariant violations found by the protocol simulator (``python -m benchmarks.protocol_sim``, issue 17), each kept
as a test: first the shortest scenario of each kind written out, then every schedule the simulator found, replayed
from its seed with the simulator's invariant checker (``benchmarks/_protocol_sim_check.py``).

Every violation found so far was of the agreement invariant (no two honest peers commit different states for the
same round) and had one cause: a peer committed a round whose certificate it would refuse to follow from any other
peer. A group that keeps fewer than half of the group of the certificate it builds on fails the hand-off rule
(``certificate.keeps_enough``), and a newcomer's group with none of its ``--initial-peers`` fails its trust root
(``trust.trust_problem``); yet the commit step signed and committed such a round. A peer cut off from the others (a
partition, hidden records, a freeze across the others' commit or across the end of the run, a whole group failing
until everyone cooled everyone down) stepped alone or in a minority group, and a newcomer that found the swarm gone
started a chain of its own, while the others committed the same round differently: two states for one round. Since
822fce6 a peer signs no group and takes no solo step that its own chain would not follow
(``trust.extension_problem``), and gives up with a one-line error after ``swarm.round_timeout`` instead.

A newcomer (no certificate of its own) that waited for ``swarm.min_peers`` while the swarm it joined lingered at
the end of its run missed every donor, then started a chain of its own from theta(0) (seeds 922, 930): a swarm
already past our round now has no first round to wait for (``rules.decide_first_round``). In seeds 75, 311 and
505 the newcomer arrived after every peer it was given had left; the in-memory swarm now refuses to start it, as
hivemind's DHT bootstrap does when none of the initial peers answers (a newcomer that reaches only a bootstrap
node, the trainers gone, still starts a chain of its own: docs/protocol.md, "Known limits").
"""

from __future__ import annotations

import pytest

from benchmarks._protocol_sim_run import Run
from benchmarks._protocol_sim_schedule import draw
from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import forks

pytestmark = pytest.mark.sim


def test_a_peer_frozen_across_the_end_of_the_run_does_not_commit_the_last_round_alone():
    """Seeds 194, 292, 304 (and 10 more): c is frozen as the last round starts; a and b commit it and leave; c woke
    up alone and, with no round-mate's record left, stepped alone: a certificate of one member (of a group of three)
    for a round a and b certified with another state."""
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=3"]) as swarm:
        a, b, c = swarm.add(name="a"), swarm.add(name="b"), swarm.add(name="c")
        swarm.when(c, lambda e: e["event"] == Event.ROUND_START and e["round"] == 3, lambda: (
            swarm.net.freeze(c.name), swarm.sim.call_at(swarm.sim.now + 25.0, lambda: swarm.net.thaw(c.name))))
        swarm.finish([a, b])
        swarm.sim.run(max_time=swarm.sim.now + 120.0)  # c's last decisions (a finished c would be done by now)
        assert not forks([a, b, c]), [e for e in c.events if e["event"] in (Event.OUTER_STEP, Event.ALLREDUCE_DONE)]


def test_the_minority_side_of_a_partition_does_not_commit_a_round_of_its_own():
    """Seeds 279, 281, 301 (and 36 more): c cannot read a's and b's records, nor they c's, for 20 s from the start
    of round 2. a and b commit round 2 together; c, alone on its side for a record lifetime, steps alone: another
    state for round 2, certified by 1 of the 3 members of round 1's group (and, a and b having finished meanwhile,
    it goes on alone for rounds 3 and 4)."""
    with SimSwarm(["run.max_rounds=4", "swarm.min_peers=3"]) as swarm:
        a, b, c = swarm.add(name="a"), swarm.add(name="b"), swarm.add(name="c")

        def partition() -> None:
            pairs = [(c.name, a.name), (c.name, b.name), (a.name, c.name), (b.name, c.name)]
            for reader, owner in pairs:
                swarm.net.hide(reader, owner)
            swarm.sim.call_at(swarm.sim.now + 20.0, lambda: [swarm.net.unhide(r, o) for r, o in pairs])

        swarm.when(a, lambda e: e["event"] == Event.ROUND_START and e["round"] == 2, partition)
        swarm.finish([a, b])
        swarm.sim.run(max_time=swarm.sim.now + 120.0)
        assert not forks([a, b, c])


def test_peers_whose_groups_always_fail_do_not_each_step_alone():
    """Seeds 146, 377, 399, 708, 833, 990: a leader that waits for more peers than there are (hivemind's followers
    accept the group a leader sends) makes every attempt of round 2 fail. After swarm.round_timeout of failures that
    single nobody out, every peer cools every other one down (liveness.py) and each steps alone: three states for
    round 2. A peer alone is 1 of the 3 members of round 1's group: it cannot extend the chain, and must not commit."""
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=3"]) as swarm:
        a, b, c = swarm.add(name="a"), swarm.add(name="b"), swarm.add(name="c")
        swarm.when(a, lambda e: e["event"] == Event.ROUND_START and e["round"] == 2,
                   lambda: swarm.net.lead(a.name, size=4, groups=10**6))
        swarm.sim.run(max_time=900.0)
        assert not forks([a, b, c])


# Every schedule of `python -m benchmarks.protocol_sim --quick` (seeds 1..1000, f=2) that broke an invariant, by
# kind (each replays with `python -m benchmarks.protocol_sim --replay SEED --events`).
FOUND = {
    "partition-minority": (5, 16, 29, 61, 99, 120, 130, 230, 273, 279, 281, 291, 301, 386, 388, 403, 488, 494, 529,
                           559, 562, 591, 606, 611, 616, 631, 707, 746, 770, 803, 840, 871, 891, 899, 931, 962, 972,
                           978, 999),
    "frozen-minority": (194, 202, 292, 304, 400, 485, 711, 739, 765, 769, 818, 888, 948),
    "stuck-leader-cooling": (146, 377, 399, 708, 833, 990),
    "survivors-below-half": (528,),
    "newcomer-waiting-for-min-peers": (922, 930),
    "newcomer-after-the-run": (75, 311, 505),
}


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"{kind}-{seed}") for kind, seeds in FOUND.items()
                                  for seed in seeds])
def test_schedule_found_by_the_simulator(seed):
    outcome = Run(draw(seed)).run()
    assert not outcome.violations, "\n".join(v.line() for v in outcome.violations)
