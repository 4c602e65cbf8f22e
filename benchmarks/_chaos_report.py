"""The chaos benchmark's arithmetic on events (pure functions, unit-tested): forks, time from a death to the next
commit, the all-reduce bytes that failed attempts cost (or may have, for events without byte counts), and where a
round's sync goes.

``evs`` is always ``{peer id: [event dicts in file order]}`` as :meth:`benchmarks.faults.Bench.events` returns it
(a restarted peer has a new peer id, hence its own list).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from p2p_diloco.metrics.events import Event


def forks(evs: dict[str, list[dict]]) -> dict[int, int]:
    """Rounds committed with more than one state: round -> number of distinct ``outer_step`` digests (> 1 only)."""
    digests: dict[int, set[str]] = {}
    for e in (e for lst in evs.values() for e in lst if e["event"] == Event.OUTER_STEP):
        digests.setdefault(e["round"], set()).add(e["digest"])
    return {r: len(d) for r, d in sorted(digests.items()) if len(d) > 1}


def main_chain(evs: dict[str, list[dict]]) -> dict[int, str]:
    """The swarm's chain of committed states: round -> digest.

    Round 1's is the ``outer_step`` digest most peer processes committed; round r's, the one most committed by
    peers whose ``round_start`` of round r started from the chain's round r-1 state. A peer that commits rounds
    from another start (a newcomer training alone from its own initial weights) is on a side chain: its commits
    are forks, and its rounds are not the swarm's.
    """
    chain: dict[int, str] = {}
    votes: dict[int, dict[str, dict[str, int]]] = {}  # round -> digest it started from -> committed digest -> count
    for lst in evs.values():
        start: dict[int, str] = {}
        for e in lst:
            if e["event"] == Event.ROUND_START:
                start[e["round"]] = e["digest"]
            elif e["event"] == Event.OUTER_STEP:
                got = votes.setdefault(e["round"], {}).setdefault(start.get(e["round"], ""), {})
                got[e["digest"]] = got.get(e["digest"], 0) + 1
    for r in sorted(votes):
        pool: dict[str, int] = {}
        for origin, got in votes[r].items():
            if r == 1 or origin == chain.get(r - 1):
                for d, n in got.items():
                    pool[d] = pool.get(d, 0) + n
        if not pool:
            break
        chain[r] = max(sorted(pool), key=pool.get)
    return chain


def side_chains(evs: dict[str, list[dict]], chain: dict[int, str]) -> dict[int, list[tuple[int, int]]]:
    """Commits off the main chain: round -> [(peer processes that committed that digest, most signers of its
    certificates, ``outer_step.signers``)] (1 signer: a peer alone)."""
    out: dict[int, dict[str, list[int]]] = {}
    for e in (e for lst in evs.values() for e in lst if e["event"] == Event.OUTER_STEP):
        if chain.get(e["round"]) != e["digest"]:
            row = out.setdefault(e["round"], {}).setdefault(e["digest"], [0, 0])
            row[0], row[1] = row[0] + 1, max(row[1], int(e.get("signers") or 0))
    return {r: sorted(tuple(v) for v in d.values()) for r, d in sorted(out.items())}


def off_chain_steps(evs: dict[str, list[dict]], chain: dict[int, str]) -> int:
    """Inner steps in ``outer_step`` commits off the swarm's chain: they reached a state, but not the swarm's (take
    them out of the steps that reached theta)."""
    return sum(e["inner_steps"] for lst in evs.values() for e in lst
               if e["event"] == Event.OUTER_STEP and chain.get(e["round"]) != e["digest"])


def _commits(evs: dict[str, list[dict]], chain: dict[int, str] | None) -> list[tuple[float, str, int]]:
    """(time, peer id, round) of every ``outer_step`` (of the chain only, when given), by time."""
    return sorted((e["t"], pid, e["round"]) for pid, lst in evs.items() for e in lst if e["event"] == Event.OUTER_STEP
                  and (chain is None or chain.get(e["round"]) == e["digest"]))


def death_to_commit(deaths: Iterable[tuple[float, str | None]], evs: dict[str, list[dict]],
                    chain: dict[int, str] | None = None) -> list[float | None]:
    """For each death ``(unix time, victim's peer id)``: seconds to the next ``outer_step`` of any other peer process
    (of a state on ``chain`` when given: a newcomer's commits on its own are not the swarm's); None: none came."""
    commits = _commits(evs, chain)
    out: list[float | None] = []
    for t, victim in deaths:
        later = [tc for tc, pid, _ in commits if tc > t and pid != victim]
        out.append(later[0] - t if later else None)
    return out


def death_cost(deaths: Iterable[tuple[float, str | None]], evs: dict[str, list[dict]],
               chain: dict[int, str] | None = None) -> list[float | None]:
    """For each death ``(unix time, victim's peer id)``: seconds from the later of the death and the moment the
    survivors were ready to sync (the last ``inner_done``, of the round of the next commit, among the peers that
    committed it) to that commit by another peer. :func:`death_to_commit` includes the rest of the round the death
    fell in, which the death did not cause; this counts only the sync that followed it, so it bounds what the death
    cost (a sync without a death also takes its matchmaking, transfer and commit). None: no commit came."""
    commits = _commits(evs, chain)
    out: list[float | None] = []
    for t, victim in deaths:
        later = [(tc, r) for tc, pid, r in commits if tc > t and pid != victim]
        if not later:
            out.append(None)
            continue
        tc, r = later[0]
        committed = {pid for _, pid, rr in commits if rr == r and pid != victim}
        ready = [e["t"] for pid in committed for e in evs[pid] if e["event"] == Event.INNER_DONE
                 and e["round"] == r and e["t"] <= tc]
        out.append(tc - max([t, *ready]))
    return out


def resent_attempts(evs: dict[str, list[dict]]) -> dict[str, float]:
    """What the all-reduce attempts that did not become a commit cost on the wire (and then had to be sent again).

    An all-reduce that completed (``allreduce_done``, with its bytes) and then was refused (``allreduce_failed``
    ``refused the group``) or not certified (``commit_failed``) is counted exactly: every ``allreduce_done`` of a
    peer's round except the last one before its ``outer_step`` (all of them in a round it never committed). An
    ``allreduce_failed`` of an attempt that did not complete carries the bytes the attempt had sent
    (``bytes_sent``, issue 20): counted exactly too. Events from before that field carry none: such an attempt
    failed after the transfer began (an ``allreduce_running`` of the same round and attempt) is counted, and
    bounded by a whole all-reduce's bytes.

    Returns:
        ``exact`` (bytes sent in completed all-reduces that were thrown away), ``failed`` (bytes sent by attempts
        that failed before completing, from their events), ``mid_counted`` (attempts failed after the transfer
        began, with their bytes in ``failed``), ``mid_transfer`` (attempts failed after the transfer began, bytes
        unknown), ``before`` (attempts failed before it: matchmaking), ``full`` (the median ``bytes_sent`` of one
        peer's all-reduce of 2+ peers; 0.0 if none), ``bound`` (``exact`` + ``failed`` + ``mid_transfer`` x
        ``full``), ``repaired`` (deaths mid-transfer whose slice the survivors re-reduced: swarm/slice_repair.py)
        and ``repair_bytes`` (what those re-reductions sent again, all survivors together).
    """
    exact, failed, counted, mid, before = 0, 0, 0, 0, 0
    full = [e["bytes_sent"] for lst in evs.values() for e in lst
            if e["event"] == Event.ALLREDUCE_DONE and not e.get("lone") and e.get("group_size", 0) > 1]
    for lst in evs.values():
        running = {(e["round"], e["attempt"]) for e in lst if e["event"] == Event.ALLREDUCE_RUNNING}
        attempt: dict[int, int] = {}  # round -> attempt of the last allreduce_start
        done_in: dict[tuple[int, int], int] = {}  # (round, attempt) -> bytes sent
        for e in lst:
            if e["event"] == Event.ALLREDUCE_START:
                attempt[e["round"]] = e["attempt"]
            elif e["event"] == Event.ALLREDUCE_DONE:
                done_in[(e["round"], attempt.get(e["round"], 0))] = e["bytes_sent"]
            elif e["event"] == Event.OUTER_STEP:  # the last completed all-reduce of the round became the commit
                done_in.pop((e["round"], attempt.get(e["round"], 0)), None)
            elif e["event"] == Event.ALLREDUCE_FAILED and (e["round"], e["attempt"]) not in done_in:
                began, known = (e["round"], e["attempt"]) in running, "bytes_sent" in e
                failed += e.get("bytes_sent") or 0
                counted += began and known
                mid += began and not known
                before += not began
        exact += sum(done_in.values())
    med = float(statistics.median(full)) if full else 0.0
    repairs = [e for lst in evs.values() for e in lst if e["event"] == Event.ALLREDUCE_DONE and e.get("lost")]
    return {"exact": float(exact), "failed": float(failed), "mid_counted": float(counted), "mid_transfer": float(mid),
            "before": float(before), "full": med, "bound": exact + failed + mid * med,
            "repaired": float(len({(e["round"], tuple(e["lost"])) for e in repairs})),
            "repair_bytes": float(sum(e.get("resent_bytes", 0) for e in repairs))}


def round_durations(evs: dict[str, list[dict]], chain: dict[int, str] | None = None) -> dict[int, float]:
    """Round -> seconds between the first ``outer_step`` of the previous round and its own (round 1 left out; only
    the states on ``chain`` when given)."""
    first: dict[int, float] = {}
    for t, _, r in _commits(evs, chain):
        first.setdefault(r, t)
    return {r: first[r] - first[r - 1] for r in sorted(first) if r - 1 in first}


PHASES = ("pre", "failed", "matchmaking", "transfer", "attempt", "commit", "sync")


def _peer_sync(lst: list[dict], r: int) -> dict[str, float | None] | None:
    """One peer's sync of round ``r`` (None if it has no all-reduce that reached an ``outer_step``).

    Keys: ``pre`` (inner_done -> first allreduce_start: live-view reads, waiting for round-mates), ``failed`` (time in
    failed attempts), ``attempt`` (allreduce_start -> allreduce_done of the attempt that succeeded), split into
    ``matchmaking`` (start -> allreduce_running; the straggler wait is in it) and ``transfer`` (running -> done) when
    that attempt wrote ``allreduce_running`` (not every successful attempt does: then both are None), ``commit``
    (done -> outer_step), ``sync`` (inner_done -> outer_step), plus the times ``ready`` (inner_done) and ``done``.
    """
    pick = [e for e in lst if e["round"] == r]
    at = {name: [e for e in pick if e["event"] == name] for name in
          (Event.INNER_DONE, Event.ALLREDUCE_START, Event.ALLREDUCE_RUNNING, Event.ALLREDUCE_DONE, Event.OUTER_STEP)}
    if not (at[Event.OUTER_STEP] and at[Event.ALLREDUCE_DONE] and at[Event.ALLREDUCE_START] and at[Event.INNER_DONE]):
        return None
    ready, first, done = at[Event.INNER_DONE][-1]["t"], at[Event.ALLREDUCE_START][0], at[Event.ALLREDUCE_DONE][-1]
    start = [e for e in at[Event.ALLREDUCE_START] if e["t"] <= done["t"]][-1]
    run = [e["t"] for e in at[Event.ALLREDUCE_RUNNING] if e["attempt"] == start["attempt"]]
    step = at[Event.OUTER_STEP][-1]["t"]
    return {"pre": first["t"] - ready, "failed": start["t"] - first["t"], "attempt": done["t"] - start["t"],
            "matchmaking": run[-1] - start["t"] if run else None, "transfer": done["t"] - run[-1] if run else None,
            "commit": step - done["t"], "sync": step - ready, "ready": ready, "done": done["t"]}


def sync_breakdown(evs: dict[str, list[dict]], first_round: int = 2) -> dict[str, float]:
    """Where the sync of a round goes: the mean of each phase of :func:`_peer_sync` over the (peer, round) pairs of
    rounds >= ``first_round`` that have it (``n_matchmaking``: pairs with the split; ``samples``: all pairs), and a
    swarm-level ``ready_to_done`` free of the straggler wait: per round, the last peer's ``inner_done`` (everybody
    ready) -> the first ``allreduce_done`` (mean over ``rounds``). nan where nothing was measured.
    """
    rows: list[dict] = []
    swarm: list[float] = []
    rounds = sorted({e["round"] for lst in evs.values() for e in lst if e["event"] == Event.OUTER_STEP})
    for r in (r for r in rounds if r >= first_round):
        got = [s for s in (_peer_sync(lst, r) for lst in evs.values()) if s is not None]
        rows += got
        if got:
            swarm.append(min(s["done"] for s in got) - max(s["ready"] for s in got))
    out: dict[str, float] = {}
    for k in PHASES:
        xs = [s[k] for s in rows if s[k] is not None]
        out[k] = statistics.mean(xs) if xs else math.nan
    out["ready_to_done"] = statistics.mean(swarm) if swarm else math.nan
    out["n_matchmaking"] = float(sum(s["matchmaking"] is not None for s in rows))
    out["rounds"], out["samples"] = float(len(swarm)), float(len(rows))
    return out


def growth_exponent(sizes: list[int], times: list[float]) -> float:
    """Least-squares slope of log(time) against log(N): 1 = linear in N, > 1 = faster than linear."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(sizes, times) if t > 0 and not math.isnan(t)]
    if len(pts) < 2:
        return math.nan
    mx, my = statistics.mean(p[0] for p in pts), statistics.mean(p[1] for p in pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else math.nan


def mean_max(xs: list[float]) -> str:
    """``mean X s, max Y s (n=K)`` of durations, or ``n/a``."""
    return f"mean {statistics.mean(xs):.1f}s, max {max(xs):.1f}s (n={len(xs)})" if xs else "n/a"


def summary_line(peers: int, rounds: int, events: int, n_forks: int, efficiency: float,
                 deaths: list[float | None]) -> str:
    """The benchmark's last line; ``death_to_commit_s`` is the mean over deaths followed by a commit (nan if
    none)."""
    got = [d for d in deaths if d is not None]
    y = statistics.mean(got) if got else math.nan
    return (f"peers={peers} rounds={rounds} events={events} forks={n_forks} step_efficiency={efficiency:.3f} "
            f"death_to_commit_s={y:.1f}")
