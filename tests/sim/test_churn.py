"""Churn at scale (issue 20), each scenario found by a benchmark and kept here short, against the in-memory swarm:

* half of a certified group killed and restarted from its checkpoints (``benchmarks/chaos.py``): the survivors could
  not extend the chain without them and refused every group, while the restarted members waited for the round to
  end: a livelock;
* every attempt of the first round failing for everyone (an outage; at N = 70, a group over the certificate's cap):
  after ``swarm.round_timeout`` each peer had cooled every other one down and stepped alone (``benchmarks/
  protocol_sim.py --scale 70``): as many states of round 1 as peers;
* more live peers than a certificate holds: no group could ever form. Now a group of the seated peers does, and
  the others sit the round out (``consensus.seats``); here with the cap lowered to 4.
"""

from __future__ import annotations

import pytest

from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.metrics.events import Event
from p2p_diloco.protocol import certificate, commit, rules
from p2p_diloco.testing.harness import SimSwarm

from .helpers import assert_consistent, assert_no_solo_steps, forks, one_digest, roots

pytestmark = pytest.mark.sim


def test_restarted_members_of_a_group_rejoin_its_round_and_the_survivors_wait_for_them(tmp_path):
    """5 peers certify round 1 together; in round 2, c, d and e are killed and restarted from their round-1
    checkpoints (same identities). a and b alone keep 2 of 5 (the hand-off needs half): they wait for the
    restarted members, which start round 2 at once instead of waiting for its end; round 2 commits with the
    first of them ready after the straggler deadline (3 of 5), and no group is refused after its transfer."""
    names = "abcde"
    dirs = {n: tmp_path / n for n in names}
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=5"]) as swarm:
        peers = {n: swarm.add(name=n, sets=[f"checkpoint.dir={dirs[n]}"]) for n in names}

        def kill_and_restart() -> None:
            for n in "cde":
                swarm.net.kill(n)
            swarm.sim.call_at(swarm.sim.now + 2.0, restart)

        def restart() -> None:
            for n in "cde":
                peers[n] = swarm.add(name=n, sets=[f"checkpoint.dir={dirs[n]}", "checkpoint.resume=true"],
                                     resume_from=CheckpointStore(dirs[n]).load())

        swarm.when(peers["c"], lambda e: e["event"] == Event.INNER_PROGRESS and e["round"] == 2
                   and e["inner_step"] >= 10, kill_and_restart)
        swarm.run_until(lambda: peers["c"].of(Event.RESUMED) != [], max_time=300)
        swarm.finish(list(peers.values()), max_time=300)  # without the fix: a and b give up after 600 s
        every = list(peers.values())
        for p in every:
            assert p.summary()["rounds_completed"] == 3, (p.name, p.summary())
        assert not forks([*every, *(p for p in swarm.peers if p not in every)])
        assert_consistent(swarm)
        one_digest(every)
        done = peers["a"].of(Event.ALLREDUCE_DONE, round=2)
        assert done and done[-1]["group_size"] >= 3, done  # at least one restarted member: 3 of 5 is half
        refused = [e for e in peers["a"].of(Event.ALLREDUCE_FAILED) if "refused" in e["reason"]]
        assert not refused, refused


def test_an_outage_of_the_first_round_does_not_make_every_peer_step_alone():
    """Every attempt of round 1 fails for everyone (a leader waiting for more peers than there are: what a group
    over the cap did at N = 70) for longer than swarm.round_timeout. No certificate exists yet (round 0), so the
    hand-off rule cannot stop a solo step: the cooling rule must. Once the outage ends, one group commits."""
    with SimSwarm(["run.max_rounds=2", "swarm.min_peers=3", "swarm.round_timeout=60"]) as swarm:
        a, b, c = swarm.add(name="a"), swarm.add(name="b"), swarm.add(name="c")

        def outage() -> None:
            swarm.net.lead(a.name, size=4, groups=10**6)
            swarm.sim.call_at(swarm.sim.now + 400.0, lambda: swarm.net.leaders.pop(a.name, None))

        swarm.when(a, lambda e: e["event"] == Event.ROUND_START and e["round"] == 1, outage)
        swarm.finish(max_time=1500)
        assert not forks([a, b, c])
        assert_no_solo_steps([a, b, c])
        one_digest([a, b, c])
        assert any(a.of(Event.ALLREDUCE_FAILED, round=1)), "the outage failed nothing (the scenario tests nothing)"


def test_more_peers_than_a_certificate_holds_form_one_group_of_the_seated(monkeypatch):
    """6 peers, a cap of 4: each round one group of the 4 seated peers commits, the 2 others sit the round out and
    take its state; who sits out changes from round to round, and nobody steps alone."""
    for module in (certificate, commit, rules):
        monkeypatch.setattr(module, "MAX_MEMBERS", 4)
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=6"]) as swarm:
        peers = [swarm.add(name=f"p{i}") for i in range(6)]
        swarm.finish(max_time=600)
        assert not forks(peers)
        assert_no_solo_steps(peers)
        one_digest(peers)
        sizes = {e["group_size"] for p in peers for e in p.of(Event.ALLREDUCE_DONE)}
        assert sizes == {4}, sizes
        out = [frozenset(p.name for p in peers if not p.of(Event.OUTER_STEP, round=r)) for r in (1, 2, 3)]
        assert all(len(o) == 2 for o in out), out
        assert len(set(out)) > 1, f"the same peers sat out every round: {out}"


@pytest.mark.parametrize("moment", ["matchmaking", "all-reduce", "training"])
def test_a_killed_round_mate_costs_the_survivors_seconds_not_a_record_lifetime(moment):
    """4 peers; one is killed in round 2 while the others look for their group (matchmaking), while its parts are in
    flight (all-reduce), or in its inner steps while the others wait for it (training). Its record lives on for
    swarm.peer_ttl (6 s), but every survivor's own probe finds it refused (peer/suspects.py): the attempt that
    expects it is aborted at once and the survivors commit round 2 among themselves within 3 s of the kill (the
    issue's goal on loopback; it took a record lifetime and a failed matchmaking before). Mid-transfer, the attempt
    is not aborted: the survivors re-reduce its slice (swarm/slice_repair.py) and commit that attempt."""
    with SimSwarm(["run.max_rounds=3", "swarm.min_peers=4"]) as swarm:
        *rest, victim = [swarm.add(name=n) for n in "abcd"]
        if moment == "training":
            swarm.net.hold(victim.name, 1, 4.0)  # it trains 4 s longer: the others wait for it in round 2
        else:
            swarm.net.slow_down(victim.name, 5.0)
        hit = {}

        def strike() -> None:
            hit["t"] = swarm.sim.now
            swarm.net.kill(victim.name)

        event = {"matchmaking": Event.ALLREDUCE_START, "all-reduce": Event.ALLREDUCE_RUNNING,
                 "training": Event.ALLREDUCE_START}[moment]
        delay = {"matchmaking": 0.05, "all-reduce": 0.5, "training": 1.0}[moment]
        swarm.when(rest[0], lambda e: e["event"] == event and e["round"] == 2,
                   lambda: swarm.sim.call_at(swarm.sim.now + delay, strike))
        swarm.finish(rest)
        one_digest(rest)
        assert_no_solo_steps(rest)
        for p in rest:
            step = p.of(Event.OUTER_STEP, round=2)
            assert step, p.events
            took = step[0]["t"] - swarm.sim.epoch - hit["t"]
            assert 0 < took <= 3.0, f"{p.name}: kill -> commit {took:.2f} s"
            assert p.of(Event.ALLREDUCE_DONE, round=2)[-1]["group_size"] == 3
            if moment == "all-reduce":  # the survivors re-reduced its slice: the attempt went on without it
                assert p.of(Event.ALLREDUCE_DONE, round=2)[-1]["lost"] == [victim.name]
                assert not p.of(Event.ALLREDUCE_FAILED, round=2), p.of(Event.ALLREDUCE_FAILED, round=2)


def test_a_newcomer_whose_initial_peer_restarted_with_a_new_identity_waits_for_a_certificate_it_can_verify(tmp_path):
    """a, b, c train; a is killed and restarted from its checkpoint under a new identity (a2); a newcomer n is given
    only a2 as its initial peer. Until a2 has been in a certified group, no certificate of the swarm is signed by
    n's trust root: n used to start a chain of its own from theta(0) and step alone (benchmarks/chaos.py
    --new-identity). Now it waits, then follows the swarm's chain once a2 signs a round."""
    ckpt = tmp_path / "a"
    with SimSwarm(["run.max_rounds=6", "swarm.min_peers=3"]) as swarm:
        a = swarm.add(name="a", sets=[f"checkpoint.dir={ckpt}"])
        b, c = swarm.add(name="b"), swarm.add(name="c")
        late = {}

        def restart() -> None:
            late["a2"] = swarm.add(name="a2", sets=[f"checkpoint.dir={ckpt}", "checkpoint.resume=true"],
                                   resume_from=CheckpointStore(ckpt).load())
            late["n"] = swarm.add(name="n", sets=[roots("a2"), "swarm.min_peers=1"])

        swarm.when(a, lambda e: e["event"] == Event.ROUND_START and e["round"] == 3,
                   lambda: (swarm.net.kill("a"), swarm.sim.call_at(swarm.sim.now + 1.0, restart)))
        swarm.finish([b, c], max_time=900)
        swarm.finish([b, c, *late.values()], max_time=900)
        n = late["n"]
        assert not forks(swarm.peers)
        assert_no_solo_steps([b, c, *late.values()])
        one_digest([b, c, *late.values()])
        assert n.of(Event.STATE_LOADED), n.events
        assert not n.of(Event.OUTER_STEP, round=1), "n committed a round 1 of its own"



def test_a_peer_restarted_from_an_old_checkpoint_follows_the_swarm_after_its_group_turned_over(tmp_path):
    """a stops after round 2 (its checkpoint: round 2, certified by {a, b, c}); d and e join; c leaves after round
    3 and b after round 4, so round 5's group is {d, e}: none of a's group. a, restarted from its checkpoint, left
    every record out ("signed by 0 of the 3 members of our last certified group") and trained alone beside the
    swarm for good (benchmarks/faults.py). Now it walks the chain through the others' chain blobs and catches up."""
    ckpt = tmp_path / "a"
    with SimSwarm(["run.max_rounds=8", "swarm.min_peers=3"]) as swarm:
        a = swarm.add(name="a", sets=[f"checkpoint.dir={ckpt}"])
        b, c = swarm.add(name="b"), swarm.add(name="c")
        late = {}

        def newcomers() -> None:
            a.stop.set()
            late["d"], late["e"] = (swarm.add(name=n, sets=["swarm.min_peers=1"]) for n in "de")

        swarm.when(a, lambda e: e["event"] == Event.CHECKPOINT_SAVED and e["round"] == 2, newcomers)
        swarm.run_until(lambda: "d" in late)
        swarm.when(late["d"], lambda e: e["event"] == Event.OUTER_STEP and e["round"] == 3, c.stop.set)
        swarm.when(late["d"], lambda e: e["event"] == Event.OUTER_STEP and e["round"] == 4, b.stop.set)
        swarm.when(late["d"], lambda e: e["event"] == Event.OUTER_STEP and e["round"] == 5,
                   lambda: late.setdefault("a2", swarm.add(name="a", sets=[f"checkpoint.dir={ckpt}",
                                                                          "checkpoint.resume=true"],
                                                           resume_from=CheckpointStore(ckpt).load())))
        swarm.finish([late["d"], late["e"]], max_time=900)
        swarm.run_until(lambda: "a2" in late and late["a2"].task.done(), max_time=300)
        a2, d = late["a2"], late["d"]
        members = {e["round"]: e["signers"] for e in d.of(Event.OUTER_STEP)}
        assert members.get(5) == 2, members  # {d, e}: none of a's group (the scenario holds)
        loaded = [e["round"] for e in a2.of(Event.STATE_LOADED)]
        assert loaded and loaded[0] >= 5, a2.events
        assert not forks(swarm.peers)
        assert a2.summary()["global_digest"] == d.summary()["global_digest"]
