"""An in-memory swarm for protocol scenarios: the :class:`~p2p_diloco.swarm.port.SwarmPort` of many peers in one
process, on the virtual clock of a :class:`~p2p_diloco.testing.sim.Simulation`, with faults injected by the test.

What it models, as the real swarm does it (``p2p_diloco/swarm/``):

* **records**: each peer's live record, refreshed by a heartbeat task every ``swarm.heartbeat_period`` and stored
  with a ``swarm.peer_ttl`` expiration, so that a killed or frozen peer's record expires a lifetime after its last
  beat; :meth:`FakeSwarm.update` goes out with the next beat, :meth:`FakeSwarm.publish` at once; a reader merges
  what it reads with what it read before, each record kept until its own expiration (as ``Swarm.live_peers``);
* **the all-reduce** (:mod:`.fake_allreduce`): groups of exactly the expected size per round, a transfer that takes
  virtual time, all or nothing, the same bits on every member; as in hivemind, a group of client-mode peers only
  never forms (one member must accept connections);
* **state downloads** from a live, non-client peer, taking virtual time; from a client-mode peer only by a push
  (protocol/push.py): the asker publishes its wish, and the client, alive and not frozen, sees it at one of its
  heartbeats and hands its state over, taking the same time; two clients cannot reach each other;
* **blobs** (``put_blob`` / ``get_blobs``): each peer's latest value per name, expiring like live records, readable by
  every peer (the same :meth:`~FakeNetwork.hide` applies), with the real swarm's checks of name, size and ttl, and
  hivemind's rule that a put replaces the previous value only if it expires later;
* **probes** (``probe``): a killed or shut-down peer refuses a dial at once, a frozen one does not (its kernel still
  accepts), as swarm/probe.py finds them; unlike the real one, the fake knows every started peer's address.

Faults (each a method of :class:`FakeNetwork`): :meth:`~FakeNetwork.kill` (SIGKILL: its tasks end, its parts stop at
once), :meth:`~FakeNetwork.freeze` / :meth:`~FakeNetwork.thaw` (SIGSTOP / SIGCONT), :meth:`~FakeNetwork.drop` (a
group it is in loses its parts), :meth:`~FakeNetwork.slow_down` (its transfers take longer),
:meth:`~FakeNetwork.lie` (it serves a self-consistent state that is not the majority's), :meth:`~FakeNetwork.hide`
(one peer's reads miss another's records and blobs), :meth:`~FakeNetwork.hold` (its first all-reduce attempt of a
round starts late), :meth:`~FakeNetwork.lead` (it forms groups of its own size), :meth:`~FakeNetwork.fail_late`
(it fails an all-reduce the others completed), :meth:`~FakeNetwork.mix_shard` (``outer.sharding = "sharded"``: one
of its shards is averaged with another peer than its other shards).

With shards (``outer.sharding = "sharded"``), a peer's shards are all averaged in its one group (each shard's
group names the same members, as every member's "peer" gathered), unless :meth:`~FakeNetwork.mix_shard` says not.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Iterator, Sequence

import torch

from ..config import Config
from ..config.adoption import check_against_peers
from ..config.sharing import published_settings
from ..errors import RoundFailed, SwarmError
from ..protocol.records import Phase, PeerRecord, wire_fields
from ..protocol.trust import initial_peer_ids
from ..swarm.port import (BLOB_LIFETIMES, BLOB_NAMES, FOLLOWERS_MISMATCH, LEADER_RETRY, REGROUP_REFUSALS,
                          VIEW_MISMATCH, AllReduceRequest, AllReduceResult, check_blob, check_probe)
from . import fake_transfer
from .fake_allreduce import Call, Group, followers_expect_other, leader_expects_other, matchmake
from .fake_keys import FakeKeys
from .sim import Killed, Simulation

POLL = 0.1  # how often a waiting call looks at its stop request


class FakeNetwork:
    """The shared medium of in-memory peers (module docstring).

    Args:
        sim: the simulation whose clock everything runs on.
        transfer_seconds: how long an all-reduce's transfer takes once the group has assembled.
        assemble_seconds: from the last member's arrival to the transfer's start.
        download_seconds: how long a state download takes.
    """

    def __init__(self, sim: Simulation, transfer_seconds: float = 0.2, assemble_seconds: float = 0.2,
                 download_seconds: float = 0.5):
        self.sim, self.clock = sim, sim.clock
        self.transfer_seconds, self.assemble_seconds = transfer_seconds, assemble_seconds
        self.download_seconds = download_seconds
        self.poll = POLL  # a scale run sets it longer: fewer wake-ups of calls that wait (issue 20)
        self.swarms: dict[str, FakeSwarm] = {}
        self.stored: dict[str, tuple[dict, float]] = {}  # peer id -> (live record, expiration)
        self.configs: dict[str, dict] = {}
        # name -> owner -> (value, expiration)
        self.blobs: dict[str, dict[str, tuple[bytes, float]]] = {name: {} for name in BLOB_NAMES}
        self.looking: list[Call] = []
        self.groups: list[Group] = []
        self.drops: dict[str, int] = {}
        self.slow: dict[str, float] = {}
        self.liars: set[str] = set()
        self.hidden: set[tuple[str, str]] = set()
        self.stale_reads: dict[tuple[str, str], tuple[dict, float]] = {}  # (reader, owner) -> record as of stale()
        self.holds: dict[tuple[str, int], float] = {}
        self.keys = FakeKeys()  # the simulated identities that sign round certificates
        self.started: set[str] = set()  # peers whose swarm ever started
        self.leaders: dict[str, tuple[int, int]] = {}  # peer id -> (group size it forms, groups left)
        self.late: dict[str, int] = {}
        self.mixed: dict[str, tuple[int, str, int]] = {}  # peer id -> (shard, stranger, groups left)

    def factory(self, peer_id: str) -> Callable[..., FakeSwarm]:
        """A swarm factory (``(cfg, tensors_like, state_provider, shards=None, state_like=None)``) for the peer
        ``peer_id`` (donations are whatever the provider gives: ``state_like`` is not needed here)."""
        def make(cfg: Config, tensors_like: Sequence[torch.Tensor], provider: Callable[..., tuple],
                 shards: Sequence[int] | None = None, state_like: Sequence[torch.Tensor] | None = None
                 ) -> FakeSwarm:
            swarm = FakeSwarm(self, peer_id, cfg, provider, shards)
            self.swarms[peer_id] = swarm
            return swarm
        return make

    def responds(self, peer_id: str) -> bool:
        """The peer's DHT node is up: started, and neither killed nor shut down (a frozen one answers later)."""
        swarm = self.swarms.get(peer_id)
        return swarm is not None and swarm.peer_id is not None and not swarm.dead and not swarm.stopped.is_set()

    # ------------------------------------------------------------------------------------------------- faults
    def kill(self, peer_id: str) -> None:
        """SIGKILL of the peer's whole process group: its tasks end, its parts stop at once, its records stay
        until they expire."""
        swarm = self.swarms[peer_id]
        swarm.dead = True
        self.sim.kill(peer_id)
        self.looking = [c for c in self.looking if c.swarm is not swarm]
        for group in self._groups_of(peer_id):
            if not group.lose(peer_id):
                group.fail(f"stream with member {peer_id} reset")

    def freeze(self, peer_id: str) -> None:
        """SIGSTOP: nothing of the peer runs (no heartbeats, no parts) until :meth:`thaw`."""
        self.sim.freeze(peer_id)
        swarm = self.swarms[peer_id]
        self.looking = [c for c in self.looking if c.swarm is not swarm]
        for group in self._groups_of(peer_id):
            if group.began.is_set():
                timeout = swarm.cfg.swarm.next_chunk_timeout
                self.sim.call_at(self.clock.monotonic() + timeout,
                                 lambda g=group: g.fail(f"no part from {peer_id} within the chunk timeout"))

    def thaw(self, peer_id: str) -> None:
        self.sim.thaw(peer_id)

    def drop(self, peer_id: str, groups: int = 1) -> None:
        """The next ``groups`` all-reduces this peer is in lose its parts (the group fails)."""
        self.drops[peer_id] = self.drops.get(peer_id, 0) + groups

    def slow_down(self, peer_id: str, seconds: float) -> None:
        """Every all-reduce this peer is in takes ``seconds`` longer."""
        self.slow[peer_id] = seconds

    def lie(self, peer_id: str) -> None:
        """The peer serves downloaders a state that is self-consistent (its digest matches) but not the majority's."""
        self.liars.add(peer_id)

    def hide(self, reader: str, owner: str) -> None:
        """``reader``'s reads of the records and blobs miss ``owner``'s (as a frozen or slow DHT node would)."""
        self.hidden.add((reader, owner))

    def unhide(self, reader: str, owner: str) -> None:
        """Ends :meth:`hide` (and :meth:`stale`) for this pair."""
        self.hidden.discard((reader, owner))
        self.stale_reads.pop((reader, owner), None)

    def stale(self, reader: str, owner: str) -> None:
        """``reader``'s reads of ``owner``'s record return the version stored now, until it expires or
        :meth:`unhide` (as a DHT replica that missed the updates would)."""
        if owner in self.stored:
            self.stale_reads[(reader, owner)] = self.stored[owner]

    def hold(self, peer_id: str, round_: int, seconds: float) -> None:
        """The peer's first all-reduce attempt of the round that starts from theta(``round_``) starts ``seconds``
        late (the others wait in matchmaking meanwhile)."""
        self.holds[(peer_id, round_)] = seconds

    def lead(self, peer_id: str, size: int, groups: int = 1) -> None:
        """The next ``groups`` groups this peer is in are formed by it with ``size`` members, whatever the
        others expect (a hivemind leader with another target sends its group; followers accept it)."""
        self.leaders[peer_id] = (size, groups)

    def fail_late(self, peer_id: str, groups: int = 1) -> None:
        """In the next ``groups`` groups this peer is in, it fails (reads its answers too late) while the other
        members get the complete average: the shape of the "member disagreement" failure."""
        self.late[peer_id] = self.late.get(peer_id, 0) + groups

    def mix_shard(self, peer_id: str, shard: int, stranger: str = "stranger", groups: int = 1) -> None:
        """Sharded mode: in the next ``groups`` all-reduces this peer completes, its averager of ``shard`` was in
        another group than its other shards (as hivemind's matchmaking per shard allows): there, process
        ``stranger``-s``shard``, naming peer ``stranger``, took the place of one round-mate (the last by name).
        Only this peer's view changes; the values averaged are the group's."""
        self.mixed[peer_id] = (shard, stranger, groups)

    def _groups_of(self, peer_id: str) -> list[Group]:
        return [g for g in self.groups if peer_id in g.members and not g.ended.is_set()]

    # ------------------------------------------------------------------------------------------------ records
    def store(self, peer_id: str, record: dict, ttl: float) -> None:
        self.stored[peer_id] = (dict(record), self.clock.monotonic() + ttl)

    def read(self, reader: str) -> dict[str, tuple[dict, float]]:
        now = self.clock.monotonic()
        items = ((pid, self.stale_reads.get((reader, pid), item)) for pid, item in self.stored.items())
        return {pid: item for pid, item in items if item[1] > now and (reader, pid) not in self.hidden}

    def store_blob(self, owner: str, name: str, value: bytes, ttl: float) -> None:
        """As a DHT node does: the owner's previous value stays if it expires later than this one."""
        expiration = self.clock.monotonic() + ttl
        previous = self.blobs[name].get(owner)
        if previous is None or previous[1] < expiration:
            self.blobs[name][owner] = (bytes(value), expiration)

    def read_blobs(self, reader: str, name: str) -> dict[str, bytes]:
        now = self.clock.monotonic()
        return {pid: value for pid, (value, expiration) in self.blobs[name].items()
                if expiration > now and (reader, pid) not in self.hidden}


class FakeSwarm:
    """One peer's :class:`~p2p_diloco.swarm.port.SwarmPort` on a :class:`FakeNetwork`."""

    def __init__(self, net: FakeNetwork, peer_id: str, cfg: Config, provider: Callable[..., tuple],
                 shards: Sequence[int] | None):
        self.net, self.cfg, self.sc, self.provider, self.shards = net, cfg, cfg.swarm, provider, shards
        self.name = peer_id
        self.peer_id: str | None = None
        self.dead = False
        self.record: dict[str, Any] = {"fp": cfg.fingerprint(), "round": 0, "phase": Phase.JOIN.value,
                                       "client": cfg.swarm.client_mode}
        self.seen: dict[str, tuple[dict, float]] = {}
        self.kept: dict[str, tuple[bytes, float]] = {}  # keep_blob: name -> (value, time of its put)
        self.stopped = net.clock.event()
        self.last: Group | None = None
        self.last_layout: list[torch.Tensor] = []  # the request tensors of the last all-reduce (their shapes)
        self.keys = net.keys
        self.signer = net.keys.signer(peer_id)

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        # As hivemind's DHT bootstrap, which fails only if none of the initial peers answers. Initial peers that
        # never started are left out: peers added together are one launch, in which each reaches those already up.
        started = sorted(pid for pid in initial_peer_ids(self.sc.initial_peers) or () if pid in self.net.started
                         and pid != self.name)
        if started and not any(self.net.responds(pid) for pid in started):
            raise SwarmError(f"could not start or join the swarm: none of the initial peers responded "
                             f"({', '.join(started)})")
        # the real check's rule (config/adoption.py), on the records this peer can read of its own run
        run_id = self.cfg.run.run_id
        live = {pid: record for pid, (record, _) in self.net.read(self.name).items()
                if pid not in self.net.swarms or self.net.swarms[pid].cfg.run.run_id == run_id}
        check_against_peers(self.cfg, self.net.configs, live, me=self.name)
        self.peer_id = self.name
        self.net.started.add(self.name)
        self.net.configs[self.name] = published_settings(self.cfg)
        self.publish(phase=Phase.JOIN)
        self.net.sim.spawn(self._heartbeat, f"{self.name}:heartbeat")

    def _heartbeat(self) -> None:
        while not self.net.clock.wait(self.stopped, self.sc.heartbeat_period):
            self.publish()
            for name, (value, at) in list(self.kept.items()):
                if self.net.clock.monotonic() - at >= self.sc.peer_ttl * BLOB_LIFETIMES[name] / 2:
                    self.keep_blob(name, value)

    def shutdown(self) -> None:
        self.stopped.set()
        if self.peer_id is not None and not self.dead:
            self.publish(phase=Phase.LEFT, ttl=self.sc.heartbeat_period)

    def visible_maddrs(self) -> list[str]:
        return [f"/sim/{self.name}"]

    # ------------------------------------------------------------------------------------------------ records
    def update(self, **fields: Any) -> None:
        self._check_alive()
        self.record.update(wire_fields(fields))  # goes out with the next heartbeat

    def publish(self, ttl: float | None = None, **fields: Any) -> None:
        self._check_alive()
        self.record.update(wire_fields(fields))
        self.record["t"] = self.net.clock.time()
        self.net.store(self.name, self.record, ttl or self.sc.peer_ttl)

    def live_peers(self) -> dict[str, PeerRecord]:
        self._check_alive()
        now = self.net.clock.monotonic()
        for pid, (record, expiration) in self.net.read(self.name).items():
            known = self.seen.get(pid)
            if known is None or record.get("t", 0) >= known[0].get("t", 0):
                self.seen[pid] = (record, expiration)
        self.seen = {pid: item for pid, item in self.seen.items() if item[1] > now}
        return {pid: PeerRecord.from_wire(rec) for pid, (rec, _) in self.seen.items()
                if pid != self.name and rec.get("fp") == self.cfg.fingerprint() and rec.get("phase") != Phase.LEFT}

    def put_blob(self, name: str, value: bytes, ttl: float | None = None) -> None:
        self._check_alive()
        self.net.store_blob(self.name, name, value, check_blob(name, value, ttl, self.sc.peer_ttl))

    def keep_blob(self, name: str, value: bytes) -> None:
        self.put_blob(name, value)
        self.kept[name] = (value, self.net.clock.monotonic())

    def get_blobs(self, name: str) -> dict[str, bytes]:
        self._check_alive()
        if name not in BLOB_NAMES:
            raise ValueError(f"blob name must be one of {list(BLOB_NAMES)}, got {name!r}")
        return self.net.read_blobs(self.name, name)

    def probe(self, peer_ids: Collection[str], timeout: float) -> frozenset[str]:
        """As the real probe (swarm/probe.py), at once: a peer whose process is gone (killed, or shut down) is
        refused; a frozen one is not (its kernel still accepts), nor a live one, a client-mode one, one never
        started (nowhere to dial) or ourselves."""
        self._check_alive()
        check_probe(peer_ids, timeout)
        swarms = self.net.swarms
        return frozenset(pid for pid in peer_ids if pid != self.name and pid in swarms and swarms[pid].peer_id
                         and not swarms[pid].sc.client_mode and (swarms[pid].dead or swarms[pid].stopped.is_set()))

    # ---------------------------------------------------------------------------------------------- averaging
    def _check_alive(self) -> None:
        """A killed peer's task runs on until its next wait: whatever it does meanwhile must have no effect."""
        if self.dead:
            raise Killed

    def all_reduce(self, request: AllReduceRequest) -> AllReduceResult:
        self._check_alive()
        if request.weight <= 0:
            raise ValueError("all-reduce weight must be > 0")
        clock = self.net.clock
        hold = self.net.holds.pop((self.name, request.round), 0.0)
        until = clock.monotonic() + hold
        while clock.monotonic() < until and not request.should_stop():
            clock.sleep(min(self.net.poll, until - clock.monotonic()))
        mm = request.matchmaking_time or self.sc.matchmaking_time
        look = max(min(2 * mm, request.matchmaking_timeout or float("inf")), mm + 0.5)
        call = Call(self, request, clock.monotonic(), clock.event())
        matchmake(self.net, call)
        group = self._await(call, call.started + look)
        running = False
        while not group.ended.is_set():
            if request.should_stop():
                group.fail(f"member {self.name} stopped")
                raise RoundFailed("stopped")
            if not running and group.began.is_set():
                running = True
                request.on_running()
            clock.wait(group.ended if running else group.began, self.net.poll)
        if group.failure:
            raise RoundFailed(group.failure)
        if self.name in group.late:
            raise RoundFailed("TimeoutError: our answers came after the all-reduce timeout")
        if not running:
            request.on_running()
        self.last, self.last_layout = group, list(request.tensors)
        if request.commit:
            for t, avg in zip(request.tensors, group.result_like(request.tensors), strict=True):
                t.copy_(avg)
        return self._result(call, group)

    def _await(self, call: Call, deadline: float) -> Group:
        """Wait for a group to take ``call``, or fail at ``deadline``; a ``regroup`` follower whose leader expects
        another group gives up after the leader's ``REGROUP_REFUSALS`` refusals, as the real one does (only a
        refused call wakes at the leader's pace: a scale run's long poll stays)."""
        clock, refused_since = self.net.clock, None
        while call.group is None:
            now = clock.monotonic()
            led_other = followers_expect_other(call)  # (as a leader; as a follower:)
            refused = led_other or leader_expects_other(self.net, call)
            refused_since = (now if refused_since is None else refused_since) if refused else None
            mismatch = refused_since is not None and now - refused_since >= LEADER_RETRY * (REGROUP_REFUSALS - 1)
            if call.request.should_stop() or now >= deadline or mismatch:
                if call in self.net.looking:
                    self.net.looking.remove(call)
                if mismatch:
                    why = FOLLOWERS_MISMATCH if led_other else VIEW_MISMATCH
                    raise RoundFailed(f"ViewMismatch: {why}", regroup=True)
                raise RoundFailed("stopped" if call.request.should_stop() else "could not find a group")
            clock.wait(call.found, min(min(LEADER_RETRY, self.net.poll) if refused else self.net.poll, deadline - now))
        return call.group

    def _result(self, call: Call, group: Group) -> AllReduceResult:
        n = len(group.calls)
        payload = sum(t.numel() for t in call.request.tensors) * 4
        moved = int(2 * (n - 1) / n * payload)
        gathered = {c.swarm.name: dict(c.request.gather) for c in group.calls}
        now = self.net.clock.monotonic()
        return AllReduceResult(n, moved, moved, now - call.started, gathered, group.begin_time - call.started,
                               dict(group.excluded), self._shard_members(group), tuple(group.lost),
                               2 * payload // (n + 1) if group.lost else 0)

    def _shard_members(self, group: Group) -> dict[int, dict[str, Any]] | None:
        """Each of our shards' group: ``{member process: the peer it gathered}`` (``mix_shard`` applied)."""
        if self.shards is None:
            return None
        members = {j: {c.swarm.name: c.request.gather.get("peer") for c in group.calls} for j in self.shards}
        shard, stranger, left = self.net.mixed.pop(self.name, (None, "", 0))
        if shard in members and len(members[shard]) > 1:
            victim = max(pid for pid in members[shard] if pid != self.name)
            del members[shard][victim]
            members[shard][f"{stranger}-s{shard}"] = stranger
        if left > 1:
            self.net.mixed[self.name] = (shard, stranger, left - 1)
        return members

    @contextlib.contextmanager
    def averaged(self) -> Iterator[list[torch.Tensor]]:
        yield self.last.result_like(self.last_layout)

    def set_donor_round(self, round_: int) -> None:
        pass

    def download_state(self, peer_id: str, shard: int | None = None) -> tuple[dict, list[torch.Tensor]]:
        self._check_alive()
        return fake_transfer.download(self, peer_id, shard)
