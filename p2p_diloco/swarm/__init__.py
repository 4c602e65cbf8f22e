"""The swarm boundary: the only part of p2p-diloco that imports hivemind.

A :class:`Swarm` owns one ``hivemind.DHT`` and one :class:`~p2p_diloco.swarm.averager.ExactAverager` for the
whole run (creating and destroying averagers on one DHT kills the DHT within a few cycles, field notes item 7).
It offers the round protocol exactly the operations it needs:

* publish this peer's live record (round, digest, phase, progress) every ``heartbeat_period`` seconds, with a
  ``peer_ttl`` expiration, so that every peer can see who is live, in which round, and with which digest
  (records are signed with the peer's identity key, which is also its libp2p identity: see identity.py);
* check that peers already in the run use the same model/tokenizer/outer config;
* all-reduce a list of tensors with exactly ``group_size`` peers of the same round, all-or-nothing;
* download (round, theta, momentum) from the live peer in the highest round.

No coordinator: every decision is taken locally from the DHT records, the same way on every peer.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from ..config import Config
from ..errors import ConfigMismatch, RoundFailed, SwarmError
from .averager import ExactAverager
from .compression import compression_for
from .identity import Identity, OwnedRecordsValidator, records_by_owner
from .fastpath import listen_socket
from ..codecs import get_codec
from ..processes import descendants, keep_freed_memory, reap_children

log = logging.getLogger(__name__)
DHT_CALL_TIMEOUT = 15.0


@dataclass
class AllReduceResult:
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    gathered: dict[str, Any]
    assembly_seconds: float = 0.0  # of ``seconds``: matchmaking, until the group was assembled


def _one_line(e: BaseException) -> str:
    """A short single-line reason from hivemind's (often multi-line, timestamped) exception texts."""
    text = " ".join(str(e).split()) or type(e).__name__
    return re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", text)[:300]


def _ip4_of(maddrs: Sequence[str]) -> str | None:
    for m in maddrs:
        parts = str(m).split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return None


def _round_bits(round_: int) -> str:
    """The round number as hivemind group bits: peers in different rounds use different matchmaking keys."""
    return format(round_ % (1 << 24), "024b")


class Swarm:
    """One peer's connection to the run's swarm.

    Args:
        cfg: the run config (``[swarm]`` section, run id and fingerprint are used here).
        tensors_like: tensors shaped like the pseudo-gradient (fp32, CPU); copied for the averager's buffers.
        state_provider: returns ``(metadata, tensors)`` for peers that download our state (called from a
            background thread of this process, so it must take its own lock).
    """

    def __init__(self, cfg: Config, tensors_like: Sequence[torch.Tensor],
                 state_provider: Callable[[], tuple[dict, list[torch.Tensor]]]):
        self.cfg, self.sc = cfg, cfg.swarm
        self.run_id, self.fingerprint = cfg.run.run_id, cfg.fingerprint()
        self._buffers = [torch.zeros_like(t, dtype=torch.float32, device="cpu") for t in tensors_like]
        self._state_provider = state_provider
        self._dht_lock = threading.Lock()  # hivemind's DHT pipe is not safe for concurrent callers
        self._record: dict[str, Any] = {"fp": self.fingerprint, "round": 0, "phase": "join",
                                        "client": self.sc.client_mode}
        self._record_lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.dht: hivemind.DHT | None = None
        self.data_address: str | None = None
        self._p2p_only_round = -1
        self._seen: dict[str, tuple[dict, float]] = {}  # live records read so far, with their DHT expiration
        self.averager: ExactAverager | None = None
        self._owned: set[int] | None = None  # our processes (None until started: then every child is ours)

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the DHT (joining ``swarm.initial_peers``), refuse a mismatched config, start the averager."""
        # Children forked from here (DHT, averager) and the p2pd they exec ignore SIGINT, so Ctrl-C in a terminal
        # reaches only the main process, which then shuts them down in order (see shutdown()).
        keep_freed_memory()  # before the forks: the averager's data plane gains most (see processes.py)
        before = descendants()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.identity = Identity(self.sc.identity_path or None)
        try:
            self.dht = hivemind.DHT(
                initial_peers=self.sc.initial_peers or None, start=True, host_maddrs=self.sc.host_maddrs,
                announce_maddrs=self.sc.announce_maddrs or None, startup_timeout=self.sc.startup_timeout,
                await_ready=True, identity_path=self.identity.path, check_if_identity_free=not self.identity.fresh,
                client_mode=self.sc.client_mode, use_relay=self.sc.use_relay, use_auto_relay=self.sc.use_auto_relay,
                record_validators=[self.identity.validator,
                                   OwnedRecordsValidator([f"{self.run_id}.live", f"{self.run_id}.config"])],
            )
        except Exception as e:  # hivemind raises P2PDaemonError / RuntimeError with long texts
            reap_children(timeout=5.0)
            raise SwarmError(f"could not start or join the swarm: {_one_line(e)}") from None
        finally:
            signal.signal(signal.SIGINT, previous)
            self.identity.close()  # p2pd has read it
        self.peer_id = self.dht.peer_id.to_base58()
        try:
            if self.peer_id != self.identity.peer_id:  # our records are signed with the identity p2pd must use
                raise SwarmError(f"p2pd runs as {self.peer_id}, not as our identity {self.identity.peer_id}")
            self.check_config()
            self._start_averager()
            self._owned = descendants() - before  # DHT, averager, p2pd: what shutdown() stops
            self._publish_config()
            self.publish(phase="join")
        except BaseException:
            self.shutdown()  # a half-started peer must not leave its DHT/p2pd processes behind
            raise
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._heartbeat.start()

    def _start_averager(self) -> None:
        compression = compression_for(self.cfg.outer.compression)
        self.averager = ExactAverager(
            self._buffers, self.dht, start=False, prefix=f"{self.run_id}_{self.fingerprint}",
            target_group_size=2, min_group_size=2, min_matchmaking_time=self.sc.matchmaking_time,
            request_timeout=self.sc.request_timeout, allreduce_timeout=self.sc.allreduce_timeout,
            next_chunk_timeout=self.sc.next_chunk_timeout, part_size_bytes=self.sc.part_size_bytes,
            compression=compression, declare_state_period=max(5.0, self.sc.peer_ttl), shutdown_timeout=5,
            client_mode=self.sc.client_mode,
        )
        self.averager.state_provider = self._state_provider
        self.averager.part_delay = self.cfg.debug.part_delay  # copied into the averager process when it forks
        self.averager.state_delay = self.cfg.debug.state_delay
        self.averager.codec = get_codec(self.cfg.outer.compression)
        self.data_address = None
        if self.sc.transport == "tcp" and not self.sc.client_mode:  # a client cannot accept data connections:
            self.averager.data_socket, self.data_address = self._open_data_plane()  # its groups use libp2p
        self.averager.run_in_background(await_ready=True, timeout=self.sc.startup_timeout)

    def _open_data_plane(self):
        """Listen for direct-TCP all-reduce traffic (see fastpath.py) on the host of our first /ip4 listen address;
        advertise the announced host if one is given (behind NAT / port forwarding), else the listen host."""
        bind = _ip4_of(self.sc.host_maddrs) or "127.0.0.1"
        sock = listen_socket(bind, self.sc.data_port)
        host = _ip4_of(self.sc.announce_maddrs) or (bind if bind != "0.0.0.0" else _ip4_of(self.visible_maddrs()))
        if not host or host == "0.0.0.0":
            sock.close()
            raise SwarmError("swarm.transport = 'tcp' needs a reachable address: give --announce-maddrs")
        return sock, f"{host}:{sock.getsockname()[1]}"

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def shutdown(self) -> None:
        """Leave the DHT and stop every process of ours (averager, DHT, p2pd), whatever state they are in."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.sc.heartbeat_period + 5)
        try:
            if self.dht is not None and self.dht.is_alive() and self.averager is not None:
                self.publish(phase="left", ttl=self.sc.heartbeat_period)
        except Exception as e:  # leaving is best effort; the record also expires by itself
            log.debug("could not publish leave record: %r", e)
        for part in (self.averager, self.dht):  # averager first: it uses the DHT
            try:
                if part is not None and part.is_alive():
                    part.shutdown()
            except Exception as e:
                log.debug("shutdown of %s failed: %r", type(part).__name__, e)
        if self.averager is not None and self.averager.data_socket is not None:
            self.averager.data_socket.close()  # our copy; the averager process had its own
        reap_children(timeout=5.0, only=self._owned)

    # ------------------------------------------------------------------------------------------------- records
    def _dht_call(self, method: str, *args, **kwargs):
        """One DHT get/store, serialised and bounded (a DHT whose process died would block forever)."""
        with self._dht_lock:
            future = getattr(self.dht, method)(*args, return_future=True, **kwargs)
            return future.result(timeout=DHT_CALL_TIMEOUT)

    def update(self, **fields: Any) -> None:
        """Change fields of our live record; they go out with the next heartbeat."""
        with self._record_lock:
            self._record.update(fields)

    def publish(self, ttl: float | None = None, **fields: Any) -> None:
        """Change fields of our live record and store it now (round boundaries must be visible at once)."""
        with self._record_lock:
            self._record.update(fields)
            record = dict(self._record, t=time.time())
        expiration = get_dht_time() + (ttl or self.sc.peer_ttl)
        self._dht_call("store", f"{self.run_id}.live", record, expiration, subkey=self.identity.subkey())

    def _publish_config(self) -> None:
        expiration = get_dht_time() + 5 * self.sc.peer_ttl
        self._dht_call("store", f"{self.run_id}.config", self.cfg.fingerprint_fields(), expiration,
                       subkey=self.identity.subkey())

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self._stop.wait(self.sc.heartbeat_period):
            try:
                self.publish()
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
                for owner, item in found.items() if isinstance(item.value, dict)}

    def live_peers(self) -> dict[str, dict[str, Any]]:
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
        records = {pid: record for pid, (record, _) in self._seen.items()}
        return {
            pid: rec for pid, rec in records.items()
            if pid != self.peer_id and rec.get("fp") == self.fingerprint and rec.get("phase") != "left"
        }

    def check_config(self) -> None:
        """Raise :class:`ConfigMismatch` naming the differences if a live peer of this run id uses another config."""
        live = self._read_dict(f"{self.run_id}.live")
        ours = self.cfg.fingerprint_fields()
        for pid, theirs in self._read_dict(f"{self.run_id}.config").items():
            if pid == self.peer_id or pid not in live or live[pid].get("phase") == "left":
                continue
            diffs = [f"{k}: ours {ours.get(k)!r}, theirs {theirs.get(k)!r}"
                     for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
            if diffs:
                raise ConfigMismatch(
                    f"run {self.run_id!r} already has peer {pid} with a different config ({'; '.join(diffs)}); "
                    f"use the same config or another --run-id"
                )

    # ---------------------------------------------------------------------------------------------- averaging
    def all_reduce(self, round_: int, tensors: Sequence[torch.Tensor], weight: float, group_size: int,
                   gather: dict[str, Any], should_stop: Callable[[], bool] = lambda: False,
                   on_running: Callable[[], None] = lambda: None, matchmaking_time: float | None = None,
                   allreduce_timeout: float | None = None, matchmaking_timeout: float | None = None
                   ) -> AllReduceResult:
        """Average ``tensors`` (weighted) with exactly ``group_size`` peers of round ``round_``, in place.

        On success every member holds bit-identical averages. On any failure raises :class:`RoundFailed` and
        leaves ``tensors`` untouched, so the caller cannot apply a partial result by mistake. ``should_stop`` is
        polled: a stop request cancels the step (the others see our part go missing and redo the round without
        us). ``on_running`` is called once the group is assembled and the tensors start to flow.
        ``matchmaking_time`` and ``allreduce_timeout`` override the ``[swarm]`` constants for this attempt
        (adaptive deadlines, see deadlines.py); ``matchmaking_timeout`` ends the search for a group sooner than
        the usual ``2 * matchmaking_time``.
        """
        if weight <= 0:
            raise ValueError("all-reduce weight must be > 0")  # all-zero weights give NaN everywhere
        matchmaking_time = matchmaking_time or self.sc.matchmaking_time
        allreduce_timeout = allreduce_timeout or self.sc.allreduce_timeout
        self.averager.set_round_params(_round_bits(round_), group_size, timeout=30,
                                       matchmaking_time=matchmaking_time, allreduce_timeout=allreduce_timeout)
        with self.averager.get_tensors() as buffers:
            for buf, t in zip(buffers, tensors, strict=True):
                buf.copy_(t)
        # hivemind needs the step's timeout to exceed the matchmaking window (it schedules the start after it)
        look = max(min(2 * matchmaking_time, matchmaking_timeout or float("inf")), matchmaking_time + 0.5)
        t0 = time.monotonic()
        assembled = [0.0]

        def running() -> None:
            assembled[0] = time.monotonic() - t0
            on_running()

        if self.data_address and self._p2p_only_round != round_:
            gather = dict(gather, data=self.data_address)
        control = self.averager.step(gather=gather, weight=float(weight), timeout=look, allow_retries=False,
                                     wait=False)
        try:
            result = self._wait_step(control, t0 + look + allreduce_timeout + 10, should_stop, running)
        except BaseException as e:
            if not control.done():
                control.cancel()
            if isinstance(e, KeyboardInterrupt):
                raise
            self._wait_step_finished(control, timeout=look + allreduce_timeout)
            if "cannot connect to member" in str(e) and self._p2p_only_round != round_:
                # A member's data port is unreachable (NAT, firewall): the rest of this round goes through libp2p.
                # One member without a data address is enough for the whole group to choose libp2p.
                log.warning("direct TCP all-reduce failed (%s); using libp2p streams for this round", _one_line(e))
                self._p2p_only_round = round_
            raise RoundFailed(_one_line(e)) from None
        if not result:
            raise RoundFailed("could not find a group")
        with self.averager.get_tensors() as buffers:
            for buf, t in zip(buffers, tensors):
                t.copy_(buf)
        gathered = {pid.to_base58(): data for pid, data in result["gathered"].items()}
        return AllReduceResult(result["group_size"], result.get("bytes_sent", 0), result.get("bytes_received", 0),
                               time.monotonic() - t0, gathered, assembled[0])

    @staticmethod
    def _wait_step_finished(control, timeout: float) -> None:
        """Wait until the averager process is really done with a cancelled or failed step.

        Cancelling only flags the step; the averager notices between its own awaits. Until then the step's
        matchmaking is alive, and the next attempt's ``set_round_params`` (a smaller group) would retarget it. In
        one CI run a round-mate applied a pair average with us while our host had cancelled that attempt and our
        retry then found no group (we caught up by downloading the state); the events fit exactly this window,
        which this wait closes.
        """
        deadline = time.monotonic() + timeout
        while control.stage != AveragingStage.FINISHED and time.monotonic() < deadline:
            time.sleep(0.02)
        if control.stage != AveragingStage.FINISHED:
            log.warning("a cancelled all-reduce step did not finish within %.0f s", timeout)

    @staticmethod
    def _wait_step(control, deadline: float, should_stop: Callable[[], bool], on_running: Callable[[], None]):
        running = False
        while True:
            if should_stop():
                raise RoundFailed("stopped")
            if not running and control.began_allreduce:
                running = True
                on_running()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("all-reduce step did not finish in time")
            try:
                return control.result(timeout=min(0.1, left))
            except TimeoutError:
                continue

    def set_donor_round(self, round_: int) -> None:
        """Peers downloading state prefer the donor in the highest round (a client-mode peer serves no state)."""
        if not self.sc.client_mode:
            self.averager.state_sharing_priority = float(round_)

    def download_state(self, peer_id: str) -> tuple[dict, list[torch.Tensor]]:
        """Download ``(metadata, tensors)`` from the given live peer; raises :class:`RoundFailed` on any failure
        (the donor died or froze mid-transfer, refused, or sent nothing) within ``swarm.state_timeout``."""
        try:
            metadata, tensors = self.averager.download_state(peer_id, timeout=self.sc.state_timeout)
        except Exception as e:
            raise RoundFailed(f"state download from {peer_id} failed: {_one_line(e)}") from None
        if not isinstance(metadata, dict):
            raise RoundFailed(f"state download from {peer_id} failed: malformed metadata")
        return metadata, list(tensors)
