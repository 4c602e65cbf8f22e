"""The protocol simulator of issue 17 (benchmarks/protocol_sim.py): its schedules are a function of their seed, it
runs and replays the same way, and its invariant checker flags what it must flag (fabricated events that break
each invariant) and nothing it must not (the same events with the fault that excuses them): a checker that cannot
fail proves nothing."""

from __future__ import annotations

import math

import pytest

from benchmarks._protocol_sim_check import INVARIANTS, Checker, Violation
from benchmarks._protocol_sim_run import Outcome, Run, run
from benchmarks._protocol_sim_schedule import FULL_BASE, PeerSpec, Schedule, draw, profile_of
from benchmarks.protocol_sim import main, report
from p2p_diloco.protocol import rules
from p2p_diloco.protocol.actions import Solo

pytestmark = pytest.mark.unit
G = "0" * 64  # genesis digest
D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64
WINDOW = 7.0


def _checker(**kw) -> Checker:
    return Checker(confirm_for=WINDOW, round_timeout=600.0, genesis=G, **kw)


def _step(checker: Checker, peer: str, k: int, digest: str, cert: str, members, now: float, prev: str = "") -> None:
    event = {"event": "outer_step", "round": k, "digest": digest, "inner_steps": 5, "certificate": cert,
             "signers": len(members)}
    checker.event(peer, event, now, members=tuple(members), prev=prev)


def _kinds(checker: Checker) -> list[str]:
    return [v.invariant for v in checker.violations]


# ------------------------------------------------------------------------------------------------------ schedules
def test_a_schedule_is_a_function_of_its_seed():
    assert draw(7) == draw(7) and draw(7) != draw(8)
    assert profile_of(7) == "quick" and profile_of(FULL_BASE + 7) == "full"
    for seed in range(1, 300):
        s = draw(seed, f=2)
        assert 3 <= s.n <= 64 and [p.name for p in s.peers] == [f"p{i}" for i in range(s.n)]
        per_round = {}
        for fault in s.faults:
            per_round[fault.round] = per_round.get(fault.round, 0) + 1
            assert 1 <= fault.round <= s.rounds
        assert max(per_round.values(), default=0) <= 2, s.text()
        removed = [f.targets[0] for f in s.faults if f.kind in ("kill", "leave")]
        assert "p0" not in removed and len(removed) <= (s.n - 1) // 2, s.text()
        anchor = s.peers[0]
        assert not anchor.client and not anchor.liar and anchor.join is None


# ----------------------------------------------------------------------------------------------------- simulation
def test_the_simulator_runs_a_schedule_and_replays_it_the_same_way():
    seeds = [s for s in range(1, 60) if draw(s).n <= 5 and draw(s).faults][:3]
    for seed in seeds:
        first, again = run(draw(seed)), run(draw(seed))
        assert first.trace == again.trace and first.end == again.end, seed
        assert [v.line() for v in first.violations] == [v.line() for v in again.violations]
        assert not [v for v in first.violations if v.invariant == "crash"], first.violations
        assert first.end > 0 and first.fired <= len(draw(seed).faults)


def test_the_checker_catches_a_broken_rule_in_a_real_run(monkeypatch):
    """Real peers whose sync decision is sabotaged (round 2: step alone at once, whoever is live): the checker must
    see the solo steps beside live round-mates and the forked round in their real events."""
    decide = rules.decide_sync

    def broken(s, view, now):
        return Solo(reason="sabotaged") if s.round == 1 else decide(s, view, now)

    monkeypatch.setattr(rules, "decide_sync", broken)
    peers = tuple(PeerSpec(f"p{i}", 0.05) for i in range(3))
    schedule = Schedule(seed=0, profile="quick", n=3, rounds=2, inner_steps=200, min_peers=3, f=0, peers=peers)
    outcome = Run(schedule).run()
    kinds = {v.invariant for v in outcome.violations}
    assert {"solo", "agreement"} <= kinds, [v.line() for v in outcome.violations]
    monkeypatch.setattr(rules, "decide_sync", decide)
    assert not Run(schedule).run().violations  # the same schedule with the real rule


def test_the_command_line_runs_schedules_and_replays_one(capsys):
    seed = next(s for s in range(1, 60) if draw(s).n <= 4)
    assert main(["--quick", "--schedules", "2", "--first", str(seed), "--workers", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("schedules=2 violations=")
    main(["--replay", str(seed)])
    out = capsys.readouterr().out
    assert out.startswith(f"seed={seed} profile=quick") and "\ntrace " in out


def test_the_report_ends_with_the_counts():
    outcomes = [Outcome(1, 3, 2, "quick"), Outcome(2, 4, 2, "quick", stalled="p1 in round 2"),
                Outcome(3, 5, 2, "quick", violations=[Violation("solo", 1.0, "p0", "x")])]
    text = report(outcomes, 1.0, "test")
    assert text.splitlines()[-1] == "schedules=3 violations=1 stalled=1"
    assert "--replay 3" in text and "--replay 2" in text


# -------------------------------------------------------------------------------------------------------- checker
def test_agreement_flags_two_states_for_one_round():
    checker = _checker()
    _step(checker, "p0", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    _step(checker, "p1", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    assert not checker.violations
    _step(checker, "p2", 1, D2, "c2", ["p2"], 9.0)
    assert _kinds(checker) == ["agreement"]


def test_agreement_excuses_only_two_halves_cut_apart():
    halves = _checker()
    _step(halves, "p0", 1, D1, "c1", ["p0", "p1", "p2", "p3"], 1.0)
    halves.hide("p0", "p2", 2.0)
    _step(halves, "p0", 2, D2, "c2", ["p0", "p1"], 5.0, prev="c1")
    _step(halves, "p2", 2, D3, "c3", ["p2", "p3"], 6.0, prev="c1")
    assert not halves.violations  # the documented price of "half" under a partition
    minority = _checker()
    _step(minority, "p0", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    minority.freeze("p2", 2.0)
    _step(minority, "p0", 2, D2, "c2", ["p0", "p1"], 5.0, prev="c1")
    _step(minority, "p2", 2, D3, "c3", ["p2"], 30.0, prev="c1")  # 1 of 3: it cannot extend the chain
    assert _kinds(minority) == ["agreement"]
    uncut = _checker()
    _step(uncut, "p0", 1, D1, "c1", ["p0", "p1", "p2", "p3"], 1.0)
    _step(uncut, "p0", 2, D2, "c2", ["p0", "p1"], 5.0, prev="c1")
    _step(uncut, "p2", 2, D3, "c3", ["p2", "p3"], 6.0, prev="c1")
    assert _kinds(uncut) == ["agreement"]


def test_chain_flags_a_state_nobody_committed_or_without_its_certificate():
    checker = _checker()
    _step(checker, "p0", 1, D1, "c1", ["p0", "p1"], 1.0)
    loaded = {"event": "state_loaded", "round": 1, "from_peer": "p0", "digest": D1}
    checker.event("p2", loaded, 2.0, certificate="c1")
    checker.event("p2", {"event": "state_loaded", "round": 0, "from_peer": "p0", "digest": G}, 2.0)
    assert not checker.violations
    checker.event("p3", loaded, 3.0, certificate="forged")
    checker.event("p3", dict(loaded, digest=D2), 3.0, certificate="c1")
    assert _kinds(checker) == ["chain", "chain"]
    fork = _checker()
    _step(fork, "p0", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    fork.freeze("p2", 1.5)
    _step(fork, "p0", 2, D2, "c2", ["p0", "p1"], 5.0, prev="c1")
    _step(fork, "p2", 2, D3, "c3", ["p2"], 9.0, prev="c1")  # a minority's fork (itself an agreement violation)
    fork.event("p3", {"event": "state_loaded", "round": 2, "from_peer": "p2", "digest": D3}, 10.0, certificate="c3")
    assert _kinds(fork) == ["agreement", "chain"]


def _record(round_: int, phase: str, digest: str = D1) -> dict:
    return {"round": round_, "phase": phase, "digest": digest}


def _lone(checker: Checker, peer: str, k: int, now: float, digest: str = D1) -> None:
    done = {"event": "allreduce_done", "round": k, "group_size": 1, "bytes_sent": 0, "bytes_received": 0,
            "seconds": 0.0, "lone": True}
    checker.event(peer, done, now, digest=digest)


def test_solo_flags_a_lone_step_beside_a_round_mate_live_for_the_whole_window():
    def checker_with_mate(**kw) -> Checker:
        checker = _checker(**kw)
        checker.store("p0", 0.0, _record(1, "sync"), 6.0)
        for t in range(0, 20):  # q's heartbeats: a record of round 1 (theta), kept fresh
            checker.store("p1", float(t), _record(1, "train"), t + 6.0)
        return checker

    flagged = checker_with_mate()
    _lone(flagged, "p0", 2, 15.0)
    assert _kinds(flagged) == ["solo"]
    cooling = checker_with_mate(cooling=lambda peer, now: {"p1"})
    _lone(cooling, "p0", 2, 15.0)
    hidden = checker_with_mate()
    hidden.hide("p0", "p1", 10.0)
    hidden.unhide("p0", "p1", 11.0)
    _lone(hidden, "p0", 2, 15.0)
    dead = checker_with_mate()
    dead.kill("p1", 14.0)
    _lone(dead, "p0", 2, 15.0)
    other_round = checker_with_mate()
    _lone(other_round, "p0", 3, 15.0)  # p1 is not in round 2 (theta 2)
    assert not cooling.violations and not hidden.violations and not dead.violations and not other_round.violations


def test_solo_does_not_flag_a_record_that_expired_in_the_window():
    checker = _checker()
    checker.store("p1", 0.0, _record(1, "train"), 6.0)
    checker.store("p1", 8.0, _record(1, "train"), 14.0)  # a gap from 6 to 8: one read may have missed it
    _lone(checker, "p0", 2, 13.0)
    assert not checker.violations
    assert checker.covered("p1", 8.0, 13.0, lambda r: True) and not checker.covered("p1", 5.0, 9.0, lambda r: True)
    assert math.isinf(checker.blind.get(("x", "y"), [[0, math.inf]])[0][1])


def test_partial_flags_a_group_without_a_round_mate_it_had_read_and_unequal_signatures():
    checker = _checker()
    checker.store("p2", 0.0, _record(0, "sync", G), 6.0)
    start = {"event": "allreduce_start", "round": 1, "expected_group_size": 2, "attempt": 1}
    checker.event("p0", start, 1.0, digest=G)
    _step(checker, "p0", 1, D1, "c1", ["p0", "p1"], 2.0)
    event = {"event": "outer_step", "round": 2, "digest": D2, "inner_steps": 5, "certificate": "c2", "signers": 1}
    checker.event("p0", event, 3.0, members=("p0", "p1"), prev="c1")
    assert _kinds(checker) == ["partial", "partial"]


def test_partial_flags_an_untouched_member_that_never_committed_its_certificate():
    checker = _checker()
    _step(checker, "p0", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    _step(checker, "p1", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    checker.finish(10.0, ["p0", "p1", "p2"])
    assert _kinds(checker) == ["partial"] and "p2" in checker.violations[0].detail
    touched = _checker()
    _step(touched, "p0", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    _step(touched, "p1", 1, D1, "c1", ["p0", "p1", "p2"], 1.0)
    touched.freeze("p2", 0.5)
    touched.finish(10.0, ["p0", "p1", "p2"])
    assert not touched.violations


def test_poison_flags_an_honest_state_equal_to_a_poisoned_one_but_not_the_liars_own():
    checker = _checker()
    checker.poison(D3, "served by the lying donor p4")
    checker.dishonest_peer("p4")
    checker.event("p4", {"event": "round_start", "round": 2, "digest": D3}, 1.0)
    assert not checker.violations
    checker.event("p1", {"event": "round_start", "round": 2, "digest": D3}, 1.0)
    assert _kinds(checker) == ["poison"]
    assert set(_kinds(checker)) <= set(INVARIANTS)
