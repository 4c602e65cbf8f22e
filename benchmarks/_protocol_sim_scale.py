"""``python -m benchmarks.protocol_sim --scale N``: the round protocol at N = 100 and 1,000 peers with realistic
timings and churn, on paper (issue 20): the closed forms of :func:`expected` and one simulated run (:func:`simulate`).

The simulation runs the real peers (:class:`~p2p_diloco.testing.harness.SimSwarm`: the real Peer driver, rules,
commit step and outer step, a fake model) on the in-memory swarm and the virtual clock, with the timings of a
:class:`Profile` (a round of ``compute_s`` of inner steps, then an all-reduce whose transfer takes ``sync_s``) and
deaths at Poisson times: each live peer dies at ``deaths_per_peer_day`` per day (``kill -9``, no replacement).

The closed forms (a sync of S seconds, N members, each dying at rate r per second, so the group at rate
lambda = N r; today a death during the transfer fails it for every member, who retry from zero):

* P(some member dies during one sync) = 1 - exp(-lambda S);
* expected attempts until one sync completes = exp(lambda S); expected time to complete it
  = (exp(lambda S) - 1) (1 / lambda + D), D the time a failed attempt costs beyond the transfer it wasted (record
  expiry and failed matchmaking), the textbook result for a task restarted from zero at each failure;
* with the issue's goal (a death costs the dead member's share), each death adds D + S / N instead, so a sync takes
  S + lambda S (D + S / N) on average;
* lost work (:func:`lost_work`): a peer dying loses the inner steps of its round not yet committed: those taken so
  far if it dies while training, the whole round if it dies during the sync, so the fraction of all steps lost is
  about r (C / 2 + S_eff) per round of C seconds of compute with syncs of S_eff seconds (exactly: lost_work).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Iterator

DAY = 86400.0
GBIT = 1e9  # bits per second
TICK_S = 900.0  # virtual seconds between progress lines
HIGH_CHURN = 4.0  # deaths per peer-day of the higher-churn case: a 6-hour mean life (preemptible machines)


def sync_seconds(params: float, bytes_per_param: float, link_bps: float, n: int) -> float:
    """Transfer time of one butterfly all-reduce: each peer sends (and receives) 2 (N-1)/N x the payload
    (docs/scale.md, "Bandwidth and time per round"), at ``link_bps`` bits per second, full duplex."""
    if n < 1 or link_bps <= 0:
        raise ValueError("n must be >= 1 and link_bps > 0")
    return 2 * (n - 1) / n * params * bytes_per_param * 8 / link_bps


def p_death_during(n: int, deaths_per_peer_day: float, seconds: float) -> float:
    """P(at least one of ``n`` members dies during ``seconds``), deaths Poisson at the given rate per peer."""
    return 1.0 - math.exp(-n * deaths_per_peer_day * seconds / DAY)


@dataclass(frozen=True)
class Expected:
    """The closed forms of the module docstring for one (N, S, r, D, C)."""

    lam_s: float  # lambda x S: expected deaths during one sync
    p_death: float  # P(some member dies during one sync)
    attempts_restart: float  # expected attempts per sync, restart from zero (today)
    sync_restart_s: float  # expected time to complete a sync, restart from zero
    sync_share_s: float  # expected time with the goal: a death costs D + S / N
    lost_restart: float  # fraction of inner steps lost per round, today (inf: rounds never commit in practice)
    lost_share: float  # the same with the goal


def expected(n: int, sync_s: float, deaths_per_peer_day: float, death_cost_s: float, compute_s: float) -> Expected:
    """The closed forms of the module docstring (``death_cost_s`` is D)."""
    r = deaths_per_peer_day / DAY
    lam = n * r
    lam_s = lam * sync_s
    if lam_s > 700:  # exp overflows: the sync never completes in any time that matters
        attempts = restart = math.inf
    else:
        attempts = math.exp(lam_s)
        restart = (attempts - 1) * (1 / lam + death_cost_s) if lam > 0 else sync_s
    share = sync_s + lam_s * (death_cost_s + sync_s / n)
    return Expected(lam_s, -math.expm1(-lam_s), attempts, restart, share, lost_work(r, compute_s, restart),
                    lost_work(r, compute_s, share))


def lost_work(rate_s: float, compute_s: float, sync_s: float) -> float:
    """Expected inner steps lost / inner steps run, per peer-round, for a peer dying at ``rate_s`` per second:
    it trains for ``compute_s`` (steps evenly spread), then syncs for ``sync_s``; dying in training loses the steps
    taken so far, dying in the sync loses them all; a survivor's steps all reach theta."""
    if not math.isfinite(sync_s):
        return 1.0
    rc = rate_s * compute_s
    if rc == 0:
        return 0.0
    run = -math.expm1(-rc) / rc  # E[min(T, C)] / C
    lost = (1 - math.exp(-rc) * (1 + rc)) / rc + math.exp(-rc) * -math.expm1(-rate_s * sync_s)
    return lost / run


@dataclass(frozen=True)
class Profile:
    """One simulated swarm: N peers, ``rounds`` rounds of ``inner_steps`` steps lasting ``compute_s`` in all, then an
    all-reduce whose transfer takes ``sync_s``; deaths at ``deaths_per_peer_day``; swarm timings (seconds)."""

    n: int
    rounds: int = 2
    compute_s: float = 3600.0
    inner_steps: int = 20
    sync_s: float = 1800.0
    deaths_per_peer_day: float = 1.0
    heartbeat_s: float = 1.0
    peer_ttl_s: float = 6.0
    matchmaking_s: float = 8.0
    seed: int = 1
    poll_s: float = 10.0  # how often the fake all-reduce's waiting calls wake (no stop request comes here)
    uncapped: bool = False  # lift the 64-member cap on a group (certificate.MAX_MEMBERS) in this process: what if
    max_virtual_s: float = 0.0  # 0: rounds x (compute + 4 sync) + 2 h

    def sets(self) -> list[str]:
        """The peers' settings: the defaults of the real config, with deadlines that fit a sync of ``sync_s``."""
        return [f"run.max_rounds={self.rounds}", f"train.inner_steps={self.inner_steps}",
                f"swarm.min_peers={self.n}", f"swarm.heartbeat_period={self.heartbeat_s}",
                f"swarm.peer_ttl={self.peer_ttl_s}", f"swarm.matchmaking_time={self.matchmaking_s}",
                "swarm.request_timeout=3.0", f"swarm.allreduce_timeout={2 * self.sync_s + 60:.0f}",
                "swarm.next_chunk_timeout=10", "swarm.min_peers_timeout=600"]

    def limit(self) -> float:
        return self.max_virtual_s or self.rounds * (self.compute_s + 4 * self.sync_s) + 7200.0


@dataclass
class Measured:
    """What one simulated run gave (:func:`simulate`)."""

    n: int
    rounds: int  # rounds committed by the swarm (the highest round some survivor committed)
    deaths: int
    steps_run: int
    steps_reached: int  # inner steps whose round was committed (they reached theta)
    failed_transfers: int  # all-reduces that began their transfer and failed (a restart for every member)
    failed_matchmaking: int  # attempts that found no group (members' allreduce_failed "could not find a group")
    group_sizes: list[int] = field(default_factory=list)  # size of each committed group, round by round
    forks: int = 0  # rounds committed with more than one digest (safety: must be 0)
    commits: int = 0  # outer steps, all peers
    solo: int = 0  # outer steps of a group of one
    round_ends: list[float] = field(default_factory=list)  # virtual time of each round's first commit
    end_s: float = 0.0  # virtual seconds at the end
    finished: bool = False  # every survivor completed every round before the limit
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_mib: float = 0.0

    @property
    def lost_work(self) -> float:
        return 1.0 - self.steps_reached / self.steps_run if self.steps_run else 0.0

    @property
    def restarts_per_round(self) -> float:
        return self.failed_transfers / max(1, self.rounds)


def death_times(n: int, deaths_per_peer_day: float, horizon: float, seed: int) -> list[tuple[float, int]]:
    """Poisson deaths of ``n`` peers over ``horizon`` seconds: (time, index of the peer), each peer at most once
    (the rate of the swarm falls as peers die). Deterministic in ``seed``."""
    rng = random.Random(seed)
    rate = deaths_per_peer_day / DAY
    out = []
    for i in range(n):
        t = rng.expovariate(rate) if rate > 0 else math.inf
        if t < horizon:
            out.append((t, i))
    return sorted(out)


@contextlib.contextmanager
def members_cap(cap: int | None) -> Iterator[None]:
    """Within the block, a group may have up to ``cap`` members (None: today's cap, unchanged): the certificate's
    member and size limits, patched in this process only (a what-if: real peers would refuse such groups)."""
    from p2p_diloco.protocol import certificate, commit
    from p2p_diloco.swarm import port

    if cap is None:
        yield
        return
    saved = certificate.MAX_MEMBERS, commit.MAX_MEMBERS, certificate.MAX_BYTES, port.BLOB_MAX_BYTES["cert"]
    size = max(saved[2], saved[2] * cap // saved[0])
    certificate.MAX_MEMBERS = commit.MAX_MEMBERS = cap
    certificate.MAX_BYTES = port.BLOB_MAX_BYTES["cert"] = size
    try:
        yield
    finally:
        certificate.MAX_MEMBERS, commit.MAX_MEMBERS, certificate.MAX_BYTES, port.BLOB_MAX_BYTES["cert"] = saved


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def simulate(p: Profile, progress: bool = True) -> Measured:
    """One run of profile ``p`` (module docstring): peer p0 never dies, so the swarm always has a survivor."""
    import logging

    from p2p_diloco.metrics.events import Event
    from p2p_diloco.testing.harness import SETTINGS, SimSwarm

    logging.getLogger("p2p_diloco").setLevel(logging.CRITICAL)
    started, cpu0 = time.perf_counter(), time.process_time()
    step_s = p.compute_s / p.inner_steps
    out = Measured(p.n, 0, 0, 0, 0, 0, 0)
    done: dict[tuple[str, int], int] = {}  # (peer, round) -> inner steps trained (inner_done)
    began: dict[str, tuple[int, float]] = {}  # peer -> (round, start of its inner steps)
    commits: dict[int, int] = {}  # round -> size of its first committed group
    digests: dict[int, set] = {}  # round -> digests committed

    def on_event(name: str, event: dict) -> None:
        kind, k = event["event"], event["round"]
        if kind == Event.ROUND_START:
            began[name] = (k, swarm.sim.now)
        elif kind == Event.INNER_DONE:
            done[(name, k)] = int(event.get("inner_steps", 0))
        elif kind == Event.OUTER_STEP:
            out.steps_reached += int(event.get("inner_steps", 0))
            out.commits += 1
            out.solo += int(event.get("signers", 0)) == 1
            digests.setdefault(k, set()).add(event.get("digest"))
            if k not in commits:
                commits[k] = int(event.get("signers", 0))
                out.round_ends.append(swarm.sim.now)
                if progress:
                    print(f"  N={p.n}: round {k} committed at t={swarm.sim.now:.0f}s by {commits[k]} peers, "
                          f"{out.deaths} deaths, {len(fails())} failed transfers, wall "
                          f"{time.perf_counter() - started:.0f} s", flush=True)
        elif kind == Event.ALLREDUCE_FAILED and "could not find a group" in str(event.get("reason", "")):
            out.failed_matchmaking += 1

    def fails() -> list:
        return [g for g in swarm.net.groups if g.failure and g.begin_time > 0]

    sets = [*SETTINGS, *p.sets()]
    cap = members_cap(p.n if p.uncapped else None)
    with cap, SimSwarm(sets, transfer_seconds=p.sync_s, assemble_seconds=0.2, download_seconds=60.0) as swarm:
        swarm.net.poll = p.poll_s
        swarm.hooks.append(on_event)
        peers = [swarm.add(step_seconds=step_s, name=f"p{i}") for i in range(p.n)]
        dead: dict[str, float] = {}

        def kill(i: int) -> None:
            sp = peers[i]
            if sp.task is not None and sp.task.done():
                return
            dead[sp.name] = swarm.sim.now
            out.deaths += 1
            swarm.net.kill(sp.name)

        for t, i in death_times(p.n, p.deaths_per_peer_day, p.limit(), p.seed):
            if i != 0:
                swarm.sim.call_at(t, lambda i=i: kill(i))
        alive = lambda: [sp for sp in peers if sp.name not in dead]  # noqa: E731

        def tick() -> None:  # what a virtual hour costs, for runs too long to finish (extrapolation)
            print(f"  N={p.n}: t={swarm.sim.now:.0f}s, {out.deaths} deaths, {len(fails())} failed transfers, "
                  f"wall {time.perf_counter() - started:.0f} s, CPU {time.process_time() - cpu0:.0f} s, "
                  f"RSS {_peak_rss_mib():.0f} MiB", flush=True)
            swarm.sim.call_at(swarm.sim.now + TICK_S, tick)

        if progress:
            swarm.sim.call_at(TICK_S, tick)
        out.finished = swarm.sim.run(lambda: all(sp.task is not None and sp.task.done() for sp in alive()),
                                     max_time=p.limit())
        out.end_s = swarm.sim.now
        for sp in peers:  # steps trained: inner_done per round, and a killed peer's steps before its death
            if sp.name in dead and sp.name in began:
                k, t0 = began[sp.name]
                if (sp.name, k) not in done:
                    done[(sp.name, k)] = min(p.inner_steps, int((dead[sp.name] - t0) / step_s))
        out.steps_run = sum(done.values())
        out.failed_transfers = len(fails())
        out.rounds = len(commits)
        out.forks = sum(1 for d in digests.values() if len(d) > 1)
        out.group_sizes = [commits[k] for k in sorted(commits)]
    out.wall_s = time.perf_counter() - started
    out.cpu_s = time.process_time() - cpu0
    out.peak_rss_mib = _peak_rss_mib()
    return out


def merge(runs: list[Measured]) -> Measured:
    """Runs of one profile (other seeds) as one: counts summed, lists joined, costs summed (peak RSS: the max);
    ``finished`` if every run finished."""
    out = Measured(runs[0].n, 0, 0, 0, 0, 0, 0, finished=True)
    for m in runs:
        out.rounds += m.rounds
        out.deaths += m.deaths
        out.steps_run += m.steps_run
        out.steps_reached += m.steps_reached
        out.failed_transfers += m.failed_transfers
        out.failed_matchmaking += m.failed_matchmaking
        out.forks += m.forks
        out.commits += m.commits
        out.solo += m.solo
        out.group_sizes += m.group_sizes
        out.round_ends += m.round_ends
        out.end_s += m.end_s
        out.finished = out.finished and m.finished
        out.wall_s += m.wall_s
        out.cpu_s += m.cpu_s
        out.peak_rss_mib = max(out.peak_rss_mib, m.peak_rss_mib)
    return out


def report(p: Profile, m: Measured | None, death_cost_s: float, seeds: int = 1) -> str:
    """The closed forms for ``p`` (and a higher churn, and int8's shorter sync), then the simulated run ``m``."""
    lines = [f"protocol_sim --scale {p.n}: rounds of {p.compute_s:.0f} s compute ({p.inner_steps} inner steps) + a "
             f"{p.sync_s:.0f} s transfer; deaths {p.deaths_per_peer_day:g} per peer-day; D = {death_cost_s:.0f} s "
             "per failed attempt"]
    lines.append("closed forms (today: a death mid-transfer restarts it; goal: it costs D + S/N):")
    lines.append(f"  {'N':>5} {'S s':>6} {'deaths/day':>10} {'lambda S':>9} {'P(death)':>9} {'attempts':>10} "
                 f"{'sync today':>12} {'sync goal':>10} {'lost today':>10} {'lost goal':>9}")
    int8 = sync_seconds(30e9, 1.031, GBIT, p.n)
    cases = ((p.sync_s, p.deaths_per_peer_day), (p.sync_s, HIGH_CHURN), (int8, p.deaths_per_peer_day),
             (int8, HIGH_CHURN))
    for s_, rate in cases:
        e = expected(p.n, s_, rate, death_cost_s, p.compute_s)
        today = f"{e.sync_restart_s:.3g} s" if math.isfinite(e.sync_restart_s) else "never"
        lines.append(f"  {p.n:>5} {s_:>6.0f} {rate:>10g} {e.lam_s:>9.2f} {e.p_death:>9.4f} {e.attempts_restart:>10.3g} "
                     f"{today:>12} {e.sync_share_s:>8.0f} s {e.lost_restart:>10.3f} {e.lost_share:>9.3f}")
    if m is None:
        return "\n".join(lines)
    lines.append(f"simulated ({'cap lifted to N' if p.uncapped else 'today: at most 64 members per group'}; "
                 f"{seeds} run(s), seeds {p.seed}..{p.seed + seeds - 1}, summed; heartbeat {p.heartbeat_s:g} s, "
                 f"record ttl {p.peer_ttl_s:g} s, matchmaking "
                 f"{p.matchmaking_s:g} s):")
    ended = "all done" if m.finished else "limit"
    ends = ", ".join(f"{t:.0f}" for t in m.round_ends) or "-"
    lines.append(f"  rounds committed {m.rounds} of {seeds * p.rounds} in {m.end_s:.0f} virtual s ({ended}); round "
                 f"ends {ends} s; committed group sizes {m.group_sizes or '-'}")
    lines.append(f"  deaths {m.deaths}; transfers failed (restarts) {m.failed_transfers}; attempts without a group "
                 f"{m.failed_matchmaking}; inner steps run {m.steps_run}, reached theta {m.steps_reached}")
    lines.append(f"  outer steps {m.commits} ({m.solo} of a group of one); rounds with two committed digests "
                 f"(forks) {m.forks}")
    lines.append(f"  cost: wall {m.wall_s:.0f} s, CPU {m.cpu_s:.0f} s, peak RSS {m.peak_rss_mib:.0f} MiB; "
                 f"{m.cpu_s / max(1.0, m.end_s / 3600):.1f} CPU s per virtual hour")
    lines.append(f"n={p.n} rounds={m.rounds} lost_work={m.lost_work:.3f} restarts_per_round={m.restarts_per_round:.2f}")
    return "\n".join(lines)
