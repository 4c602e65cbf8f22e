"""The real swarm: a :class:`~p2p_diloco.swarm.port.SwarmPort` over hivemind.

A :class:`Swarm` owns one ``hivemind.DHT`` and one :class:`~p2p_diloco.swarm.exact_averager.ExactAverager` for the
whole run, or one per logical shard with ``outer.sharding = "sharded"`` (averagers.py); creating and destroying
averagers on one DHT kills the DHT within a few cycles (field notes item 7). It offers the round protocol exactly
the operations it needs:

* publish this peer's live record (round, digest, phase, progress) every ``heartbeat_period`` seconds, with a
  ``peer_ttl`` expiration, so that every peer can see who is live, in which round, and with which digest
  (records are signed with the peer's identity key, which is also its libp2p identity: see identity.py; every
  DHT node refuses a record that breaks its schema: see schema.py);
* check that peers already in the run use the same fingerprinted and shared settings (config/sharing.py), and
  publish ours for joiners to adopt (config/adoption.py);
* store and read small signed blobs per peer (``put_blob`` / ``get_blobs``: the round certificate exchange), with
  the same ownership checks and a size and lifetime bound that every DHT node enforces (schema.py);
* all-reduce a list of tensors with exactly ``group_size`` peers of the same round, all-or-nothing;
* download (round, theta, momentum) from a given live peer (the round protocol picks it: consensus.py); a
  client-mode peer cannot be dialed, so it is asked to push its state instead (state_push.py), and a client-mode
  peer pushes its state to the peers that ask it;
* in a private run (``swarm.allowed_peers``), ignore every peer outside the list (allowlist.py).

No coordinator: every decision is taken locally from the DHT records, the same way on every peer.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
import threading
import time
from typing import Any, Callable, Collection, Iterator, Sequence

import hivemind
import torch
from hivemind.utils import get_dht_time

from ..config import Config
from ..config.adoption import check_against_peers
from ..config.sharing import published_settings
from ..errors import SwarmError
from .allowlist import resolve_allowed_peers
from ..protocol.records import Phase, PeerRecord, wire_fields
from .averagers import Averagers
from .state_push import Pusher
from .starting import dht_rpc_timeout, fix_command_pipe, start_dht, start_failure
from .port import BLOB_LIFETIMES, BLOB_NAMES, AllReduceRequest, AllReduceResult, check_blob, check_probe
from .probe import MAX_ADDRS, Prober
from .identity import Identity, RSAKeyBook, records_by_owner
from .schema import (HEARTBEAT_WINDOW, LIFETIMES, check_config_record, normalize_record, record_lifetime,
                     record_validators)
from ..runtime.processes import descendants, keep_freed_memory, reap_children

log = logging.getLogger(__name__)
DHT_CALL_TIMEOUT = 15.0
# Seconds each step of a shutdown may take (Swarm.shutdown): together the most a stop waits for our processes.
SHUTDOWN_STEPS = {"heartbeat": 1.0, "leave": 2.0, "averagers": 3.0, "dht": 2.0, "reap": 2.0}
INTRODUCE_TIMEOUT = 1.0  # seconds matchmaking waits for our p2pd to connect to round-mates it is not connected to


class Swarm:
    """One peer's connection to the run's swarm.

    Args:
        cfg: the run config (``[swarm]`` section, run id and fingerprint are used here).
        tensors_like: tensors shaped like the pseudo-gradient (fp32, CPU); copied for the averager's buffers. With
            ``shards``: one tensor per shard, in the order of ``shards``.
        state_provider: returns ``(metadata, tensors)`` for peers that download our state (called from a
            background thread of this process, so it must take its own lock). With ``shards``: called with j.
        shards: ``outer.sharding = "sharded"``: the logical shards this process keeps, one averager each.
        rank_of: a follower rank of a torchrun peer (sharded mode): the addresses of its rank 0's DHT. Such a
            swarm only runs a DHT node and the shard averagers: no records, no config check (rank 0 does those).
        state_like: tensors shaped like theta when the averaged buffer is not (``outer.fragments``: one flat
            buffer as long as the largest fragment); a donation is theta and the momentum in these shapes.
    """

    def __init__(self, cfg: Config, tensors_like: Sequence[torch.Tensor], state_provider: Callable[..., tuple],
                 shards: Sequence[int] | None = None, rank_of: Sequence[str] | None = None,
                 state_like: Sequence[torch.Tensor] | None = None):
        self.cfg, self.sc = cfg, cfg.swarm
        self.run_id, self.fingerprint = cfg.run.run_id, cfg.fingerprint()
        if shards is None:
            self._groups, self._providers = {"": list(tensors_like)}, {"": state_provider}
        else:
            self._groups = {f"s{j}": [t] for j, t in zip(shards, tensors_like, strict=True)}
            self._providers = {f"s{j}": (lambda j=j: state_provider(j)) for j in shards}
        self.shards = list(shards) if shards is not None else None
        self._state_like = {"": list(state_like)} if state_like is not None else {}
        self.rank_of = list(rank_of) if rank_of is not None else None
        self._dht_lock = threading.Lock()  # hivemind's DHT pipe is not safe for concurrent callers
        self._record: dict[str, Any] = {"fp": self.fingerprint, "round": 0, "phase": Phase.JOIN.value,
                                        "client": self.sc.client_mode}
        self._record_lock = threading.Lock()
        self._expiration = 0.0  # of the last version of our live record we stored
        self._beats: deque[float] = deque(maxlen=HEARTBEAT_WINDOW)  # seconds between our last heartbeats' stores
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.dht: hivemind.DHT | None = None
        self.peer_id: str | None = None  # ours, once started
        self.identity: Identity | None = None
        self._seen: dict[str, tuple[dict, float]] = {}  # live records read so far, with their DHT expiration
        self._kept: dict[str, tuple[bytes, float]] = {}  # keep_blob: name -> (value, time.monotonic() of its put)
        self.averagers: Averagers | None = None
        self._pusher: Pusher | None = None  # client mode: hands our state to the peers that ask (state_push.py)
        self._prober: Prober | None = None  # probe(): direct dials of peers (probe.py)
        self._owned: set[int] | None = None  # our processes (None until started: then every child is ours)
        self.allowed = resolve_allowed_peers(self.sc.allowed_peers)  # None: an open swarm (allowlist.py)

    keys = RSAKeyBook()  # checks round certificates' signatures against peer ids

    @property
    def signer(self) -> Identity | None:
        """Our identity: signs round certificates (None until started)."""
        return self.identity

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the DHT (joining ``swarm.initial_peers``), refuse a mismatched config, start the averager(s)."""
        # Children forked from here (DHT, averager) ignore SIGINT and p2pd is out of the terminal's reach, so Ctrl-C
        # reaches only the main process, which then shuts them down in order (see shutdown()); this process ignores
        # it only during the forks themselves (starting.py): a stop signal during the start raises here.
        keep_freed_memory()  # before the forks: the averager's data plane gains most (see processes.py)
        before = descendants()
        follower = self.rank_of is not None
        self.identity = Identity(None if follower else (self.sc.identity_path or None))
        initial = (self.rank_of if follower else self.sc.initial_peers) or []
        wait = 0.0 if follower else self.sc.initial_peers_wait  # a follower's rank 0 is up: it sent its address
        try:
            self.dht = start_dht(
                wait, initial_peers=initial or None,
                host_maddrs=self.sc.host_maddrs, announce_maddrs=self.sc.announce_maddrs or None,
                startup_timeout=self.sc.startup_timeout, identity_path=self.identity.path,
                wait_timeout=dht_rpc_timeout(self.sc.peer_ttl),
                check_if_identity_free=not self.identity.fresh, client_mode=self.sc.client_mode,
                use_relay=self.sc.use_relay, use_auto_relay=self.sc.use_auto_relay,
                record_validators=record_validators(self.identity, self.run_id, self.sc.peer_ttl),
            )
        except Exception as e:  # hivemind raises P2PDaemonError / RuntimeError with long texts
            raise SwarmError(start_failure(e, initial, "could not start or join the swarm", wait)) from None
        finally:
            self.identity.close()  # p2pd has read it
        self.peer_id = self.dht.peer_id.to_base58()
        try:
            fix_command_pipe(self.dht, DHT_CALL_TIMEOUT)
            if self.peer_id != self.identity.peer_id:  # our records are signed with the identity p2pd must use
                raise SwarmError(f"p2pd runs as {self.peer_id}, not as our identity {self.identity.peer_id}")
            if not follower:
                self.check_config()
            if self.allowed is not None and self.peer_id not in self.allowed:
                raise SwarmError(f"this peer ({self.peer_id}) is not in swarm.allowed_peers: the others would "
                                 f"refuse it (fix the list, or give --identity-path with a listed key)")
            self.averagers = Averagers(self.cfg, self.dht, self._groups, self._providers, self.visible_maddrs,
                                       self.allowed, self.identity, self._state_like)
            self._owned = descendants() - before  # DHT, averager(s), p2pd: what shutdown() stops
            # after the forks: a fork copies no thread, but it could copy a lock the probe thread holds
            self._prober = Prober(self.dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr,
                                                         return_future=True).result(timeout=DHT_CALL_TIMEOUT))
            if not follower:
                self._publish_config()
                self.publish(phase=Phase.JOIN, maddrs=tuple(self.visible_maddrs()[:MAX_ADDRS]))
        except BaseException:
            self.shutdown()  # a half-started peer must not leave its DHT/p2pd processes behind
            raise
        if not follower and self.sc.client_mode:
            self._pusher = Pusher(self.peer_id, self.averagers.push, self.sc.state_timeout)
        if not follower:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
            self._heartbeat.start()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def shutdown(self) -> None:
        """Leave the DHT and stop every process of ours (averager, DHT, p2pd), whatever state they are in, in at most
        about ``sum(SHUTDOWN_STEPS.values())`` seconds: a frozen or starved DHT or averager process must not hold up
        a stop (with each step waiting its own timeout, a peer whose two processes were frozen took 43.5 s from
        SIGTERM to exit)."""
        self._stop.set()
        if self._prober is not None:
            self._prober.close()
        if self._heartbeat is not None:  # a daemon thread: a DHT call it has in flight need not end first
            self._heartbeat.join(timeout=SHUTDOWN_STEPS["heartbeat"])
        try:
            if (self.dht is not None and self.dht.is_alive() and self.averagers is not None
                    and self.rank_of is None):
                self.publish(phase=Phase.LEFT, ttl=self.sc.heartbeat_period, timeout=SHUTDOWN_STEPS["leave"])
        except Exception as e:  # leaving is best effort; the record also expires by itself
            log.debug("could not publish leave record: %r", e)
        if self.averagers is not None:  # first: they use the DHT
            self.averagers.shutdown(SHUTDOWN_STEPS["averagers"])
        try:
            if self.dht is not None and self.dht.is_alive():
                self.dht.shutdown_timeout = SHUTDOWN_STEPS["dht"]  # then hivemind terminates it
                self.dht.shutdown()
        except Exception as e:
            log.debug("DHT shutdown failed: %r", e)
        reap_children(timeout=SHUTDOWN_STEPS["reap"], only=self._owned)

    # ------------------------------------------------------------------------------------------------- records
    def _dht_call(self, method: str, *args, timeout: float | None = None, **kwargs):
        """One DHT get/store, serialised and bounded (a DHT whose process died would block forever). With
        ``timeout`` (the leave record), the wait for another caller's turn is bounded too: a heartbeat stuck in a
        call to a frozen DHT holds the lock for ``DHT_CALL_TIMEOUT``."""
        if timeout is None:
            with self._dht_lock:  # a with block: a stop signal raised right after the acquire cannot leak the lock
                return getattr(self.dht, method)(*args, return_future=True, **kwargs).result(DHT_CALL_TIMEOUT)
        if not self._dht_lock.acquire(timeout=timeout):
            raise TimeoutError(f"DHT {method}: another call still holds the DHT after {timeout:.1f}s")
        try:
            return getattr(self.dht, method)(*args, return_future=True, **kwargs).result(timeout)
        finally:
            self._dht_lock.release()

    def update(self, **fields: Any) -> None:
        """Change fields of our live record; they go out with the next heartbeat."""
        with self._record_lock:
            self._record.update(wire_fields(fields))

    def publish(self, ttl: float | None = None, timeout: float | None = None, **fields: Any) -> None:
        """Change fields of our live record and store it now (round boundaries must be visible at once).

        A DHT node keeps, per owner, the version that expires *last*: a shorter ``ttl`` (the ``left`` record) is
        stored as expiring just after the previous version, or it would be dropped and we would look alive.
        ``timeout``: seconds for the store, the wait for the DHT's lock included (``DHT_CALL_TIMEOUT`` if None)."""
        with self._record_lock:
            self._record.update(wire_fields(fields))
            record = normalize_record(dict(self._record, t=time.time()))  # SwarmError: a bug of ours
            life = ttl or record_lifetime(self.sc.peer_ttl, self._beats)  # longer if our heartbeats are late
            expiration = max(get_dht_time() + life, self._expiration + 1e-3)
            self._expiration = expiration
        self._dht_call("store", f"{self.run_id}.live", record, expiration, subkey=self.identity.subkey(),
                       timeout=timeout)

    def _publish_config(self) -> None:
        expiration = get_dht_time() + LIFETIMES["config"] * self.sc.peer_ttl
        # the run's config as others adopt it (config/sharing.py), not only the fingerprint's settings
        fields = check_config_record(published_settings(self.cfg))  # SwarmError: a bug of ours
        self._dht_call("store", f"{self.run_id}.config", fields, expiration, subkey=self.identity.subkey())

    def put_blob(self, name: str, value: bytes, ttl: float | None = None) -> None:
        """Store ``value`` under ``{run_id}.{name}`` in our name, signed, expiring ``ttl`` from now (``check_blob``:
        the names, sizes and lifetimes allowed; anything else raises ``ValueError``: the DHT would refuse it).

        hivemind keeps, per owner, the value with the latest expiration: a put replaces our previous value only if it
        expires later (with a constant ttl, every later put does)."""
        ttl = check_blob(name, value, ttl, self.sc.peer_ttl)
        self._dht_call("store", f"{self.run_id}.{name}", value, get_dht_time() + ttl, subkey=self.identity.subkey())

    def keep_blob(self, name: str, value: bytes) -> None:
        """:meth:`put_blob` now, and again from the heartbeat every half of its lifetime until we leave."""
        self.put_blob(name, value)
        with self._record_lock:
            self._kept[name] = (value, time.monotonic())

    def _refresh_kept(self) -> None:
        half = {name: self.sc.peer_ttl * lifetime / 2 for name, lifetime in BLOB_LIFETIMES.items()}
        with self._record_lock:
            due = {n: v for n, (v, t) in self._kept.items() if time.monotonic() - t >= half[n]}
        for name, value in due.items():
            self.put_blob(name, value)
            with self._record_lock:
                if self._kept.get(name, (None,))[0] is value:
                    self._kept[name] = (value, time.monotonic())

    def probe(self, peer_ids: Collection[str], timeout: float) -> frozenset[str]:
        """SwarmPort.probe (the rule: probe.py); never dials us, nor a peer whose last record says client mode."""
        check_probe(peer_ids, timeout)
        if self._prober is None:
            return frozenset()
        announced = self._dialable(peer_ids)
        return self._prober.probe(list(announced), timeout, announced)

    def _dialable(self, peer_ids: Collection[str]) -> dict[str, Sequence[str]]:
        """``{peer id: the multiaddrs its last record announces}`` for the peers of ``peer_ids`` we may dial: not
        us, nor a peer whose last record says client mode (it accepts no connection)."""
        records = {pid: (self._seen.get(pid) or ({},))[0] for pid in peer_ids if pid != self.peer_id}
        return {pid: r.get("maddrs") or () for pid, r in records.items() if r.get("client") is not True}

    def get_blobs(self, name: str) -> dict[str, bytes]:
        """``{peer_id: value}``: every owner's unexpired value under ``{run_id}.{name}`` (ours included), only signed
        ones whose key belongs to the peer id they name, and only allowed peers in a private run."""
        if name not in BLOB_NAMES:
            raise ValueError(f"blob name must be one of {list(BLOB_NAMES)}, got {name!r}")
        found = records_by_owner(self._dht_call("get", f"{self.run_id}.{name}", latest=True))
        return {owner: item.value for owner, item in found.items()
                if isinstance(item.value, bytes) and (self.allowed is None or owner in self.allowed)}

    def _heartbeat_loop(self) -> None:
        beats, last, late = 0, time.monotonic(), False
        while not self._stop.wait(self.sc.heartbeat_period):
            try:
                self.publish()
                with self._record_lock:  # (publish reads them) a failed heartbeat lengthens the next interval
                    self._beats.append(time.monotonic() - last)
                    last, life = last + self._beats[-1], record_lifetime(self.sc.peer_ttl, self._beats)
                if (life > self.sc.peer_ttl) != late:  # said once each way
                    late = life > self.sc.peer_ttl
                    log.info("heartbeats %.1f s apart at most: our record lives %.1f s", max(self._beats), life)
                self._refresh_kept()
                if self._pusher is not None:  # a client-mode peer: push our state to the peers that ask us
                    with self._record_lock:
                        ours = dict(self._record)
                    self._pusher.poll(self._read_dict(f"{self.run_id}.live"), ours)
                beats += 1
                if beats % 10 == 0:
                    self._publish_config()
            except Exception as e:  # a missed heartbeat only makes us look dead for a while
                log.warning("heartbeat failed: %r", e)

    def _read_dict(self, key: str, with_expiration: bool = False) -> dict[str, Any]:
        """``{peer_id: record}`` of a shared key: only signed records whose key belongs to the peer id they name
        (see identity.py); anything else (forged, unsigned, not a dict) is ignored."""
        found = records_by_owner(self._dht_call("get", key, latest=True))
        return {owner: (item.value, item.expiration_time) if with_expiration else item.value
                for owner, item in found.items()
                if isinstance(item.value, dict) and (self.allowed is None or owner in self.allowed)}

    def live_peers(self) -> dict[str, PeerRecord]:
        """Every other live peer of this run and config: ``{peer_id: record}``.

        A DHT read can miss some records (seen when a frozen peer's DHT node held part of the key: two survivors
        saw each other but not the third, and averaged as a pair). So records are merged with the ones read
        before, each kept until its own expiration; a newer version of a record always replaces an older one.
        """
        now = get_dht_time()
        for pid, (record, expiration) in self._read_dict(f"{self.run_id}.live", with_expiration=True).items():
            known = self._seen.get(pid)
            # versions of one peer's record are ordered by its own publish time ("left" has a short expiration)
            if known is None or record.get("t", 0) >= known[0].get("t", 0):
                self._seen[pid] = (record, expiration)
        self._seen = {pid: item for pid, item in self._seen.items() if item[1] > now}
        return {pid: PeerRecord.from_wire(rec) for pid, (rec, _) in self._seen.items()
                if pid != self.peer_id and rec.get("fp") == self.fingerprint and rec.get("phase") != Phase.LEFT}

    def check_config(self) -> None:
        """Raise :class:`ConfigMismatch` naming the differences if a live peer of this run id publishes another
        config: a fingerprinted or shared setting (config/sharing.py) that differs from ours. Only the records
        config/adoption.py's trust rule accepts count (the same rule a joiner adopts by)."""
        check_against_peers(self.cfg, self._read_dict(f"{self.run_id}.config"),
                            self._read_dict(f"{self.run_id}.live"), self.allowed, me=self.peer_id)

    # ---------------------------------------------------------------------------------------------- averaging
    def all_reduce(self, request: AllReduceRequest) -> AllReduceResult:
        """One all-or-nothing all-reduce attempt (:class:`~p2p_diloco.swarm.port.AllReduceRequest`), in place.

        On success every member holds bit-identical averages. On any failure raises :class:`RoundFailed` and
        leaves the tensors untouched, so the caller cannot apply a partial result by mistake. A stop request
        cancels the step (the others see our part go missing and redo the round without us). With ``shards``,
        ``request.tensors`` holds one tensor per shard, each averaged in its own shard's group, all at once; any
        shard failing fails the whole call.
        """
        if request.weight <= 0:
            raise ValueError("all-reduce weight must be > 0")  # all-zero weights give NaN everywhere
        matchmaking_time = request.matchmaking_time or self.sc.matchmaking_time
        allreduce_timeout = request.allreduce_timeout or self.sc.allreduce_timeout
        # hivemind needs the step's timeout to exceed the matchmaking window (it schedules the start after it)
        look = max(min(2 * matchmaking_time, request.matchmaking_timeout or float("inf")), matchmaking_time + 0.5)
        groups = self._split(request.tensors)
        self._introduce(request.members)
        result = self.averagers.all_reduce(request.round, groups, request.weight, request.group_size,
                                           request.gather, request.should_stop, request.on_running,
                                           matchmaking_time, allreduce_timeout, look, shards=self.shards,
                                           leader=request.leader, regroup=request.regroup)
        if request.commit:
            with self.averagers.averaged() as averages:
                for mine, average in zip(groups, averages, strict=True):
                    for t, avg in zip(mine, average, strict=True):
                        t.copy_(avg)
        return result

    def _introduce(self, members: Collection[str]) -> int:
        """Connect our p2pd to the expected round-mates it is not connected to, at the addresses of their signed
        records, so that matchmaking can reach them (probe.py: introductions); at most INTRODUCE_TIMEOUT seconds.
        A client-mode peer cannot be dialled: it dials us. Returns the number of peers newly connected."""
        announced = self._dialable(members)
        if not announced or self._prober is None:
            return 0
        return self._prober.introduce(announced, INTRODUCE_TIMEOUT)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[list[torch.Tensor]]:
        """The last successful :meth:`all_reduce` (made with ``commit=False``), in place (SwarmPort.averaged)."""
        with self.averagers.averaged() as averages:
            yield [t for group in averages for t in group]

    def _split(self, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        return [[t] for t in tensors] if self.shards is not None else [list(tensors)]

    def set_donor_round(self, round_: int) -> None:
        """Peers downloading state prefer the donor in the highest round (a client-mode peer serves no state)."""
        if not self.sc.client_mode:
            self.averagers.set_priority(float(round_))

    def download_state(self, peer_id: str, shard: int | None = None) -> tuple[dict, list[torch.Tensor]]:
        """Download ``(metadata, tensors)`` from the given live peer (with ``shard``: that shard's state, from the
        process of that peer that keeps it); raises :class:`RoundFailed` on any failure (the donor died or froze
        mid-transfer, refused, or sent nothing) within ``swarm.state_timeout``. A client-mode peer is asked to push
        its state instead (:meth:`Averagers.receive_push`)."""
        known = self._seen.get(peer_id)
        if known is not None and known[0].get("client") is True:  # it cannot be dialed: it pushes (state_push.py)
            ask = lambda wants, peer: self.publish(wants=wants, ask=peer)  # noqa: E731
            return self.averagers.receive_push(peer_id, int(known[0].get("round", 0)), self.sc.state_timeout, ask)
        index = 0 if shard is None else self.shards.index(shard)
        return self.averagers.download(index, peer_id, self.sc.state_timeout)
