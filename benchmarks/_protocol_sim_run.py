"""Runs one schedule of ``benchmarks/protocol_sim.py`` (:func:`run`): real peers (:class:`~p2p_diloco.testing.harness.
SimSwarm`: the real Peer driver, decisions and outer step, a fake model) on the in-memory swarm and virtual clock,
its faults injected at their events, every event checked by :class:`~._protocol_sim_check.Checker` as it is
emitted, and the liveness bound checked at the end.

Liveness (``stalled``): with the premise below, every round commits within a bound. Checked at the end: a schedule
is stalled if an honest peer that was neither killed nor stopped has not finished all R rounds by

    T = A + (min_peers_timeout + state_timeout) + R x ROUND_BOUND + sum over the faults that fired of their cost

where A is the arrival of the last peer (0, or a late joiner's start); the second term the wait for
``swarm.min_peers`` and the linger at the end of the run (180 s); ROUND_BOUND (30 s) a fault-free round with margin
(here under 12 s: at most 12 inner steps of at most 0.3 s, the all-reduce, the commit step and, alone, a 7 s
confirmation); and a fault's cost how long it acts (a freeze, a partition, hidden or stale reads, a slow link: its
duration; a stall or a held start: its seconds; a dropped or late-failing group or a smaller leader's group:
``count`` x 60 s) plus :func:`recovery` (139 s), the longest chain of timeouts one fault can add to a round. The sum
grows as faults fire: the run goes on while it does.

The premise (else the schedule is checked for safety only, and counted under ``premise``): every fault ends (no
``stuck_leader``), and at every fault and every commit, at least half of the last certified group of the swarm's
chain (the latest round committed by a group that keeps half of its previous group) can take part: not killed,
stopped, frozen, on the minority side of a partition, or reading hidden or stale records. The hand-off rule lets the
chain go on with no fewer. The generator keeps at most ``f`` faults per round and an anchor peer that is never
killed (:mod:`._protocol_sim_schedule`).

A peer is not judged (``excused``) if it was out of reach when the others finished: it arrived after the first
commit of the last round, or it was frozen or cut off at some moment between that commit and the end of the
others' runs. Nobody is left then to sign a round with it or to give it the state. Such a peer may wait forever, so
the run stops once it is the only kind left and GRACE has passed since the others ended, since it was last frozen
or cut off, and since its wait for ``swarm.min_peers`` ended: time for anything it still does (a solo step that
forks) to be seen.
"""

from __future__ import annotations

import hashlib
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.metrics.events import Event
from p2p_diloco.outer import optimizer as opt
from p2p_diloco.protocol.certificate import Certificate, Statement, sign
from p2p_diloco.config import load_config
from p2p_diloco.errors import SwarmError
from p2p_diloco.testing.harness import SETTINGS, SimPeer, SimSwarm

from ._protocol_sim_check import Checker, Violation
from ._protocol_sim_schedule import Fault, Schedule, Sybils

YEAR = 365 * 86400.0
ROUND_BOUND = 30.0  # virtual seconds: a fault-free round here takes under 12 (module docstring)
GROUP_COST = 60.0  # virtual seconds per group a drop, a late failure or a smaller leader's group spoils
GRACE = 120.0  # virtual seconds a peer out of reach at the end is still watched after the others ended


def start_bound(sc) -> float:
    """The wait for ``swarm.min_peers`` and the linger at the end of the run."""
    return sc.min_peers_timeout + sc.state_timeout


def recovery(sc) -> float:
    """The longest chain of timeouts one fault adds to a round: its record expiring, two failed attempts (twice the
    matchmaking window, then the all-reduce timeout), the commit window, a solo step's confirmation and a state
    download (139 s with the harness's settings)."""
    return (sc.peer_ttl + 2 * (2 * sc.matchmaking_time + sc.allreduce_timeout) + sc.peer_ttl
            + sc.peer_ttl + sc.heartbeat_period + sc.state_timeout)


@dataclass
class Outcome:
    seed: int
    n: int
    rounds: int
    profile: str
    violations: list[Violation] = field(default_factory=list)
    stalled: str = ""  # why, if stalled
    premise: str = ""  # why the liveness premise broke ("": it held, liveness was judged)
    excused: list[str] = field(default_factory=list)  # peers not finished, out of reach when the others finished
    fired: int = 0  # faults that fired
    kinds: dict[str, int] = field(default_factory=dict)  # faults that fired, by kind
    features: tuple[str, ...] = ()  # late joiners, client-mode peers, a lying donor, Sybils
    end: float = 0.0  # virtual seconds at the end
    bound: float = 0.0
    wall: float = 0.0
    trace: str = ""  # hash of every event: the same seed gives the same trace

    def line(self) -> str:
        return (f"seed={self.seed} N={self.n} rounds={self.rounds} fired={self.fired} end={self.end:.1f}s "
                f"bound={self.bound:.1f}s wall={self.wall:.2f}s violations={len(self.violations)} "
                f"stalled={'yes: ' + self.stalled if self.stalled else 'no'}")


def fault_cost(fault: Fault, sc) -> float:
    """What ``fault`` may add to the run at most (module docstring)."""
    if fault.kind in ("freeze", "partition", "hide", "stale", "slow", "stall", "hold"):
        return fault.seconds + recovery(sc)
    if fault.kind in ("drop", "fail_late", "lead"):
        return fault.count * GROUP_COST + recovery(sc)
    return recovery(sc)


class Run:
    """One schedule on one SimSwarm (module docstring)."""

    def __init__(self, schedule: Schedule):
        self.s = schedule
        self.swarm: SimSwarm | None = None
        self.peers: dict[str, SimPeer] = {}
        self.specs = {p.name: p for p in schedule.peers}
        self.honest = {p.name for p in schedule.peers if not p.liar}
        self.initial_honest = [p.name for p in schedule.initial if not p.liar]
        self.left: set[str] = set()
        self.fired: list[Fault] = []
        self.arrivals: list[float] = [0.0]
        self.arrived: dict[str, float] = {}
        self.triggers: dict[tuple[str, str, int], list] = {}
        self.sha = hashlib.sha256()
        self.checker: Checker | None = None
        self.partitions: list[set[str]] = []  # minority sides of the partitions in force
        self.readers: dict[str, int] = {}  # peers whose reads are hidden or stale now (how many faults)
        self.premise = ""  # why the liveness premise broke ("" if it held)
        self.sc = None  # the swarm settings (every peer's)
        self.beyond = 0.0  # virtual seconds to run past the bound (a replay's --beyond: no early stop either)

    # --------------------------------------------------------------------------------------------------- build
    def _sets(self, name: str) -> list[str]:
        spec = self.specs[name]
        roots = [f"/sim/{p}/p2p/{p}" for p in self.initial_honest if p != name]
        sets = [f"swarm.initial_peers={roots!r}"] if roots else []
        if spec.client:
            sets.append("swarm.client_mode=true")
        return sets

    def _add(self, name: str) -> None:
        spec = self.specs[name]
        swarm = self.swarm
        self.peers[name] = swarm.add(sets=self._sets(name), step_seconds=spec.step_seconds,
                                     stalls=dict(spec.stalls) or None, name=name)
        self.arrivals.append(swarm.sim.now)
        self.arrived[name] = swarm.sim.now
        fake = swarm.net.swarms[name]
        original = fake.download_state

        def download_state(peer_id: str, shard: int | None = None):
            meta, tensors = original(peer_id, shard)
            if peer_id in swarm.net.liars and isinstance(meta, dict) and isinstance(meta.get("digest"), str):
                self.checker.poison(meta["digest"], f"served by the lying donor {peer_id}")
            return meta, tensors

        fake.download_state = download_state
        for side in self.partitions:  # a partition in force cuts a newcomer from the minority side too
            for a in side:
                for reader, owner in ((a, name), (name, a)):
                    swarm.net.hide(reader, owner)
                    self.checker.hide(reader, owner, swarm.sim.now)
        if spec.liar:
            swarm.net.lie(name)
            self.checker.dishonest_peer(name)

    def _observe_records(self) -> None:
        net, checker = self.swarm.net, self.checker
        original = net.store

        def store(peer_id: str, record: dict, ttl: float) -> None:
            original(peer_id, record, ttl)
            rec, expiration = net.stored[peer_id]
            checker.store(peer_id, net.clock.monotonic(), rec, expiration)

        net.store = store

    def _cooling(self, peer: str, now: float):
        sp = self.peers.get(peer)
        return sp.peer.syncer.liveness.cooling(now) if sp is not None else ()

    # --------------------------------------------------------------------------------------------------- hooks
    def _on_event(self, name: str, event: dict[str, Any]) -> None:
        now = self.swarm.sim.now
        self.sha.update(f"{name}|{event['event']}|{event['round']}|{now:.6f}|{event.get('digest', '')}|"
                        f"{event.get('certificate', '')}|{event.get('from_peer', '')}\n".encode())
        sp = self.peers.get(name)
        try:
            state = sp.state if sp is not None else None
            kind = event["event"]
            members = certificate = digest = prev = None
            if state is not None:
                digest = state.digest
                if kind == Event.OUTER_STEP and state.certificate is not None:
                    members = tuple(state.certificate.statement.members)
                    prev = state.certificate.statement.prev
                if kind == Event.STATE_LOADED and state.certificate is not None:
                    certificate = state.certificate.id
            self.checker.event(name, event, now, members=members, digest=digest, certificate=certificate,
                               prev=prev)
        except Exception:  # the checker must never break a peer: its own bug is a crash of the schedule
            self.checker.crash(name, now, "checker error: " + traceback.format_exc(limit=3))
        if event["event"] == Event.OUTER_STEP:
            self._check_premise()
        for action in self.triggers.pop((name, str(event["event"]), event["round"]), ()):
            action()

    def _arm(self, fault: Fault) -> None:
        if fault.kind in ("hold", "stall"):  # set up before the run
            if fault.kind == "hold":
                self.swarm.net.hold(fault.targets[0], fault.round - 1, fault.seconds)
            self.fired.append(fault)
            self.checker.touch(*fault.targets)
            return
        peer, event = fault.trigger

        def fire() -> None:
            if fault.delay is None:
                self._inject(fault)
            else:
                self.swarm.sim.call_at(self.swarm.sim.now + fault.delay, lambda: self._inject(fault))

        self.triggers.setdefault((peer, event, fault.round), []).append(fire)

    def _usable(self, name: str) -> bool:
        fake = self.swarm.net.swarms.get(name)
        return fake is not None and fake.peer_id is not None and not fake.dead and name not in self.left

    def _inject(self, fault: Fault) -> None:
        if self._usable(fault.targets[0]):
            self._fault(fault)
            self._check_premise()

    def _out_of_reach(self) -> set[str]:
        """Peers that cannot take part in a round now: killed, stopped, frozen, on the minority side of a partition,
        or with hidden or stale reads."""
        net = self.swarm.net
        out = set(self.checker.killed) | self.left | {p for p in self.peers if net.sim.frozen(p)}
        out |= {p for side in self.partitions for p in side} | {p for p, n in self.readers.items() if n > 0}
        return out

    def _check_premise(self) -> None:
        """The liveness premise: at least half of the last certified group (the latest round's first honest commit)
        can take part in the next round (the hand-off rule needs half of it to sign)."""
        if self.premise:
            return
        checker = self.checker
        rounds = [k for k, by in checker.commits.items() if any(c.keeps for c in by.values())]
        if not rounds:
            return
        k = max(rounds)  # the latest round a legitimate continuation (not a minority's fork) committed
        group = set().union(*(c.members for c in checker.commits[k].values() if c.keeps))
        out = self._out_of_reach() & group
        if group and 2 * len(group - out) < len(group):
            self.premise = (f"at t={self.swarm.sim.now:.1f}s, {len(out)} of round {k}'s group of {len(group)} "
                            f"were out of reach ({', '.join(sorted(out))})")

    def _fault(self, fault: Fault) -> None:
        swarm, net, checker, now = self.swarm, self.swarm.net, self.checker, self.swarm.sim.now
        target = fault.targets[0]
        self.fired.append(fault)
        if fault.kind == "kill":
            net.kill(target)
            checker.kill(target, now)
        elif fault.kind == "leave":
            self.left.add(target)
            checker.touch(target)
            self.peers[target].stop.set()
        elif fault.kind == "freeze":
            net.freeze(target)
            checker.freeze(target, now)

            def thaw() -> None:
                net.thaw(target)
                checker.thaw(target, swarm.sim.now)

            swarm.sim.call_at(now + fault.seconds, thaw)
        elif fault.kind in ("partition", "hide", "stale"):
            side = set(fault.targets) if fault.kind == "partition" else set()
            if side:
                rest = [p for p in self.peers if p not in side]
                pairs = [(a, b) for a in side for b in rest] + [(b, a) for a in side for b in rest]
                self.partitions.append(side)
            else:
                pairs = [(fault.targets[0], fault.targets[1])]
                self.readers[target] = self.readers.get(target, 0) + 1
            for reader, owner in pairs:
                (net.stale if fault.kind == "stale" else net.hide)(reader, owner)
                checker.hide(reader, owner, now)

            def heal() -> None:
                if side:
                    self.partitions.remove(side)
                    pairs.extend((a, b) for a in side for b in self.peers if b not in side)
                    pairs.extend((b, a) for a in side for b in self.peers if b not in side)
                else:
                    self.readers[target] -= 1
                for reader, owner in pairs:
                    net.unhide(reader, owner)
                    checker.unhide(reader, owner, swarm.sim.now)

            swarm.sim.call_at(now + fault.seconds, heal)
        elif fault.kind == "drop":
            net.drop(target, fault.count)
            checker.touch(target)
        elif fault.kind == "fail_late":
            net.fail_late(target, fault.count)
            checker.touch(target)
        elif fault.kind == "slow":
            net.slow_down(target, fault.amount)
            checker.touch(target)
            swarm.sim.call_at(now + fault.seconds, lambda: net.slow.pop(target, None))
        elif fault.kind in ("lead", "stuck_leader"):
            net.lead(target, int(fault.amount), fault.count)
            checker.touch(target)

    def _plant_sybils(self, plan: Sybils) -> None:
        """Two free identities claim a round ahead (or ours, with another digest) with a poisoned, self-consistent
        state and a certificate both signed; records and certificates that never expire (tests/sim/test_sybils.py)."""
        swarm, net = self.swarm, self.swarm.net
        victim = self.peers["p0"]
        cfg, now = victim.cfg, swarm.sim.now
        claimed = victim.state.round + plan.claim_ahead
        poisoned = [t.clone() + 1.0 for t in victim.state.optimizer.state_tensors()]
        digest = opt.digest(poisoned)
        self.checker.poison(digest, "a Sybil claim")
        members = ("sybil1", "sybil2")
        statement = Statement(run_id=cfg.run.run_id, fingerprint=cfg.fingerprint(), round=max(0, claimed - 1),
                              members=members, weights=(1.0, 1.0), before="0" * 64, after=digest, prev="1" * 64)
        cert = Certificate(statement, {m: sign(statement, net.keys.signer(m)) for m in members})
        for m in members:
            record = {"fp": cfg.fingerprint(), "round": claimed, "phase": "train", "digest": digest,
                      "head": cert.id, "ready": True, "t": swarm.sim.clock.time()}
            net.stored[m] = (record, now + YEAR)
            net.blobs["cert"][m] = (cert.to_bytes(), now + YEAR)
        if plan.serve:
            meta = {"round": claimed, "digest": digest, "fp": cfg.fingerprint(), "peer_id": members[0],
                    "certificate": cert.to_json()}
            donor = net.factory(members[0])(cfg, victim.state.tensors_like(), lambda *shard: (meta, poisoned))
            donor.peer_id = members[0]

    # ----------------------------------------------------------------------------------------------------- run
    def _done(self) -> bool:
        """Every honest peer (not killed or stopped) has finished; or those left can only be excused (they were
        out of reach when all the others ended), and GRACE has passed since the others ended, since they were last
        frozen or cut off, and since their wait for ``swarm.min_peers`` ended: time enough for anything they would
        still do (a solo step that forks) to show."""
        waiting = []
        for name in self.honest:
            if name in self.left or name in self.checker.killed:
                continue
            sp = self.peers.get(name)
            if sp is None or sp.task is None or not sp.task.done():
                waiting.append(name)
        if not waiting:
            return True
        if self.beyond:
            return False  # a replay told to go on: watch them to the end
        checker, now = self.checker, self.swarm.sim.now
        others = [p for p in self.peers if p in self.honest and p not in waiting]  # ended, killed or stopped
        quiet = max([checker.left_at.get(p, 0.0) for p in others]
                    + [self.arrived.get(p, 0.0) + self.sc.min_peers_timeout for p in waiting]
                    + [hi for p in waiting for lo, hi in checker.frozen.get(p, ())]
                    + [hi for pair, spans in checker.blind.items() if set(pair) & set(waiting) for lo, hi in spans],
                    default=0.0)
        return now >= quiet + GRACE and all(self._excused(p) for p in waiting)

    def _excused(self, name: str) -> bool:
        """Liveness does not judge a peer that was out of reach when the rest of the swarm finished: it arrived after
        the first commit of the last round, or it was frozen or cut off at some moment between that commit and the
        end of the others' runs (then nobody was left to take the state from, or to sign with)."""
        checker = self.checker
        last = checker.first_commit.get(self.s.rounds)
        if last is None:
            return False
        ends = [t for p, t in checker.left_at.items() if p != name and p in self.honest]
        end = max(ends, default=last)
        return self.arrived.get(name, 0.0) >= last or checker.out_of_reach(name, last, max(last, end))

    def bound(self) -> float:
        return (max(self.arrivals) + start_bound(self.sc) + self.s.rounds * ROUND_BOUND
                + sum(fault_cost(f, self.sc) for f in self.fired))

    def run(self, beyond: float = 0.0) -> Outcome:
        """Run the schedule to its end, or to the liveness bound (+ ``beyond`` seconds, for a replay)."""
        s = self.s
        self.beyond = beyond
        out = Outcome(s.seed, s.n, s.rounds, s.profile)
        started = time.perf_counter()
        sets = [f"run.max_rounds={s.rounds}", f"train.inner_steps={s.inner_steps}", f"swarm.min_peers={s.min_peers}"]
        with SimSwarm(sets) as swarm:
            self.swarm = swarm
            self.sc = sc = load_config(None, [*SETTINGS, *sets]).swarm
            self.checker = Checker(sc.peer_ttl + sc.heartbeat_period, sc.round_timeout, "", cooling=self._cooling)
            self._observe_records()
            for spec in s.initial:
                self._add(spec.name)
            self.checker.digests[0] = {self.peers["p0"].state.digest}  # theta(0): the same on every peer
            for spec in s.peers:
                if spec.join is not None:
                    peer, k, delay = spec.join
                    self.triggers.setdefault((peer, "round_start", k), []).append(
                        lambda spec=spec, delay=delay: swarm.sim.call_at(swarm.sim.now + delay,
                                                                        lambda: self._add(spec.name)))
            for fault in s.faults:
                self._arm(fault)
            for plan in s.sybils:
                self.triggers.setdefault(("p0", "outer_step", plan.round), []).append(
                    lambda plan=plan: self._plant_sybils(plan))
            swarm.hooks.append(self._on_event)
            try:
                while True:
                    limit = self.bound() + beyond
                    if swarm.sim.run(self._done, max_time=limit) or swarm.sim.now < limit:
                        break  # every honest peer is done, or nothing is left to run
                    if self.bound() + beyond <= limit:
                        break  # the bound did not move (no fault fired meanwhile): stalled
            except Exception:
                self.checker.crash("-", swarm.sim.now, "simulation error: " + traceback.format_exc(limit=5))
            out.end = swarm.sim.now
            out.bound = self.bound()
            alive = []
            for name in sorted(self.honest):
                sp = self.peers.get(name)
                if sp is None or name in self.checker.killed:
                    continue
                err = sp.task.error if sp.task is not None and sp.task.done() else None
                if err is not None and not isinstance(err, SwarmError):
                    self.checker.crash(name, out.end, f"{type(err).__name__}: {err}")
                    continue
                if name not in self.left:
                    alive.append(name)
            late = []
            for name in alive:
                sp = self.peers[name]
                if sp.task is None or not sp.task.done():
                    late.append(f"{name} in round {sp.state.round + 1} ({sp.recorder.last_status[:80]})")
                elif sp.task.error is not None:  # a SwarmError: the peer gave up, with a one-line reason
                    late.append(f"{name} gave up in round {sp.state.round + 1}: {str(sp.task.error)[:120]}")
                elif sp.task.value is not None and sp.task.value["rounds_completed"] < s.rounds:
                    late.append(f"{name} stopped at round {sp.task.value['rounds_completed']}")
                else:
                    continue
                if self._excused(name):
                    out.excused.append(late.pop())
            premise = "" if s.bounded else "a fault that never ends"
            premise = premise or self.premise
            out.premise = premise
            if late and premise:
                out.excused += late
            elif late:
                out.stalled = f"not finished by t={out.bound:.0f}s: " + "; ".join(late)
            self.checker.finish(out.end, alive)
        out.violations = list(self.checker.violations)
        out.fired = len(self.fired)
        for f in self.fired:
            out.kinds[f.kind] = out.kinds.get(f.kind, 0) + 1
        out.features = tuple(name for name, present in (
            ("late joiners", any(p.join for p in s.peers)), ("client-mode peers", any(p.client for p in s.peers)),
            ("a lying donor", any(p.liar for p in s.peers)), ("Sybils", bool(s.sybils))) if present)
        out.wall = time.perf_counter() - started
        out.trace = self.sha.hexdigest()[:16]
        return out


def run(schedule: Schedule, beyond: float = 0.0) -> Outcome:
    logging.getLogger("p2p_diloco").setLevel(logging.CRITICAL)
    return Run(schedule).run(beyond)
