"""Faults in every phase of a round, against the in-memory swarm: a peer killed or frozen mid all-reduce, deaths in
matchmaking and training, a corrupted theta, a donor dying mid-transfer, a graceful stop mid all-reduce, a joiner
arriving mid all-reduce. The same scenarios as the subprocess tests had (tests/swarm/test_faults.py keeps the
real-process ones), each in well under a second.

Each asserts: equal digests among the peers that finish, bounded time, no partial or solo step while other peers
were alive."""

from __future__ import annotations

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.outer.optimizer import digest
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import assert_consistent, assert_no_solo_steps, finals, one_digest

pytestmark = pytest.mark.sim
ALLREDUCE_TIMEOUT = 20.0  # the harness's swarm.allreduce_timeout


def _running(round_):
    return lambda e: e["event"] == Event.ALLREDUCE_RUNNING and e["round"] == round_


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_peer_lost_mid_allreduce(fault):
    """4 peers; one is killed (or frozen) while its parts are in flight in round 2. Killed: the survivors re-reduce
    its slice and commit that attempt among themselves (swarm/slice_repair.py). Frozen: they abort that all-reduce
    within the timeout and redo round 2 among themselves; it wakes up, takes the swarm's state and finishes with
    the same digest."""
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=4"]) as swarm:
        *rest, victim = [swarm.add() for _ in range(4)]
        swarm.net.slow_down(victim.name, 5.0)  # its parts trickle: the fault lands mid-transfer
        hit = {}

        def strike():
            hit["t"] = swarm.sim.now
            (swarm.net.kill if fault == "kill" else swarm.net.freeze)(victim.name)

        swarm.when(victim, _running(2), lambda: swarm.sim.call_at(swarm.sim.now + 0.5, strike))
        if fault == "freeze":  # wake it once every survivor holds theta(2)
            swarm.run_until(lambda: all(p.of(Event.OUTER_STEP, round=2) or [e for e in p.of(Event.STATE_LOADED)
                                                                         if e["round"] >= 2] for p in rest))
            swarm.net.thaw(victim.name)
        swarm.finish(rest if fault == "kill" else None)
        finished = rest if fault == "kill" else [*rest, victim]
        one_digest(finished)
        assert all(s["rounds_completed"] == 3 for s in finals(finished).values())
        if fault == "freeze":
            assert victim.of(Event.STATE_LOADED)
        for p in rest:
            if fault == "kill":
                done = p.of(Event.ALLREDUCE_DONE, round=2)
                assert done and done[-1]["lost"] == [victim.name] and done[-1]["group_size"] == 3, done
                assert not p.of(Event.ALLREDUCE_FAILED, round=2)
                continue
            failed = [e for e in p.of(Event.ALLREDUCE_FAILED, round=2) if e["t"] - swarm.sim.epoch >= hit["t"]]
            assert failed, f"{p.name}: the fault did not break an all-reduce in flight"
            assert failed[0]["t"] - swarm.sim.epoch - hit["t"] < ALLREDUCE_TIMEOUT + 5
            redo = p.of(Event.ALLREDUCE_DONE, round=2)
            took = [e for e in p.of(Event.STATE_LOADED) if e["round"] >= 2]
            assert (redo and 2 <= redo[-1]["group_size"] <= 3) or took, (redo, took)
        assert_no_solo_steps(rest)
        assert_consistent(swarm, finished)


def test_deaths_in_matchmaking_and_training_then_lone_peer_then_rejoin():
    """Kill one peer in matchmaking (round 1) and one in inner training (round 2): the last peer keeps training
    alone, and a new peer that joins later averages with it."""
    rounds = 20
    with SimSwarm([f"run.max_rounds={rounds}", "swarm.min_peers=3"]) as swarm:
        a, b, c = (swarm.add() for _ in range(3))
        for p in (a, c):  # a and c hold back 8 s: no group can form before b dies waiting in matchmaking
            swarm.net.hold(p.name, 0, 8.0)
        swarm.when(b, lambda e: e["event"] == Event.ALLREDUCE_START and e["round"] == 1, lambda: swarm.net.kill(b.name))
        swarm.when(c, lambda e: e["event"] == Event.INNER_PROGRESS and e["round"] == 2, lambda: swarm.net.kill(c.name))
        swarm.run_until(lambda: bool(a.of(Event.ALLREDUCE_DONE, lone=True)))
        d = swarm.add(sets=["swarm.min_peers=1"])
        swarm.finish([a, d])
        sa, sd = a.summary(), d.summary()
        assert sa["rounds_completed"] == sd["rounds_completed"] == rounds
        assert sa["global_digest"] == sd["global_digest"]
        assert a.of(Event.ALLREDUCE_DONE, round=1)[-1]["group_size"] == 2  # b died in matchmaking: never a group of 3
        assert any(e["group_size"] == 2 and e["round"] > 2 for e in a.of(Event.ALLREDUCE_DONE)), \
            "the newcomer never averaged with the lone peer"
        assert d.of(Event.STATE_LOADED)
        assert_consistent(swarm, [a, d])


def test_corrupted_theta_is_repaired_within_one_round():
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=3"]) as swarm:
        good1, good2, bad = (swarm.add() for _ in range(3))
        corrupted = []

        def corrupt():  # a bit flip or a bug: theta changes silently after the outer step of round 1
            state = bad.state
            with state.lock:
                state.theta[0].view(-1)[0] += 1e-3
                state.digest = digest(state.theta)
            corrupted.append(state.digest)

        swarm.when(bad, lambda e: e["event"] == Event.OUTER_STEP and e["round"] == 1, corrupt)
        swarm.finish()
        detected = bad.of(Event.DESYNC_DETECTED)
        assert detected and detected[0]["round"] == 2 and detected[0]["ours"] == corrupted[0]
        good = {e["digest"] for p in (good1, good2) for e in p.of(Event.OUTER_STEP, round=2)}
        assert len(good) == 1
        repaired = bad.of(Event.STATE_LOADED, round=2)
        assert repaired and repaired[-1]["digest"] in good, "not repaired by the end of round 2"
        assert not good1.of(Event.DESYNC_DETECTED) and not good2.of(Event.DESYNC_DETECTED)
        one_digest([good1, good2, bad])


def test_a_divergence_in_the_last_round_is_repaired_before_exit():
    """Issue 17, point 5: theta changes silently after the run's last outer step. Before, the peer went straight to
    lingering and exited with weights no one else held; now the digest vote runs before it leaves."""
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=3"]) as swarm:
        good1, good2, bad = (swarm.add() for _ in range(3))

        def corrupt():
            state = bad.state
            with state.lock:
                state.theta[0].view(-1)[0] += 1e-3
                state.digest = digest(state.theta + state.optimizer.momentum_buffers)

        swarm.when(bad, lambda e: e["event"] == Event.OUTER_STEP and e["round"] == 3, corrupt)
        swarm.finish()
        detected = bad.of(Event.DESYNC_DETECTED)
        assert detected and detected[0]["round"] == 3, bad.events
        assert bad.of(Event.STATE_LOADED, round=3)
        one_digest([good1, good2, bad])


def test_joiner_moves_to_another_donor_when_one_dies_mid_transfer():
    with SimSwarm(["run.max_rounds=20", "swarm.min_peers=2"], download_seconds=3.0) as swarm:
        a, b = swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP)))
        c = swarm.add(sets=["swarm.min_peers=1"])
        killed = {}

        def kill_donor(event):
            donor = a if event["from_peer"] == a.name else b
            killed["peer"] = donor
            swarm.sim.call_at(swarm.sim.now + 1.0, lambda: swarm.net.kill(donor.name))

        swarm.when(c, lambda e: e["event"] == Event.STATE_DOWNLOAD_START,
                   lambda: kill_donor(c.of(Event.STATE_DOWNLOAD_START)[0]))
        swarm.run_until(lambda: "peer" in killed)
        donor = killed["peer"]
        other = b if donor is a else a
        swarm.finish([other, c])
        failed = c.of(Event.STATE_DOWNLOAD_FAILED, from_peer=donor.name)
        assert failed, "the killed donor's transfer did not fail"
        loaded = c.of(Event.STATE_LOADED)
        assert loaded and loaded[0]["from_peer"] == other.name
        one_digest([other, c])


def test_graceful_stop_mid_allreduce_stops_cleanly_and_others_carry_on():
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=3"]) as swarm:
        *rest, victim = (swarm.add() for _ in range(3))
        swarm.net.slow_down(victim.name, 5.0)
        stopped_at = {}

        def stop():
            stopped_at["t"] = swarm.sim.now
            victim.stop.set()  # SIGTERM

        swarm.when(victim, _running(2), stop)
        swarm.finish([victim])
        assert swarm.sim.now - stopped_at["t"] < 20
        assert victim.summary()["stopped_early"] is True
        swarm.finish(rest)
        assert all(s["rounds_completed"] == 3 for s in finals(rest).values())
        one_digest(rest)
        assert_no_solo_steps(rest)


def test_joiner_arriving_mid_allreduce_starts_at_the_next_boundary():
    """A newcomer that arrives while the swarm is in its all-reduce must not join the round in flight: it waits,
    takes the swarm's theta, and averages with everyone from the next round it can start on time."""
    with SimSwarm(["run.max_rounds=4", "swarm.min_peers=2", "train.inner_steps=60"], transfer_seconds=15.0) as swarm:
        a, b = swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.ALLREDUCE_RUNNING, round=1)))
        c = swarm.add(sets=["swarm.min_peers=1"])
        swarm.finish()
        loaded = c.of(Event.STATE_LOADED)
        assert loaded and loaded[0]["round"] >= 1, loaded
        first = min(e["round"] for e in c.of(Event.ROUND_START))
        assert first in (2, 3), f"joined the round in flight or far too late (first round {first})"
        for p in (a, b, c):
            done = {e["round"]: e["group_size"] for e in p.of(Event.ALLREDUCE_DONE)}
            assert all(done.get(r) == 3 for r in range(first, 5)), (p.name, first, done)
        one_digest([a, b, c])


def test_a_round_mate_gone_for_less_than_the_confirmation_is_not_stepped_past():
    """Two peers average round 1; then b freezes for 14 s in its inner steps: its record expires (6 s) while a's
    first all-reduce attempt waits for it (10 s). a, alone in the records, must then confirm for a record lifetime
    (7 s) before a solo step, and b is back before that: round 2 is averaged as a pair, nobody steps alone."""
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=2"]) as swarm:
        a, b = swarm.add(), swarm.add()

        def freeze():
            swarm.net.freeze(b.name)
            swarm.sim.call_at(swarm.sim.now + 14.0, lambda: swarm.net.thaw(b.name))

        swarm.when(b, lambda e: e["event"] == Event.INNER_PROGRESS and e["round"] == 2, freeze)
        swarm.finish()
        assert_no_solo_steps([a, b])
        assert [e["group_size"] for e in a.of(Event.ALLREDUCE_DONE)] == [2, 2, 2]
        one_digest([a, b])


def test_the_same_scenario_gives_the_same_bits_every_time():
    def run():
        with SimSwarm(["run.max_rounds=3", "swarm.min_peers=3"]) as swarm:
            peers = [swarm.add() for _ in range(3)]
            swarm.finish()
            return one_digest(peers), [e["t"] for e in peers[0].events]

    assert run() == run()
