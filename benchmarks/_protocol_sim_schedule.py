"""Random fault schedules for ``benchmarks/protocol_sim.py``: one seed, one schedule (:func:`draw`).

A schedule is a swarm (N peers: their speed, client mode, lying donors, late joiners), a number of rounds, and a
list of faults, each aimed at one round k: it fires when a given peer emits a given event of round k
(``round_start``, ``inner_done``, ``allreduce_start``, ``allreduce_running``, ``allreduce_done``, ``outer_step``),
at once inside that event (``delay`` None: before the peer does anything else) or ``delay`` virtual seconds later.
Aiming at events rather than at clock times puts faults in training, matchmaking, the transfer and the commit
window whatever the round's duration. A fault whose event never comes (its peer was killed or caught up past it)
does not fire.

Profiles: seeds below :data:`FULL_BASE` draw the ``quick`` distribution (small swarms, few rounds), seeds from it the
``full`` one (more and larger swarms), so a seed alone replays a schedule.

The fault model (what the liveness bound assumes, enforced here): at most ``f`` faults per round; at most
(N - 1) // 2 peers killed or stopped over the whole schedule, never the *anchor* (peer p0: honest, not in client
mode), so that a reachable honest majority (and a peer that can serve state) remains; every fault but a kill or a
stop ends (freezes thaw, partitions heal, slow links recover); at most one lying donor, never the anchor.
One kind breaks the premise on purpose, rarely (``stuck_leader``: a leader that waits for more peers than there are,
so that no group forms while it lives): its schedules are checked for safety only (:attr:`Schedule.bounded`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

FULL_BASE = 1_000_000  # seeds from here draw the full profile
TRIGGERS = ("round_start", "inner_done", "allreduce_start", "allreduce_running", "allreduce_done", "outer_step")
# fault kind -> weight (faults counted against f)
KINDS = {"kill": 12, "freeze": 14, "partition": 7, "hide": 7, "stale": 5, "drop": 9, "fail_late": 9, "slow": 8,
         "hold": 6, "lead": 7, "stall": 5, "leave": 3, "stuck_leader": 1}
# faults that break the liveness premise (they never end): such schedules are checked for safety only
UNBOUNDED = ("stuck_leader",)


@dataclass(frozen=True)
class PeerSpec:
    name: str
    step_seconds: float
    client: bool = False
    liar: bool = False
    join: tuple[str, int, float] | None = None  # joins when (peer, round k) emits round_start, + delay
    stalls: tuple[tuple[int, float], ...] = ()  # (round k, seconds) stuck before its first inner step


@dataclass(frozen=True)
class Fault:
    kind: str
    round: int  # k: the round it is aimed at (1..rounds)
    trigger: tuple[str, str]  # (peer, event)
    delay: float | None  # None: inside the triggering event
    targets: tuple[str, ...] = ()
    seconds: float = 0.0  # how long it acts (freeze, partition, hide, stale, slow), or how late (hold, stall)
    amount: float = 0.0  # slow: extra transfer seconds; lead, stuck_leader: the group size it forms
    count: int = 0  # drop, fail_late, lead: groups it acts on

    def text(self) -> str:
        when = f"{self.trigger[0]}:{self.trigger[1]}@{self.round}"
        when += "" if self.delay is None else f"+{self.delay:.2f}"
        what = ",".join(self.targets)
        extra = f" {self.seconds:.1f}s" if self.seconds else ""
        extra += f" amount={self.amount:g}" if self.amount else ""
        extra += f" x{self.count}" if self.count else ""
        return f"{self.kind}({what}{extra}) at {when}"


@dataclass(frozen=True)
class Sybils:
    round: int  # planted when the anchor commits round k
    claim_ahead: int  # the round they claim: the anchor's + this
    serve: bool  # the first one serves the poisoned state


@dataclass(frozen=True)
class Schedule:
    seed: int
    profile: str
    n: int
    rounds: int
    inner_steps: int
    min_peers: int
    f: int
    peers: tuple[PeerSpec, ...]
    faults: tuple[Fault, ...] = ()
    sybils: tuple[Sybils, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def bounded(self) -> bool:
        """Every fault ends: the liveness bound applies."""
        return not any(f.kind in UNBOUNDED for f in self.faults)

    @property
    def initial(self) -> list[PeerSpec]:
        return [p for p in self.peers if p.join is None]

    def text(self) -> str:
        peers = " ".join(p.name + ("/client" if p.client else "") + ("/liar" if p.liar else "")
                         + (f"/join@{p.join[1]}" if p.join else "") + (f"/step{p.step_seconds:g}")
                         + "".join(f"/stall{k}:{s:.0f}s" for k, s in p.stalls) for p in self.peers)
        lines = [f"seed={self.seed} profile={self.profile} N={self.n} rounds={self.rounds} H={self.inner_steps} "
                 f"min_peers={self.min_peers} f={self.f}", f"  peers: {peers}"]
        lines += [f"  fault: {f.text()}" for f in self.faults]
        lines += [f"  sybils at round {s.round}: claim +{s.claim_ahead}, serve={s.serve}" for s in self.sybils]
        return "\n".join(lines)


def profile_of(seed: int) -> str:
    return "full" if seed >= FULL_BASE else "quick"


def _size(rng: random.Random, profile: str) -> tuple[int, int]:
    """(N, rounds). A commit step costs every member O(N^2) work per poll of the signatures (each parses every
    member's blobs), so large swarms cost the simulation O(N^3) per round: quick keeps them to a small share."""
    x = rng.random()
    if profile == "quick":
        if x < 0.87:
            return rng.randint(3, 8), rng.randint(2, 4)
        if x < 0.975:
            return rng.randint(9, 16), rng.randint(2, 3)
        return rng.choice((17, 20, 24, 32, 32, 48, 64)), 2
    if x < 0.6:
        return rng.randint(3, 8), rng.randint(3, 6)
    if x < 0.88:
        return rng.randint(9, 24), rng.randint(2, 4)
    return rng.randint(25, 64), rng.randint(2, 3)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw(seed: int, f: int = 2) -> Schedule:
    """The schedule of ``seed`` (module docstring); ``f``: faults per round at most."""
    rng = random.Random(seed)
    profile = profile_of(seed)
    n, rounds = _size(rng, profile)
    big = n > 16
    inner_steps = rng.randint(5, 12)
    joiners = 0 if n < 4 or rng.random() < 0.7 else rng.randint(1, min(2, n - 3))
    first = n - joiners
    names = [f"p{i}" for i in range(n)]
    clients = rng.random() < 0.25
    liar = rng.randrange(1, first) if n >= 4 and rng.random() < 0.15 else None
    peers = []
    for i, name in enumerate(names):
        slow = rng.random() < 0.1
        step = rng.uniform(0.02, 0.06) * (5 if slow else 1)
        join = None
        if i >= first:
            join = ("p0", rng.randint(1, max(1, rounds - 1)), round(rng.uniform(0.0, 3.0), 3))
        peers.append(PeerSpec(name, round(step, 4), client=clients and i > 0 and rng.random() < 0.3,
                              liar=i == liar, join=join))
    honest = [p.name for p in peers if not p.liar]
    removable = (n - 1) // 2  # killed or stopped at most, over the whole run
    faults: list[Fault] = []
    stalls: dict[str, list[tuple[int, float]]] = {}
    weights = [0.3, 0.45, 0.25] + [0.1] * max(0, f - 2)
    for k in range(1, rounds + 1):
        count = rng.choices(range(f + 1), weights[:f + 1])[0]
        for _ in range(count):
            kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
            if kind == "stuck_leader" and big:  # 10 minutes of N peers matchmaking: too slow to simulate often
                kind = "lead"
            target = rng.choice(honest)
            if kind in ("kill", "leave"):
                if removable == 0:
                    kind = "freeze"
                else:
                    target = rng.choice([h for h in honest if h != "p0"])
                    removable -= 1
            trigger_peer = target if rng.random() < 0.6 else rng.choice(honest)
            trigger = (trigger_peer, rng.choice(TRIGGERS))
            delay = None if rng.random() < 0.3 else round(rng.uniform(0.0, 0.5) if rng.random() < 0.6
                                                          else rng.uniform(0.0, 6.0), 3)
            others = [h for h in names if h != target]
            fault = Fault(kind, k, trigger, delay, (target,))
            if kind == "freeze":
                fault = Fault(kind, k, trigger, delay, (target,), seconds=round(_log_uniform(rng, 0.2, 40.0), 2))
            elif kind == "partition":
                side = rng.sample(others, rng.randint(0, max(0, (n - 1) // 2 - 1)))
                fault = Fault(kind, k, trigger, delay, tuple(sorted([target, *side])),
                              seconds=round(_log_uniform(rng, 0.5, 30.0), 2))
            elif kind in ("hide", "stale"):
                fault = Fault(kind, k, trigger, delay, (target, rng.choice(others)),
                              seconds=round(_log_uniform(rng, 0.5, 30.0), 2))
            elif kind in ("drop", "fail_late"):
                fault = Fault(kind, k, trigger, delay, (target,), count=rng.randint(1, 3 if kind == "drop" else 2))
            elif kind == "slow":
                amount = rng.uniform(0.5, 5.0) if rng.random() < 0.6 else rng.uniform(15.0, 40.0)
                fault = Fault(kind, k, trigger, delay, (target,), seconds=round(_log_uniform(rng, 2.0, 40.0), 2),
                              amount=round(amount, 2))
            elif kind == "hold":
                fault = Fault(kind, k, ("-", "start"), None, (target,), seconds=round(rng.uniform(1.0, 12.0), 2))
            elif kind == "lead":  # a smaller group than the others expect (or theirs, if only that many are left)
                fault = Fault(kind, k, (target, "round_start"), delay, (target,), amount=rng.randint(1, 2),
                              count=rng.randint(1, 3))
            elif kind == "stuck_leader":  # a leader waiting for more peers than there are: no group ever forms
                fault = Fault(kind, k, (target, "round_start"), delay, (target,), amount=n + 1, count=10 ** 6)
            elif kind == "stall":
                seconds = round(_log_uniform(rng, 1.0, 40.0), 2)
                stalls.setdefault(target, []).append((k, seconds))
                fault = Fault(kind, k, ("-", "start"), None, (target,), seconds=seconds)
            faults.append(fault)
    peers = [PeerSpec(p.name, p.step_seconds, p.client, p.liar, p.join, tuple(stalls.get(p.name, ())))
             for p in peers]
    sybils = ()
    if rng.random() < 0.15:
        sybils = (Sybils(rng.randint(1, rounds), rng.choice((0, 1, 2, 5, 1000)), rng.random() < 0.7),)
    min_peers = first if rng.random() < 0.7 else 1
    notes = ("large",) if big else ()
    return Schedule(seed, profile, n, rounds, inner_steps, min_peers, f, tuple(peers), tuple(faults), sybils, notes)
