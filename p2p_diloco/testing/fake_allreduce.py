"""The in-memory all-reduce of :mod:`p2p_diloco.testing.fake_swarm`: matchmaking by round and group size, a
transfer that takes virtual time, and the failures a real all-reduce has (a member killed, frozen, stopped, or
losing its parts). The average is computed once, with the real validation and aggregation rules
(:mod:`p2p_diloco.outer.aggregation`) and the run's wire codec, and every member copies the same bits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..outer.aggregation import Contribution, Policy, aggregate, corrupt_
from ..outer.codecs import codec_for
from ..swarm.port import followers_to_regroup


@dataclass
class Call:
    """One member's all-reduce attempt, from matchmaking to its result."""

    swarm: Any  # the member's FakeSwarm
    request: Any  # AllReduceRequest
    started: float
    found: Any  # SimEvent: set when a group takes this call
    group: Group | None = None
    refused: set = field(default_factory=set)  # (as a designated leader) followers seen asking under another key

    @property
    def key(self) -> tuple:
        return (self.swarm.cfg.fingerprint(), self.request.round, self.request.group_size)


@dataclass
class Group:
    """Members that matched; the transfer begins after ``assemble_seconds`` and ends ``transfer_seconds`` later."""

    net: Any  # the FakeNetwork
    calls: list[Call]
    formed: float
    began: Any  # SimEvent
    ended: Any  # SimEvent: the average is ready, or the group failed
    failure: str | None = None
    result: list[torch.Tensor] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    begin_time: float = 0.0
    late: set[str] = field(default_factory=set)  # members that fail although the others got the average
    sent: dict[str, torch.Tensor] = field(default_factory=dict)  # what each member's buffer held (flat), for tests
    lost: list[str] = field(default_factory=list)  # a member killed mid-transfer, its slice re-reduced
    repaired_at: float = 0.0  # the re-reduction of its slice ends then

    @property
    def members(self) -> list[str]:
        return [c.swarm.peer_id for c in self.calls]

    def fail(self, reason: str) -> None:
        if not self.ended.is_set():
            self.failure = reason
            self.began.set()
            self.ended.set()

    def lose(self, peer_id: str) -> bool:
        """A member was killed mid-transfer: as the TCP data plane does (swarm/slice_repair.py), the survivors of a
        group of 3 or more re-reduce its slice, 1/N of the transfer more, and the group goes on without it (the fake
        averages every slice over the survivors; the real one keeps its part in the slices reduced before). False:
        the group fails instead (before the transfer, a second death, a group of two)."""
        if not self.began.is_set() or self.ended.is_set() or self.lost or len(self.calls) < 3:
            return False
        n = len(self.calls)
        self.calls = [c for c in self.calls if c.swarm.peer_id != peer_id]
        self.lost = [peer_id]
        own = self.begin_time + self.net.transfer_seconds + max(self.net.slow.get(m, 0.0) for m in self.members)
        self.repaired_at = max(own, self.net.clock.monotonic() + self.net.transfer_seconds / n)
        self.net.sim.call_at(self.repaired_at, self.finish)
        return True

    def begin(self) -> None:
        if self.ended.is_set():
            return
        self.begin_time = self.net.clock.monotonic()
        self.began.set()
        frozen = [m for m in self.members if self.net.sim.frozen(m)]
        if frozen:  # a frozen member sends nothing: the others notice after a chunk timeout
            self.net.sim.call_at(self.begin_time + self._chunk_timeout(),
                                 lambda: self.fail(f"no part from {frozen[0]} within the chunk timeout"))
            return
        seconds = self.net.transfer_seconds + max(self.net.slow.get(m, 0.0) for m in self.members)
        limit = min(c.request.allreduce_timeout or c.swarm.cfg.swarm.allreduce_timeout for c in self.calls)
        if seconds > limit:
            self.net.sim.call_at(self.begin_time + limit, lambda: self.fail("all-reduce step did not finish in time"))
        else:
            self.net.sim.call_at(self.begin_time + seconds, self.finish)

    def _chunk_timeout(self) -> float:
        return min(c.swarm.cfg.swarm.next_chunk_timeout for c in self.calls)

    def finish(self) -> None:
        """The transfer is over: every member gets the same average (or the group fails)."""
        if self.ended.is_set() or any(self.net.sim.frozen(m) for m in self.members):
            return  # (a member frozen mid-transfer: the chunk timeout fails the group)
        if self.net.clock.monotonic() < self.repaired_at:
            self.net.sim.call_at(self.repaired_at, self.finish)
            return
        dropped = [m for m in self.members if self.net.drops.get(m, 0) > 0]
        if dropped:
            self.net.drops[dropped[0]] -= 1
            self.fail(f"reducer {dropped[0]} failed (1 parts missing)")
            return
        calls = sorted(self.calls, key=lambda c: c.swarm.peer_id)
        flats = []
        for c in calls:
            flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in c.request.tensors])
            self.sent[c.swarm.peer_id] = flat
            mode = c.swarm.cfg.debug.corrupt_pseudo_gradient
            if mode:  # the security tests' malicious peer, as the real swarm does it
                flat = flat.clone()
                corrupt_([flat], mode, torch.Generator().manual_seed(c.swarm.cfg.run.seed + 1))
            flats.append(flat)
        cfg = calls[0].swarm.cfg
        policy = Policy(method=cfg.outer.aggregation, norm_bound=cfg.outer.norm_bound, trim=cfg.outer.trim)
        # as the butterfly does: member i reduces slice i, with its own contribution as the norm bound's reference
        numel, n = flats[0].numel(), len(calls)
        bounds = [numel * i // n for i in range(n + 1)]
        parts, excluded = [], {}
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            contributions = [Contribution(j, f[lo:hi], float(c.request.weight))
                             for j, (c, f) in enumerate(zip(calls, flats))]
            try:
                part, left_out = aggregate(contributions, policy, hi - lo, own=i)
            except Exception as e:  # every contribution excluded: the round fails on every member
                self.fail(f"reducer {calls[i].swarm.peer_id} failed: {e}")
                return
            parts.append(part)
            for j, reason in left_out.items():
                excluded.setdefault(j, reason)
        average = torch.cat(parts)
        average = codec_for(cfg.outer).round_trip(average)
        self.excluded = {calls[i].swarm.peer_id: reason for i, reason in excluded.items()}
        self.result = [average]
        for m in self.members:  # they read their answers too late: the others hold the complete result
            if self.net.late.get(m, 0) > 0:
                self.net.late[m] -= 1
                self.late.add(m)
        self.ended.set()

    def result_like(self, tensors) -> list[torch.Tensor]:
        """The average, cut like ``tensors``."""
        out, offset = [], 0
        for t in tensors:
            out.append(self.result[0][offset:offset + t.numel()].view_as(t).clone())
            offset += t.numel()
        return out


def matchmake(net: Any, call: Call) -> None:
    """Add ``call`` to the calls looking for a group; form a group of every ``group_size`` calls with the same
    run, round and group size, in the order they came. A leader (:meth:`FakeNetwork.lead`) forms a group of its
    own size from calls of its round whatever size they expect, as hivemind's followers accept what a leader
    sends."""
    net.looking.append(call)
    leader = next((c for c in net.looking if net.leaders.get(c.swarm.peer_id, (0, 0))[1] > 0
                   and c.key[:2] == call.key[:2]), None)
    if leader is not None:
        same = [leader] + [c for c in net.looking if c.key[:2] == call.key[:2] and c is not leader]
        size = net.leaders[leader.swarm.peer_id][0]
    else:
        same = [c for c in net.looking if c.key == call.key]
        size = call.request.group_size
    if len(same) < size:
        return
    if size > 1 and all(c.swarm.sc.client_mode for c in same[:size]):
        return  # hivemind: client-mode peers only join groups led by a peer that accepts connections
    if leader is not None:
        size_, left = net.leaders[leader.swarm.peer_id]
        net.leaders[leader.swarm.peer_id] = (size_, left - 1)
    calls = same[:size]
    for c in calls:
        net.looking.remove(c)
    group = Group(net, calls, net.clock.monotonic(), net.clock.event(), net.clock.event())
    net.groups.append(group)
    for c in calls:
        c.group = group
        c.found.set()
    net.sim.call_at(group.formed + net.assemble_seconds, group.begin)


def followers_expect_other(call: Call) -> bool:
    """Whether ``call`` is a ``regroup`` designated leader that refused as many distinct followers asking under
    another key as end a real leader's attempt (``port.followers_to_regroup``; :func:`leader_expects_other` counts
    them, once each, as the real leader does whether they stay or not)."""
    if not call.request.regroup or call.request.leader != call.swarm.peer_id:
        return False
    return len(call.refused) >= followers_to_regroup(call.request.group_size)


def leader_expects_other(net: Any, call: Call) -> bool:
    """Whether ``call`` is a ``regroup`` follower whose designated leader is looking for a group under another key
    (another size for the same run and round): the real leader answers such a request ``BAD_GROUP_KEY``
    (swarm/led_matchmaking.py), and counts it if it leads by designation too. The fake forms groups by key alone,
    so this is all a leader changes here."""
    leader = call.request.leader
    if leader in (None, call.swarm.peer_id):
        return False
    theirs = next((c for c in net.looking if c.swarm.peer_id == leader and c.key[:2] == call.key[:2]), None)
    if theirs is None or theirs.key == call.key:
        return False
    if theirs.request.leader == leader:
        theirs.refused.add(call.swarm.peer_id)
    return call.request.regroup
