"""The averagers of one process: all-reduce and state download on top of :class:`ExactAverager`.

In ``outer.sharding = "rank0"`` mode a peer has one averager for the whole pseudo-gradient. In ``"sharded"`` mode
each local rank has one averager per logical shard it keeps (``p2p_diloco/outer/shards.py``), under the key
``<run>_<fingerprint>_s<j>``, so shard j meets shard j of every other peer whatever their rank layouts. A round's
all-reduce runs the steps of all of this process's averagers at once and succeeds only if every one of them
does; the result stays in the averagers' buffers (:meth:`Averagers.averaged`), so that the ranks of a peer can
first agree that all of them succeeded (all or nothing across shards), and the input tensors stay the peer's own
pseudo-gradient for a retry.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from hivemind.averaging.control import AveragingStage

from ..outer.aggregation import Policy, corrupt_
from ..outer.codecs import codec_for
from ..errors import RoundFailed, SwarmError
from .port import FOLLOWERS_MISMATCH, VIEW_MISMATCH, AllReduceResult
from .exact_averager import ExactAverager, quiet_step_failures
from .compression import compression_for
from .data_auth import DataKey, DataPeer, advertise
from .identity import Identity
from .sockets import listen_socket
from .source_channel import SourceChannel
from .starting import one_line, start_process
from ..protocol.push import push_limit

log = logging.getLogger("p2p_diloco.swarm")



def policy_of(cfg) -> Policy:
    """The aggregation policy of a run config (``outer.aggregation``, ``outer.norm_bound``, ``outer.trim``)."""
    return Policy(method=cfg.outer.aggregation, norm_bound=cfg.outer.norm_bound, trim=cfg.outer.trim)


def round_bits(round_: int) -> str:
    """The round number as hivemind group bits: peers in different rounds use different matchmaking keys."""
    return format(round_ % (1 << 24), "024b")


def ip4_of(maddrs: Sequence[str]) -> str | None:
    for m in maddrs:
        parts = str(m).split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return None


class Averagers:
    """One :class:`ExactAverager` per group of tensors (one group: rank0 mode; one per shard: sharded mode).

    Args:
        cfg: the run config.
        dht: the started hivemind DHT of this process.
        groups: ``{key suffix: tensors shaped like that averager's input}`` ("" = the whole pseudo-gradient).
        state_providers: ``{key suffix: () -> (metadata, tensors)}`` for peers that download state from us.
        visible_maddrs: this DHT's addresses (the data plane listens on the same host).
        allowed: ``swarm.allowed_peers`` resolved (None: an open swarm).
        identity: our identity (identity.py): signs our data-plane entry (data_auth.py).
        state_like: ``{key suffix: tensors shaped like theta}`` where a donation is not shaped like that averager's
            input (``outer.fragments``); by default it is.
    """

    shapes: list[list[torch.Size]]  # per averager: the shapes of its inputs, end to end in its one flat buffer

    def __init__(self, cfg, dht, groups: dict[str, Sequence[torch.Tensor]],
                 state_providers: dict[str, Callable[[], tuple[dict, list[torch.Tensor]]]],
                 visible_maddrs: Callable[[], list[str]], allowed: frozenset[str] | None = None,
                 identity: Identity | None = None, state_like: dict[str, Sequence[torch.Tensor]] | None = None):
        self.cfg, self.sc = cfg, cfg.swarm
        self.keys = list(groups)
        self.list: list[ExactAverager] = []
        self.adverts: list[dict | None] = []  # per averager: our signed data-plane entry, or None (libp2p only)
        self.p2p_only_round = -1
        self._corruption = torch.Generator().manual_seed(cfg.run.seed + 1)  # debug.corrupt_pseudo_gradient only
        prefix = f"{cfg.run.run_id}_{cfg.fingerprint()}"
        quiet_step_failures()  # before the averagers fork: a failed attempt is reported once, by the round protocol
        self.state_sizes: list[tuple[int, int]] = []  # per averager: (bytes, tensors) of theta and its momentum
        codec = codec_for(cfg.outer)
        # Each averager averages one flat buffer: the TCP data plane works in it in place (no copy of the model's
        # size in the averager: source_channel.py), and hivemind cuts its libp2p parts from the start of the
        # concatenation, on the chunks that a chunked codec's error feedback uses too (error_feedback.py)
        self.shapes = []
        self.sources: list[SourceChannel] = []
        for n, key in enumerate(self.keys):
            theta = (state_like or {}).get(key, groups[key])
            self.state_sizes.append((2 * sum(t.numel() * 4 for t in theta), 2 * len(theta)))  # fp32
            state_shapes = [tuple(t.shape) for t in theta] * 2  # what a donor sends: theta, momentum
            self.shapes.append([t.shape for t in groups[key]])
            buffers = [torch.zeros(sum(t.numel() for t in groups[key]), dtype=torch.float32)]
            averager = ExactAverager(
                buffers, dht, start=False, prefix=prefix + (f"_{key}" if key else ""),
                target_group_size=2, min_group_size=2, min_matchmaking_time=self.sc.matchmaking_time,
                request_timeout=self.sc.request_timeout, allreduce_timeout=self.sc.allreduce_timeout,
                next_chunk_timeout=self.sc.next_chunk_timeout, part_size_bytes=self.sc.part_size_bytes,
                compression=compression_for(codec, self.sc.part_size_bytes),
                declare_state_period=max(5.0, self.sc.peer_ttl),
                shutdown_timeout=5, client_mode=self.sc.client_mode,
            )
            averager.state_provider = state_providers[key]
            averager.state_shapes = state_shapes
            averager.codec = codec
            averager.policy, averager.allowed = policy_of(cfg), allowed
            advert = None
            if self.sc.transport == "tcp" and not self.sc.client_mode:  # a client cannot accept data connections:
                port = self.sc.data_port + n if self.sc.data_port else 0  # its groups use libp2p
                averager.data_socket, address = self._open_data_plane(port, visible_maddrs)
                averager.data_key = DataKey()
                me = DataPeer(identity.peer_id, address, averager.data_key.public, self.sc.encrypt_data)
                advert = advertise(identity.sign, identity.public_key, averager.prefix, me)
            averager.source_channel = SourceChannel()
            self.list.append(averager)
            self.adverts.append(advert)
            start_process(averager, self.sc.startup_timeout)  # not run_in_background: it ignores Ctrl-C for good
            averager.source_channel.serve()
            self.sources.append(averager.source_channel)

    def _open_data_plane(self, port: int, visible_maddrs):
        """Listen for direct-TCP all-reduce traffic (see fastpath.py) on the host of our first /ip4 listen address;
        advertise the announced host if one is given (behind NAT / port forwarding), else the listen host."""
        bind = ip4_of(self.sc.host_maddrs) or "127.0.0.1"
        sock = listen_socket(bind, port)
        host = ip4_of(self.sc.announce_maddrs) or (bind if bind != "0.0.0.0" else ip4_of(visible_maddrs()))
        if not host or host == "0.0.0.0":
            sock.close()
            raise SwarmError("swarm.transport = 'tcp' needs a reachable address: give --announce-maddrs")
        return sock, f"{host}:{sock.getsockname()[1]}"

    def shutdown(self, timeout: float) -> None:
        """Stop every averager process within ``timeout`` seconds in all (hivemind then terminates what is left)."""
        deadline = time.monotonic() + timeout
        for source in self.sources:
            source.close()
        for averager in self.list:
            try:
                if averager.is_alive():
                    averager.shutdown_timeout = max(0.1, deadline - time.monotonic())
                    averager.shutdown()
            except Exception as e:
                log.debug("averager shutdown failed: %r", e)
            if averager.data_socket is not None:
                averager.data_socket.close()  # our copy; the averager process had its own

    def set_priority(self, value: float) -> None:
        for averager in self.list:
            averager.state_sharing_priority = value

    # ---------------------------------------------------------------------------------------------- averaging
    def all_reduce(self, round_: int, groups: Sequence[Sequence[torch.Tensor]], weight: float, group_size: int,
                   gather: dict[str, Any], should_stop: Callable[[], bool], on_running: Callable[[], None],
                   matchmaking_time: float, allreduce_timeout: float, look: float,
                   shards: Sequence[int] | None = None, leader: str | None = None, regroup: bool = False
                   ) -> AllReduceResult:
        """Average each group of tensors with its averager's group of exactly ``group_size`` peers, all at once.

        ``shards`` (sharded mode): the logical shard of each averager, in order; the result's ``shard_members`` then
        names, per shard, its group's member processes and the peer each gathered (``gather["peer"]``: the first
        averager gathers all of ``gather``, the others ``round`` and ``peer`` only).

        Raises :class:`RoundFailed` if any step fails (the others are cancelled and waited for), with the bytes the
        attempt moved until then (its ``bytes_sent`` / ``bytes_received``: :meth:`_attempt_bytes`). On success the
        averages are in the averagers' buffers (:meth:`averaged`); the input tensors are never touched here.
        ``leader``: the member every member asks to lead matchmaking (led_matchmaking.py); whole-model groups only
        (a shard's group is made of other processes); ``regroup``: a follower ends the attempt early if that leader
        expects another group (led_matchmaking.py; the RoundFailed then has ``regroup`` set).
        """
        controls = []
        t0 = time.monotonic()
        try:
            self._start_steps(controls, round_, groups, weight, group_size, gather, matchmaking_time, allreduce_timeout,
                              look, shards, leader, regroup)
            return self._wait(controls, round_, shards, t0, look, allreduce_timeout, should_stop, on_running)
        finally:
            for source in self.sources:  # the caller may free or reuse its buffer now
                source.set_inputs(None)

    def _start_steps(self, controls: list, round_: int, groups: Sequence[Sequence[torch.Tensor]], weight: float,
                     group_size: int, gather: dict[str, Any], matchmaking_time: float, allreduce_timeout: float,
                     look: float, shards: Sequence[int] | None, leader: str | None, regroup: bool = False) -> None:
        """Each averager's step of one attempt, started with our input in its buffer (appended to ``controls``)."""
        for averager, tensors, advert in zip(self.list, groups, self.adverts, strict=True):
            averager.set_round_params(round_bits(round_), group_size, timeout=30, matchmaking_time=matchmaking_time,
                                      allreduce_timeout=allreduce_timeout, leader=None if shards else leader,
                                      regroup=regroup and not shards)
            with averager.get_tensors() as buffers:
                torch.cat([t.reshape(-1) for t in tensors], out=buffers[0])
                averager.source_channel.set_inputs(tensors)  # unchanged until the next attempt (the caller's buffer)
                if self.cfg.debug.corrupt_pseudo_gradient:  # the security tests' malicious peer
                    corrupt_(buffers, self.cfg.debug.corrupt_pseudo_gradient, self._corruption)
                    averager.source_channel.set_inputs([buffers[0].clone()])  # (what it sent, for a repair)
            mine = dict(gather, data=advert) if advert and self.p2p_only_round != round_ else gather
            controls.append(averager.step(gather=mine, weight=float(weight), timeout=look, allow_retries=False,
                                          wait=False))
            gather = {k: gather[k] for k in ("round", "peer") if k in gather}  # the other shards' members need no more

    def _wait(self, controls: list, round_: int, shards: Sequence[int] | None, t0: float, look: float,
              allreduce_timeout: float, should_stop: Callable[[], bool], on_running: Callable[[], None]
              ) -> AllReduceResult:
        """The steps of one attempt, to their result (see :meth:`all_reduce`)."""
        assembled = [0.0]

        def running() -> None:
            assembled[0] = time.monotonic() - t0
            on_running()

        results = []
        try:
            for control in controls:
                results.append(_wait_step(control, t0 + look + allreduce_timeout + 10, should_stop, running))
                running = lambda: None  # noqa: E731 (once, when the first group starts)
        except BaseException as e:
            for control in controls:
                if not control.done():
                    control.cancel()
            if isinstance(e, KeyboardInterrupt):
                raise
            for control in controls:
                _wait_step_finished(control, timeout=look + allreduce_timeout)
            if "cannot connect to member" in str(e) and self.p2p_only_round != round_:
                # A member's data port is unreachable (NAT, firewall): the rest of this round goes through libp2p.
                # One member without a data address is enough for the whole group to choose libp2p.
                log.warning("direct TCP all-reduce failed (%s); using libp2p streams for this round", one_line(e))
                self.p2p_only_round = round_
            sent, received = self._attempt_bytes()
            raise RoundFailed(one_line(e), bytes_sent=sent, bytes_received=received,
                              regroup=VIEW_MISMATCH in str(e) or FOLLOWERS_MISMATCH in str(e)) from None
        return self._finish(results, shards, time.monotonic() - t0, assembled[0])

    def _finish(self, results: list, shards: Sequence[int] | None, seconds: float, assembled: float
                ) -> AllReduceResult:
        """The result of an attempt whose steps all returned, or RoundFailed with the bytes they counted."""
        try:
            self._check_finite()
            return _result(results, shards, seconds, assembled)
        except RoundFailed as e:
            e.bytes_sent = sum(r.get("bytes_sent", 0) for r in results if r)
            e.bytes_received = sum(r.get("bytes_received", 0) for r in results if r)
            raise

    def _attempt_bytes(self) -> tuple[int, int]:
        """(bytes sent, bytes received) by this attempt's all-reduces, summed over the averagers, each as counted in
        its process (:meth:`ExactAverager.attempt_bytes`) once its step has finished, so that a cancelled step's
        bytes are in too. An averager that does not answer within 2 s (dead, or stuck) adds nothing."""
        sent = received = 0
        for averager in self.list:
            try:
                if averager.is_alive():
                    s, r = averager.attempt_bytes(timeout=2.0)
                    sent, received = sent + s, received + r
            except Exception as e:
                log.debug("no byte counts from an averager: %r", e)
        return sent, received

    def _check_finite(self) -> None:
        """A last line of defence: a non-finite average (every reducer validates, so only a hostile reducer could
        send one) fails the round instead of reaching theta."""
        for averager in self.list:
            with averager.get_tensors() as buffers:  # (in chunks: no mask of the model's size)
                if not all(bool(torch.isfinite(c).all()) for b in buffers for c in b.reshape(-1).split(1 << 20)):
                    raise RoundFailed("the all-reduce returned non-finite values")

    @contextlib.contextmanager
    def averaged(self) -> Iterator[list[list[torch.Tensor]]]:
        """The last successful all-reduce's averages, per averager, in place (under the averagers' locks)."""
        with contextlib.ExitStack() as stack:
            buffers = [stack.enter_context(averager.get_tensors()) for averager in self.list]
            # views of each flat buffer, shaped like the inputs
            yield [[piece.view(shape) for piece, shape in zip(flat.split([s.numel() for s in shapes]), shapes,
                                                              strict=True)]
                   for (flat,), shapes in zip(buffers, self.shapes, strict=True)]

    def download(self, index: int, peer_id: str, timeout: float) -> tuple[dict, list[torch.Tensor]]:
        """(metadata, tensors) from averager ``index``'s counterpart on ``peer_id``, at most the size of our own
        state and its metadata (a donated state has exactly our shapes); RoundFailed on any failure."""
        try:
            metadata, tensors = self.list[index].download_state(peer_id, timeout=timeout,
                                                                max_bytes=push_limit(*self.state_sizes[index]))
        except Exception as e:
            raise RoundFailed(f"state download from {peer_id} failed: {one_line(e)}") from None
        if not isinstance(metadata, dict):
            raise RoundFailed(f"state download from {peer_id} failed: malformed metadata")
        return metadata, list(tensors)


    def receive_push(self, peer_id: str, wants: int, timeout: float, ask: Callable[[int | None, str], None]
                     ) -> tuple[dict, list[torch.Tensor]]:
        """(metadata, tensors) pushed by the client-mode peer ``peer_id``, which cannot be dialed: open the slot
        for its push (at most our own state's size plus metadata), publish our wish (``ask(wants, peer_id)``), wait
        for the push within ``timeout``, and withdraw the wish (``ask(None, "")``). RoundFailed on any failure."""
        fail = f"state download from {peer_id} failed"
        if self.sc.client_mode:
            raise RoundFailed(f"{fail}: both peers are in client mode (neither accepts a connection)")
        if len(self.list) != 1:
            raise RoundFailed(f"{fail}: a client-mode peer cannot push a shard")
        averager = self.list[0]
        future = averager.await_push(peer_id, wants, push_limit(*self.state_sizes[0]), timeout)
        try:
            ask(wants, peer_id)
            metadata, tensors = future.result(timeout=timeout + 5)
        except Exception as e:
            raise RoundFailed(f"{fail}: no push: {one_line(e)}") from None
        finally:
            try:
                ask(None, "")
            except Exception as e:  # the wish expires with the record anyway
                log.debug("could not withdraw our push wish: %r", e)
        if not isinstance(metadata, dict):
            raise RoundFailed(f"{fail}: malformed metadata")
        return metadata, list(tensors)

    def push(self, peer_id: str, timeout: float) -> bool:
        """Push our state to ``peer_id`` (we are a client-mode peer it asked); True if it took it."""
        return self.list[0].push_state(peer_id, timeout)


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


def _result(results: list, shards: Sequence[int] | None, seconds: float, assembled: float) -> AllReduceResult:
    """One :class:`AllReduceResult` from every averager's step result (RoundFailed if they do not add up to one
    group): bytes summed, the first group's gathered data, every reducer's exclusions, and (sharded) each shard's
    members with the peer each gathered."""
    if not all(results):
        raise RoundFailed("could not find a group")
    sizes = {r["group_size"] for r in results}
    if len(sizes) != 1:  # each averager was told the size; a mismatch would mean a partial round
        raise RoundFailed(f"shard groups of different sizes {sorted(sizes)}")
    lost = tuple(pid for r in results for pid in r.get("lost", ()))
    if lost and len(results) > 1:  # each shard's group repaired on its own: they may no longer add up to one
        raise RoundFailed(f"members {sorted(set(lost))} died mid-all-reduce of a sharded peer's groups")
    gathered = {pid.to_base58(): data for pid, data in results[0]["gathered"].items()}
    excluded = {pid: reason for r in results for pid, reason in r.get("excluded", {}).items()}
    members = None if shards is None else {
        j: {pid.to_base58(): data.get("peer") if isinstance(data, dict) else None
            for pid, data in r["gathered"].items()}
        for j, r in zip(shards, results, strict=True)}
    return AllReduceResult(results[0]["group_size"], sum(r.get("bytes_sent", 0) for r in results),
                           sum(r.get("bytes_received", 0) for r in results), seconds, gathered, assembled, excluded,
                           members, lost, sum(r.get("resent", 0) for r in results))


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
