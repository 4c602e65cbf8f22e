"""The round protocol under thousands of random fault schedules, by deterministic simulation (issue 17).

    python -m benchmarks.protocol_sim --quick        # 1,000 schedules of 3..64 peers, a few minutes on 2 cores
    python -m benchmarks.protocol_sim                # 3,000 schedules, more and larger swarms (~40 min, 2 cores)
    python -m benchmarks.protocol_sim --replay SEED  # one schedule again, with its events (--events)
    python -m benchmarks.protocol_sim --scale 100    # N peers, 1 h rounds, 30 min syncs, 1 death per peer-day
                                                     # (issue 20: :mod:`._protocol_sim_scale`, docs/scale.md)

Method: each schedule (:mod:`._protocol_sim_schedule`; one seed, one schedule, replayable) is a swarm of N = 3..64 real
peers (:class:`~p2p_diloco.testing.harness.SimSwarm`: the real Peer driver, rules, commit step and outer step, a fake
model; no processes, no hivemind) on the in-memory swarm and a virtual clock, with faults aimed at events of its
rounds: kill, freeze/thaw, partitions, hidden and stale record reads, a group losing its parts, a member failing
after the others completed, slow reducers, a held all-reduce start, a leader forming a smaller group, a stuck
trainer, a graceful stop, late joiners, client-mode peers (never state donors), a lying donor, and Sybil records and
certificates with one-year expirations. At most ``--f`` faults per round. Every event of every peer is checked
as it is emitted (:mod:`._protocol_sim_check`: agreement, chain, solo, partial, poison, crash; each invariant's
exact definition is there), and liveness at the end (:mod:`._protocol_sim_run`: the bound, and the premise under
which it is judged: at least half of the last certified group reachable, every fault ends).

Output: a table (schedules, violating and stalled schedules by swarm size, violations by invariant), the seeds of the
first 20 violating and stalled schedules with what broke and the command line that replays each, and as the last
line ``schedules=<n> violations=<v> stalled=<s>``: ``v`` and ``s`` count *schedules* (with at least one invariant
violation; not finished by the liveness bound while its premise held).

Limits: the fake swarm's timing model (transfers, matchmaking, DHT reads are instantaneous or fixed delays); a fake
model of 32 floats; the HMAC identities of ``testing/fake_keys.py``; faults from the list above only (no message
reordering inside the DHT, no clock skew). One seed is one sample: the figures are counts over the seeds run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace

from ._protocol_sim_check import INVARIANTS
from ._protocol_sim_run import Outcome, Run, run
from ._protocol_sim_schedule import FULL_BASE, draw

QUICK = 1000  # schedules of --quick
FULL = 3000  # about 40 minutes on 2 cores, 5 on 16
SHOW = 20  # seeds listed per kind
SIZES = ((3, 8), (9, 16), (17, 64))
DEATH_COST_S = 12.0  # a failed attempt's cost beyond its transfer: benchmarks/faults.py, 11.8 s mean (issue 20)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _one(args: tuple[int, int]) -> Outcome:
    seed, f = args
    return run(draw(seed, f))


def run_many(seeds: list[int], f: int, workers: int, progress: bool = True) -> list[Outcome]:
    """Every schedule of ``seeds`` (in ``workers`` processes), in seed order."""
    jobs = [(seed, f) for seed in seeds]
    if workers <= 1:
        outcomes = []
        for job in jobs:
            outcomes.append(_one(job))
        return outcomes
    jobs.sort(key=lambda job: -draw(job[0], f).n)  # the large swarms first: no long one left alone at the end
    ctx = multiprocessing.get_context("spawn")
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    with ctx.Pool(workers, initializer=_init_worker, maxtasksperchild=200) as pool:
        for i, outcome in enumerate(pool.imap_unordered(_one, jobs, chunksize=2), 1):
            outcomes.append(outcome)
            if progress and i % 100 == 0:
                print(f"  {i}/{len(jobs)} schedules, {time.perf_counter() - started:.0f} s", file=sys.stderr,
                      flush=True)
    return sorted(outcomes, key=lambda o: o.seed)


def report(outcomes: list[Outcome], wall: float, label: str) -> str:
    lines = [f"protocol_sim: {label}"]
    lines.append(f"{'N':>7} {'schedules':>10} {'violating':>10} {'stalled':>8} {'premise':>8} {'wall mean':>10} "
                 f"{'wall max':>9}")
    for lo, hi in SIZES:
        group = [o for o in outcomes if lo <= o.n <= hi]
        if not group:
            continue
        walls = [o.wall for o in group]
        lines.append(f"{lo:>3}..{hi:<3} {len(group):>10} {sum(1 for o in group if o.violations):>10} "
                     f"{sum(1 for o in group if o.stalled):>8} {sum(1 for o in group if o.premise):>8} "
                     f"{sum(walls) / len(walls):>9.2f}s {max(walls):>8.2f}s")
    lines.append("  (premise: schedules whose liveness premise broke; they are checked for safety only)")
    by_invariant = Counter(v.invariant for o in outcomes for v in o.violations)
    schedules_by = defaultdict(set)
    for o in outcomes:
        for v in o.violations:
            schedules_by[v.invariant].add(o.seed)
    lines.append("invariant    violations  schedules")
    for name in INVARIANTS:
        lines.append(f"{name:<12} {by_invariant.get(name, 0):>10} {len(schedules_by.get(name, ())):>10}")
    fired = sum(o.fired for o in outcomes)
    kinds = Counter()
    for o in outcomes:
        kinds.update(o.kinds)
    features = Counter(f for o in outcomes for f in o.features)
    lines.append(f"faults fired: {fired} (" + ", ".join(f"{k} {n}" for k, n in kinds.most_common()) + ")")
    lines.append("schedules with " + ", ".join(f"{k}: {n}" for k, n in features.most_common()))
    lines.append(f"virtual time: {sum(o.end for o in outcomes):.0f} s; wall: {wall:.1f} s")
    bad = [o for o in outcomes if o.violations]
    if bad:
        lines.append(f"violating schedules (first {SHOW} of {len(bad)}):")
        for o in bad[:SHOW]:
            kinds = ",".join(sorted({v.invariant for v in o.violations}))
            lines.append(f"  seed {o.seed} (N={o.n}, {kinds}): {o.violations[0].line()[:160]}")
            lines.append(f"    replay: python -m benchmarks.protocol_sim --replay {o.seed}")
        if len(bad) > SHOW:
            lines.append("  every violating seed: " + " ".join(str(o.seed) for o in bad))
    stalled = [o for o in outcomes if o.stalled]
    if stalled:
        lines.append(f"stalled schedules (first {SHOW} of {len(stalled)}):")
        for o in stalled[:SHOW]:
            lines.append(f"  seed {o.seed} (N={o.n}): {o.stalled[:160]}")
            lines.append(f"    replay: python -m benchmarks.protocol_sim --replay {o.seed}")
        if len(stalled) > SHOW:
            lines.append("  every stalled seed: " + " ".join(str(o.seed) for o in stalled))
    lines.append(f"schedules={len(outcomes)} violations={len(bad)} stalled={len(stalled)}")
    return "\n".join(lines)


def replay(seed: int, f: int, events: bool, beyond: float) -> Outcome:
    """Run one schedule again in this process and print it, its outcome and (``events``) every event."""
    import logging

    schedule = draw(seed, f)
    print(schedule.text())
    r = Run(schedule)
    if events:
        logging.basicConfig(level=logging.WARNING, format="           %(message)s")
        inner = r._on_event

        def show(name: str, event: dict) -> None:
            fields = {k: v for k, v in event.items() if k not in ("t", "event", "round")}
            print(f"{r.swarm.sim.now:9.2f} {name:<5} {event['event']:<22} round {event['round']} {fields}"[:240])
            inner(name, event)

        r._on_event = show
    else:
        logging.getLogger("p2p_diloco").setLevel(logging.CRITICAL)
    outcome = r.run(beyond)
    print(outcome.line())
    print(f"trace {outcome.trace}")
    if outcome.premise:
        print(f"liveness premise broken: {outcome.premise}")
    for line in outcome.excused:
        print(f"not judged (out of reach when the others finished): {line}")
    for v in outcome.violations:
        print(f"VIOLATION {v.line()}")
    if outcome.stalled:
        print(f"STALLED {outcome.stalled}")
    return outcome


def _scale(args: argparse.Namespace) -> int:
    from ._protocol_sim_scale import Profile, merge, report, simulate

    if (args.scale < 2 or args.seeds < 1 or args.rounds < 1 or args.sync_s <= 0 or args.compute_s <= 0
            or args.deaths_per_day < 0):
        print("protocol_sim: --scale needs N >= 2, --seeds and --rounds >= 1, --sync-s and --compute-s > 0, "
              "--deaths-per-day >= 0", file=sys.stderr)
        return 2
    profile = Profile(n=args.scale, rounds=args.rounds, compute_s=args.compute_s, sync_s=args.sync_s,
                      deaths_per_peer_day=args.deaths_per_day, uncapped=args.uncapped, seed=args.seed,
                      max_virtual_s=args.max_hours * 3600)
    runs = [] if args.analytic else [simulate(replace(profile, seed=args.seed + i)) for i in range(args.seeds)]
    print(report(profile, merge(runs) if runs else None, DEATH_COST_S, seeds=len(runs)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK} schedules of the quick profile")
    ap.add_argument("--schedules", type=int, default=None, help=f"how many (default {QUICK} quick, {FULL} full)")
    ap.add_argument("--first", type=int, default=None,
                    help=f"first seed (default 1 quick, {FULL_BASE + 1} full: the seed picks the profile)")
    ap.add_argument("--f", type=int, default=2, help="faults per round at most (default 2)")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: 2 quick, all cores full)")
    ap.add_argument("--replay", type=int, default=None, metavar="SEED", help="run one schedule again and show it")
    ap.add_argument("--events", action="store_true", help="with --replay: print every event")
    ap.add_argument("--beyond", type=float, default=0.0,
                    help="with --replay: run up to this many virtual seconds past the liveness bound, and watch "
                         "peers out of reach at the end until they finish or give up")
    scale = ap.add_argument_group("--scale N: realistic timings and churn at N peers (docs/scale.md)")
    scale.add_argument("--scale", type=int, default=None, metavar="N", help="simulate N peers (closed forms too)")
    scale.add_argument("--rounds", type=int, default=1, help="rounds to run (default 1)")
    scale.add_argument("--sync-s", type=float, default=1800.0, help="transfer seconds per all-reduce (default 1800)")
    scale.add_argument("--compute-s", type=float, default=3600.0, help="inner-step seconds per round (default 3600)")
    scale.add_argument("--deaths-per-day", type=float, default=1.0, help="deaths per peer-day (default 1)")
    scale.add_argument("--uncapped", action="store_true", help="lift the 64-member group cap (a what-if)")
    scale.add_argument("--max-hours", type=float, default=0.0, help="virtual hours at most (default: from rounds)")
    scale.add_argument("--seed", type=int, default=1, help="seed of the first run's death times (default 1)")
    scale.add_argument("--seeds", type=int, default=1, help="runs (seeds --seed, --seed + 1, ...), summed (default 1)")
    scale.add_argument("--analytic", action="store_true", help="the closed forms only, no simulation")
    args = ap.parse_args(argv)
    if args.scale is not None:
        return _scale(args)
    if args.replay is not None:
        outcome = replay(args.replay, args.f, args.events, args.beyond)
        return 1 if outcome.violations or outcome.stalled else 0
    quick = args.quick
    n = args.schedules or (QUICK if quick else FULL)
    first = args.first if args.first is not None else (1 if quick else FULL_BASE + 1)
    workers = args.workers or (2 if quick else (os.cpu_count() or 2))
    seeds = list(range(first, first + n))
    started = time.perf_counter()
    outcomes = run_many(seeds, args.f, workers)
    wall = time.perf_counter() - started
    label = (f"{'quick' if quick else 'full'}, {n} schedules (seeds {first}..{first + n - 1}), f={args.f}, "
             f"{workers} worker(s)")
    print(report(outcomes, wall, label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
