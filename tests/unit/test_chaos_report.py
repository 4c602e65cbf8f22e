"""The chaos benchmark's arithmetic on synthetic events: forks, step efficiency, death -> next commit, the failed
attempts' bytes bound, the sync breakdown and the last line (benchmarks/chaos.py reads a real swarm's events with
these functions, so a wrong count here is a wrong figure there)."""

import math

import pytest

from benchmarks import _chaos_report as rep
from benchmarks.chaos import parse_args
from benchmarks.faults import account

pytestmark = pytest.mark.unit


def ev(t, event, r, **fields):
    return {"t": t, "event": event, "round": r, **fields}


def sync(t, r, attempts=1, running=True, h=20):
    """One peer's round r: inner_done at t, failed attempts of 1 s each, then one that works."""
    out = [ev(t - 5, "round_start", r, digest=f"d{r - 1}"), ev(t - 1, "inner_progress", r, inner_step=h),
           ev(t, "inner_done", r, inner_steps=h)]
    at = t + 0.1
    for a in range(1, attempts):
        out += [ev(at, "allreduce_start", r, attempt=a), ev(at + 1.0, "allreduce_failed", r, attempt=a, reason="x")]
        at += 1.0
    out.append(ev(at, "allreduce_start", r, attempt=attempts))
    out += [ev(at + 0.5, "allreduce_running", r, attempt=attempts)] if running else []
    return out + [ev(at + 0.7, "allreduce_done", r, group_size=3, bytes_sent=1000, bytes_received=1000, seconds=0.6),
                  ev(at + 0.9, "outer_step", r, digest=f"d{r}", inner_steps=h)]


def test_forks_count_distinct_digests_per_round():
    evs = {"a": sync(10, 1) + sync(30, 2), "b": sync(10, 1) + sync(30, 2), "c": sync(10, 1)}
    assert rep.forks(evs) == {}
    evs["c"] = evs["c"] + [ev(31, "outer_step", 2, digest="other", inner_steps=20)]
    assert rep.forks(evs) == {2: 2}


def test_step_efficiency_counts_a_killed_peers_lost_round():
    # b is killed in round 2 after 10 of 20 steps: 20 + 20 + 20 + 10 steps run, 60 reached theta.
    evs = {"a": sync(10, 1) + sync(30, 2), "b": sync(10, 1) + [ev(25, "round_start", 2, digest="d1"),
                                                              ev(27, "inner_progress", 2, inner_step=10)]}
    run, reached, lost = account(evs, {"b"}, partial=False)
    assert (run, reached, lost) == (70, 60, {"killed": 1})


def test_death_to_commit_takes_the_next_commit_of_another_peer():
    evs = {"a": sync(10, 1) + sync(30, 2), "victim": sync(10, 1) + [ev(29.0, "outer_step", 2, digest="d2")]}
    # a's outer steps are at 11.0 and 31.0; the victim's own commit at 29.0 does not count.
    got = rep.death_to_commit([(20.0, "victim"), (5.0, None), (40.0, "a")], evs)
    assert got[0] == pytest.approx(11.0) and got[1] == pytest.approx(6.0) and got[2] is None


def test_death_cost_counts_from_when_the_survivors_were_ready():
    evs = {"a": sync(10, 1) + sync(30, 2), "b": sync(10, 1) + sync(32, 2), "victim": sync(10, 1)}
    # round 2: a ready at 30, commits at 31.0; b ready at 32 (after a's commit: not counted), commits at 33.0
    got = rep.death_cost([(20.0, "victim"), (30.5, "victim"), (40.0, "a")], evs)
    assert got[0] == pytest.approx(31.0 - 30.0)  # a death in training: from the survivors' readiness
    assert got[1] == pytest.approx(31.0 - 30.5) and got[2] is None  # in their sync: from the death


def test_a_newcomer_alone_is_a_side_chain_not_the_swarms_rounds():
    # a and b commit rounds 1-2 together; n, a newcomer from the same theta(0), commits rounds 1-3 alone.
    lone = [dict(e, digest=f"n{e['round']}") if e["event"] == "outer_step" else e for r in (1, 2, 3)
            for e in sync(40 + 10 * r, r)]
    for e in lone:
        if e["event"] == "round_start" and e["round"] > 1:
            e["digest"] = f"n{e['round'] - 1}"
        if e["event"] == "outer_step":
            e["signers"] = 1
    evs = {"a": sync(10, 1) + sync(30, 2), "b": sync(10, 1) + sync(30, 2), "n": lone}
    chain = rep.main_chain(evs)
    assert chain == {1: "d1", 2: "d2"}
    assert rep.side_chains(evs, chain) == {1: [(1, 1)], 2: [(1, 1)], 3: [(1, 1)]}
    assert rep.forks(evs) == {1: 2, 2: 2}
    # a death at 45 s: the newcomer's commit at 51 s is not the swarm's, and there is no later one of the chain
    assert rep.death_to_commit([(45.0, "a")], evs) == [pytest.approx(6.0)]
    assert rep.death_to_commit([(45.0, "a")], evs, chain) == [None]
    assert rep.round_durations(evs, chain) == {2: pytest.approx(20.0)}
    assert rep.off_chain_steps(evs, chain) == 3 * 20  # the newcomer's steps reached no state of the swarm


def test_thrown_away_all_reduces_exact_and_bounded():
    evs = {"a": sync(10, 1, attempts=3), "b": sync(10, 1), "c": sync(10, 1)}
    evs["a"].insert(4, ev(10.5, "allreduce_running", 1, attempt=1))  # attempt 1 of a failed mid-transfer
    # c: a first all-reduce completed, then was refused; the second one became the commit
    evs["c"][3:3] = [ev(10.1, "allreduce_start", 1, attempt=1), ev(10.2, "allreduce_running", 1, attempt=1),
                     ev(10.3, "allreduce_done", 1, group_size=3, bytes_sent=700, bytes_received=700, seconds=0.2),
                     ev(10.3, "allreduce_failed", 1, attempt=1, reason="refused the group: a group of 3")]
    evs["c"][7]["attempt"] = evs["c"][8]["attempt"] = 2
    # d: completed an all-reduce but never committed the round (commit_failed, then killed)
    evs["d"] = sync(10, 1)[:-1] + [ev(12, "commit_failed", 1, reason="x", members=[])]
    w = rep.resent_attempts(evs)
    assert w["exact"] == 700 + 1000 and w["mid_transfer"] == 1 and w["before"] == 1
    assert w["full"] == 1000.0 and w["bound"] == 1700 + 1000
    assert w["failed"] == 0 and w["mid_counted"] == 0  # (events without byte counts: the old bound)


def test_failed_attempts_with_byte_counts_are_counted_exactly():
    """Issue 20: ``allreduce_failed`` carries the bytes the attempt sent. Those are summed exactly (matchmaking
    failures carry 0); only events without the field are still bounded by a whole all-reduce."""
    evs = {"a": sync(10, 1, attempts=3), "b": sync(10, 1, attempts=2), "c": sync(10, 1)}
    evs["a"].insert(4, ev(10.5, "allreduce_running", 1, attempt=1))
    evs["a"][5].update(bytes_sent=400, bytes_received=380)  # attempt 1 of a: failed mid-transfer, 400 B sent
    evs["a"][7].update(bytes_sent=0, bytes_received=0)  # attempt 2 of a: no group
    evs["b"].insert(4, ev(10.5, "allreduce_running", 1, attempt=1))  # attempt 1 of b: mid-transfer, an old event
    w = rep.resent_attempts(evs)
    assert w["exact"] == 0 and w["failed"] == 400 and w["mid_counted"] == 1
    assert w["mid_transfer"] == 1 and w["before"] == 1 and w["bound"] == 400 + 1000
    assert w["repaired"] == 0 and w["repair_bytes"] == 0


def test_repaired_deaths_and_their_bytes():
    """Issue 20: a death mid-transfer that the survivors repaired shows as one ``allreduce_done`` per survivor naming
    it in ``lost``: one repair, its ``resent_bytes`` summed over the survivors."""
    evs = {"a": sync(10, 1), "b": sync(10, 1)}
    for x, sent in (("a", 300), ("b", 100)):
        next(e for e in evs[x] if e["event"] == "allreduce_done").update(lost=["c"], resent_bytes=sent)
    w = rep.resent_attempts(evs)
    assert w["repaired"] == 1 and w["repair_bytes"] == 400 and w["exact"] == 0


def test_sync_breakdown_phases_and_missing_running():
    evs = {"a": sync(10, 1) + sync(30, 2, attempts=2), "b": sync(10, 1) + sync(31, 2, running=False)}
    b = rep.sync_breakdown(evs)
    assert b["samples"] == 2 and b["rounds"] == 1 and b["n_matchmaking"] == 1
    assert b["failed"] == pytest.approx(0.5)  # a: 1 s in a failed attempt, b: none
    assert b["matchmaking"] == pytest.approx(0.5) and b["transfer"] == pytest.approx(0.2)
    assert b["attempt"] == pytest.approx(0.7) and b["commit"] == pytest.approx(0.2)
    assert b["sync"] == pytest.approx(b["pre"] + b["failed"] + b["attempt"] + b["commit"])
    # everybody ready at 31 (b's inner_done), first allreduce_done at 31.8 (b's)
    assert b["ready_to_done"] == pytest.approx(0.8)
    assert rep.round_durations(evs) == {2: pytest.approx(20.0 + 1.0)}


def test_growth_exponent_and_summary_line():
    assert rep.growth_exponent([4, 8, 16], [1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert rep.growth_exponent([4, 8, 16], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    assert math.isnan(rep.growth_exponent([4], [1.0]))
    line = rep.summary_line(16, 20, 45, 0, 0.8712, [2.0, None, 4.0])
    assert line == "peers=16 rounds=20 events=45 forks=0 step_efficiency=0.871 death_to_commit_s=3.0"


def test_bad_sizes_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--no-faults", "--sizes", "4,x"])
    assert e.value.code == 2 and "--sizes" in capsys.readouterr().err
