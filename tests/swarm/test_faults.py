"""Faults injected from outside the peers, with real signals on real processes: kill -9 and SIGSTOP of whole
process groups, in every phase of a round, plus desync repair, donor death and graceful stop.

Each test asserts: equal digests among the peers that finish, bounded time, no partial or solo step while other
peers were alive, and no process left behind.
"""

import signal
import time

import pytest

from tests.conftest import survivors
from tests.swarm.helpers import (FAULT, Proc, digests_by_round, events_of, load_json, start_peers,
                                 wait_for_event)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]
ALLREDUCE_TIMEOUT = 20  # from FAULT


def _finish(procs, timeout=240):
    for p in procs:
        assert p.wait(timeout) == 0, p.stderr_tail()


def _summaries(log_dir, indices):
    return {i: load_json(log_dir / f"p{i}.json") for i in indices}


def _no_solo_steps(log_dir, procs):
    for p in procs:
        lone = [e for e in events_of(log_dir, p) if e["event"] == "allreduce_done" and e.get("lone")]
        assert not lone, f"{p.peer_id} took a solo step while others were alive: {lone}"


def _assert_consistent(log_dir, procs):
    per_round = digests_by_round(log_dir, procs)
    assert all(len(d) == 1 for d in per_round.values()), per_round


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill9", "sigstop"])
def test_peer_lost_mid_allreduce(tmp_path, reap, sig):
    """4 peers; one peer's whole process group is killed (or frozen) while its parts are in flight in round 2.
    The survivors abort that all-reduce within the timeout, redo round 2 among themselves and agree; a frozen
    peer that wakes up takes the swarm's state and finishes with the same digest."""
    slow = ["--set", "debug.part_delay=0.2"]  # the victim's parts trickle, so the signal lands mid-transfer
    procs = start_peers(4, tmp_path, reap, f"t-lost-{sig.name}", rounds=3, extra={3: slow})
    victim, rest = procs[3], procs[:3]
    wait_for_event(tmp_path / victim.peer_id / "events.jsonl",
                   lambda e: e["event"] == "allreduce_running" and e["round"] == 2, 240, victim)
    time.sleep(0.5)
    victim.signal_group(sig)
    t_signal = time.time()
    if sig == signal.SIGSTOP:
        for p in rest:  # each survivor holds theta(2): from the redo, or from a download if left out of it
            wait_for_event(tmp_path / p.peer_id / "events.jsonl",
                           lambda e: (e["event"] == "outer_step" and e["round"] == 2)
                           or (e["event"] == "state_loaded" and e["round"] >= 2), 120, p)
        victim.signal_group(signal.SIGCONT)
        _finish(procs)
        finished = procs
        assert any(e["event"] == "state_loaded" for e in events_of(tmp_path, victim))
    else:
        _finish(rest)
        finished = rest
    summaries = _summaries(tmp_path, [procs.index(p) for p in finished])
    assert len({s["global_digest"] for s in summaries.values()}) == 1, summaries
    assert all(s["rounds_completed"] == 3 for s in summaries.values())
    for p in rest:
        events = events_of(tmp_path, p)
        failed = [e for e in events if e["event"] == "allreduce_failed" and e["round"] == 2 and e["t"] > t_signal]
        assert failed, f"{p.peer_id}: the signal did not break an all-reduce in flight"
        assert failed[0]["t"] - t_signal < ALLREDUCE_TIMEOUT + 5, "survivor hung past the all-reduce timeout"
        # Round 2 is redone among the survivors: an all-reduce of at least 2 of them (never a solo step); a
        # survivor that was left out of it takes the result from them.
        redo = [e for e in events if e["event"] == "allreduce_done" and e["round"] == 2]
        took = [e for e in events if e["event"] == "state_loaded" and e["round"] >= 2 and e["t"] > t_signal]
        assert (redo and 2 <= redo[-1]["group_size"] <= 3) or took, (redo, took)
    _no_solo_steps(tmp_path, rest)
    _assert_consistent(tmp_path, finished)
    assert not survivors(reap)


def test_deaths_in_matchmaking_and_training_then_lone_peer_then_rejoin(tmp_path, reap):
    """Kill one peer in matchmaking (round 1) and one in inner training (round 2): the last peer keeps training
    alone, and a new peer that joins later averages with it."""
    rounds = 20  # a lone peer runs a round in ~1 s here: enough rounds left for the newcomer to start and join
    # a and c hold back 8 s before their first all-reduce of round 1, so no group can form before b is killed:
    # b dies waiting in matchmaking while its record still announces it as a member of round 1.
    hold = ["--set", "debug.sync_delay=8", "--set", "debug.sync_delay_round=1"]
    procs = start_peers(3, tmp_path, reap, "t-shrink", rounds=rounds, extra={0: hold, 2: hold})
    a, b, c = procs
    wait_for_event(tmp_path / b.peer_id / "events.jsonl",
                   lambda e: e["event"] == "allreduce_start" and e["round"] == 1, 240, b)
    b.kill_group()
    for p in (a, c):  # the kill landed before either of the others could have formed a group with b
        starts = [e["t"] for e in events_of(tmp_path, p) if e["event"] == "allreduce_start" and e["round"] == 1]
        assert not starts or starts[0] + 8 > time.time(), "b was killed too late to die in matchmaking"
    wait_for_event(tmp_path / c.peer_id / "events.jsonl",
                   lambda e: e["event"] == "inner_progress" and e["round"] == 2, 240, c)
    c.kill_group()
    wait_for_event(tmp_path / a.peer_id / "events.jsonl",
                   lambda e: e["event"] == "allreduce_done" and e.get("lone"), 240, a)
    d = Proc(["join", "--initial-peers", *a.wait_joined(), "--run-id", "t-shrink", "--max-rounds", str(rounds),
              "--log-dir", str(tmp_path), "--summary-json", str(tmp_path / "p3.json"), *FAULT], reap)
    _finish([a, d])
    sa, sd = load_json(tmp_path / "p0.json"), load_json(tmp_path / "p3.json")
    assert sa["rounds_completed"] == sd["rounds_completed"] == rounds
    assert sa["global_digest"] == sd["global_digest"]
    a_events = events_of(tmp_path, a)
    round1 = [e for e in a_events if e["event"] == "allreduce_done" and e["round"] == 1]
    assert round1[-1]["group_size"] == 2, round1  # b died in matchmaking: a and c, never a partial group of 3
    assert any(e["event"] == "allreduce_done" and e["group_size"] == 2 and e["round"] > 2 for e in a_events), \
        "the newcomer never averaged with the lone peer"
    assert any(e["event"] == "state_loaded" for e in events_of(tmp_path, d))
    _assert_consistent(tmp_path, [a, d])
    assert not survivors(reap)


def test_corrupted_theta_is_repaired_within_one_round(tmp_path, reap):
    procs = start_peers(3, tmp_path, reap, "t-desync", rounds=3,
                        extra={2: ["--set", "debug.corrupt_theta_at_round=1"]})
    _finish(procs)
    bad = events_of(tmp_path, procs[2])
    corrupted = [e for e in bad if e["event"] == "debug_corrupted"]
    assert corrupted and corrupted[0]["round"] == 1
    detected = [e for e in bad if e["event"] == "desync_detected"]
    assert detected and detected[0]["round"] == 2 and detected[0]["ours"] == corrupted[0]["digest"]
    good = {e["digest"] for p in procs[:2] for e in events_of(tmp_path, p) if e["event"] == "outer_step"
            and e["round"] == 2}
    assert len(good) == 1
    repaired = [e for e in bad if e["event"] == "state_loaded" and e["round"] == 2]
    assert repaired and repaired[-1]["digest"] in good, "not repaired by the end of round 2"
    for p in procs[:2]:
        assert not any(e["event"] == "desync_detected" for e in events_of(tmp_path, p))
    summaries = _summaries(tmp_path, range(3))
    assert len({s["global_digest"] for s in summaries.values()}) == 1
    assert not survivors(reap)


def test_joiner_moves_to_another_donor_when_one_dies_mid_transfer(tmp_path, reap):
    slow = ["--set", "debug.state_delay=0.1"]  # donors stream their state slowly
    rounds = 20  # two peers run a round in ~2 s here: leave rounds to play while the joiner starts
    a, b = start_peers(2, tmp_path, reap, "t-donor", rounds=rounds, extra={0: slow, 1: slow})
    wait_for_event(tmp_path / a.peer_id / "events.jsonl", lambda e: e["event"] == "outer_step", 240, a)
    c = Proc(["join", "--initial-peers", *a.wait_joined(), "--run-id", "t-donor", "--max-rounds", str(rounds),
              "--log-dir", str(tmp_path), "--summary-json", str(tmp_path / "p2.json"), *FAULT], reap)
    c.wait_joined()
    start = wait_for_event(tmp_path / c.peer_id / "events.jsonl",
                           lambda e: e["event"] == "state_download_start", 120, c)
    donor = a if start["from_peer"] == a.peer_id else b
    other = b if donor is a else a
    time.sleep(1.0)
    donor.kill_group()
    _finish([other, c])
    events = events_of(tmp_path, c)
    failed = [e for e in events if e["event"] == "state_download_failed" and e["from_peer"] == donor.peer_id]
    assert failed, "the killed donor's transfer did not fail"
    loaded = [e for e in events if e["event"] == "state_loaded"]
    assert loaded and loaded[0]["from_peer"] == other.peer_id
    sums = _summaries(tmp_path, [0 if other is a else 1, 2])
    assert len({s["global_digest"] for s in sums.values()}) == 1
    assert not survivors(reap)


def test_sigterm_mid_allreduce_stops_cleanly_and_others_carry_on(tmp_path, reap):
    procs = start_peers(3, tmp_path, reap, "t-term", rounds=3, extra={2: ["--set", "debug.part_delay=0.2"]})
    victim = procs[2]
    wait_for_event(tmp_path / victim.peer_id / "events.jsonl",
                   lambda e: e["event"] == "allreduce_running" and e["round"] == 2, 240, victim)
    t0 = time.monotonic()
    victim.signal(signal.SIGTERM)
    assert victim.wait(30) == 0, victim.stderr_tail()
    assert time.monotonic() - t0 < 20
    assert load_json(tmp_path / "p2.json")["stopped_early"] is True
    _finish(procs[:2])
    sums = _summaries(tmp_path, range(2))
    assert len({s["global_digest"] for s in sums.values()}) == 1
    assert all(s["rounds_completed"] == 3 for s in sums.values())
    _no_solo_steps(tmp_path, procs[:2])
    assert not survivors(reap)


def test_joiner_arriving_mid_allreduce_starts_at_the_next_boundary(tmp_path, reap):
    """A newcomer that arrives while the swarm is in its all-reduce must not join the round in flight (it would
    hold the others back): it waits, takes the swarm's theta, and averages with everyone from the next round it
    can start on time (round 2, or round 3 if round 2 was already too far along when its download finished)."""
    # Round 1's all-reduce lasts ~15 s. H = 60: the join window (H/(N+1) = 20 steps, ~1.5 s here) must be longer
    # than the newcomer's reaction time (record poll, download), or it keeps missing it.
    slow = ["--set", "debug.part_delay=0.3", "--inner-steps", "60"]
    a, b = start_peers(2, tmp_path, reap, "t-midjoin", rounds=4, extra={0: slow, 1: slow})
    wait_for_event(tmp_path / a.peer_id / "events.jsonl",
                   lambda e: e["event"] == "allreduce_running" and e["round"] == 1, 240, a)
    c = Proc(["join", "--initial-peers", *a.wait_joined(), "--run-id", "t-midjoin", "--max-rounds", "4",
              "--log-dir", str(tmp_path), "--summary-json", str(tmp_path / "p2.json"), *FAULT, "--inner-steps", "60"],
             reap)
    c.wait_joined()
    assert not any(e["event"] == "outer_step" for e in events_of(tmp_path, a)), "joined too late to test anything"
    _finish([a, b, c])
    events = events_of(tmp_path, c)
    loaded = [e for e in events if e["event"] == "state_loaded"]
    assert loaded and loaded[0]["round"] >= 1, loaded
    first = min(e["round"] for e in events if e["event"] == "round_start")
    assert first in (2, 3), f"joined the round in flight or far too late (first round {first})"
    for p in (a, b, c):
        done = {e["round"]: e["group_size"] for e in events_of(tmp_path, p) if e["event"] == "allreduce_done"}
        assert all(done.get(r) == 3 for r in range(first, 5)), (p.peer_id, first, done)
    assert len({s["global_digest"] for s in _summaries(tmp_path, range(3)).values()}) == 1
    assert not survivors(reap)
