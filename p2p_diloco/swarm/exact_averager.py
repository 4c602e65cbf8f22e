"""Exact, all-or-nothing butterfly all-reduce on top of hivemind's averager (hivemind 1.1.12, no fork).

Stock hivemind has two properties that break DiLoCo (see shared/docs/hivemind-field-notes.md, items 1 and 2):

* **Not bit-identical.** Each reducer returns ``average - x_i`` and each peer adds it back to its own ``x_i``,
  so peers end with ``x_i + (avg - x_i)``, which differs in the last bits from peer to peer.
  Fix: reducers return the average itself; every peer *copies* it. The reducer's own slice goes through the same
  compress -> decompress round trip as the slices it sends, so it holds exactly what the others receive.
* **Silently partial.** A dead reducer's slice is filled with the local values, a dead sender is dropped from
  the parts not yet reduced, and ``step()`` still returns normally. Fix: a reducer that lost a sender before a
  part was complete sends an error instead of a partial average; every peer refuses a result in which any part
  came from a failed reducer. Either every value of the vector is a full average, or the step raises.

The averager also counts the payload bytes it sends and receives in each all-reduce (a failed attempt's too:
:meth:`ExactAverager.attempt_bytes`), and lets the host change the group key and group size per attempt (the
round number and the group size live in the group key, so peers in different rounds, or expecting groups of
different sizes, can never match). Its reducers validate and robustly combine the contributions (``policy``:
runner.py, reducer.py, fastpath.py), and in a private run (``allowed``) it refuses strangers in matchmaking and as
downloaders of its state (allowlist.py). The libp2p runner itself is in runner.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import as_aiter, azip

from ..outer.aggregation import Policy
from ..runtime import heap
from .data_auth import DataAuthError, DataPeer, verify_advertisement
from .data_server import DataServer
from .fastpath import FastAllReduce
from .led_matchmaking import designate
from .port import SIZE_BITS
from .runner import STREAM_OPEN_TIMEOUT, ExactAllReduceRunner
from .source_channel import cut
from .state_push import PushMixin, read_state
from .workspace import Workspace

logger = get_logger(__name__)


class _StepFailuresAreTheHosts(logging.Filter):
    """Drops hivemind's ERROR record (with a traceback) of a failed averaging step, e.g. "Averaging step failed:
    could not find a group" while a round-mate is still starting. Our steps never retry inside hivemind
    (``allow_retries=False``): the exception goes back to the host, which reports the attempt on one line of its
    own (an ``allreduce_failed`` event with the reason) and decides what to do next, so hivemind's record is a
    duplicate that reads like a crash. Every other hivemind record is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.funcName == "_step" and record.levelno >= logging.ERROR)


_STEP_FILTER = _StepFailuresAreTheHosts()


def attempt_key_bits(group_bits: str, group_size: int) -> str:
    """The group key bits of an attempt: the host's (the round: averagers.py ``round_bits``), then the group size
    it asks for, so that only peers asking for the same size meet in matchmaking.

    Why: hivemind's follower takes whatever group its leader sends. A smaller group than it asked for was
    averaged, then refused by the commit step (``protocol.commit.group_problem``): every byte for nothing. A
    larger one made hivemind's key rotation raise "Sample larger than population" in the follower as the group
    assembled (seen 38 times in one 16-peer chaos run): its step failed at once, while the rest of the group ran
    the all-reduce without it and failed only when its parts did not come (measured with 3 peers and
    ``next_chunk_timeout`` = 3 s: 3 s after the group assembled on libp2p, 6 s on the TCP data plane).
    """
    if not 1 <= group_size < 2**SIZE_BITS:
        raise ValueError(f"group size {group_size} out of range")
    return group_bits + format(group_size, f"0{SIZE_BITS}b")


async def _keep_key(group_info: GroupInfo) -> None:
    """Replaces hivemind's key rotation once a group has assembled (``update_key_on_group_assembled``): our key is
    set for every attempt (:meth:`ExactAverager.set_round_params`), so a rotated key would never be used, and the
    rotation raises in a follower sent a group larger than its ``target_group_size`` (:func:`attempt_key_bits`)."""


def quiet_step_failures() -> None:
    """Install the filter on hivemind's averager logger (idempotent). Call it before an averager forks: the
    averager process logs the step failures, and inherits the filter with the fork."""
    averager_logger = get_logger("hivemind.averaging.averager")
    if _STEP_FILTER not in averager_logger.filters:
        averager_logger.addFilter(_STEP_FILTER)


class ExactAverager(PushMixin, DecentralizedAverager):
    """DecentralizedAverager that runs :class:`ExactAllReduceRunner` and refuses partial results.

    ``step()`` returns ``{"gathered": {peer_id: data}, "group_size": n, "bytes_sent": b, "bytes_received": b}``
    on success; the averaged tensors then hold the exact average. On any failure it raises, and the averaged
    tensors must be treated as garbage (the host discards them).

    A client-mode averager cannot be downloaded from: it pushes its state to a reachable peer that asked for it,
    which receives it with ``rpc_push_state`` (:class:`~p2p_diloco.swarm.state_push.PushMixin`).
    """

    _last_stats: dict
    data_socket = None  # listening socket of the direct-TCP data plane (fastpath.py), created by the host; or None
    data_key = None  # our data-plane key (data_auth.py), made by the host with data_socket
    codec = None  # the run's Codec, used by the data plane
    _data_server = None
    _workspace = None  # the data plane's buffers, kept from one all-reduce to the next (workspace.py)
    source_channel = None  # the host's copy of each attempt's input (source_channel.py), set before the fork
    state_provider = None  # host-side callable returning (metadata, tensors); set before the averager starts
    # Fault hooks of the real-process tests (tests/swarm/faulty_peer.py sets them before the averager forks): seconds
    # slept before sending each all-reduce part, and before each chunk of a state download we serve. 0 in a run.
    part_delay = 0.0
    state_delay = 0.0
    policy = Policy()  # how our reducer validates and combines contributions
    allowed: frozenset[str] | None = None  # swarm.allowed_peers (base58 ids); None = an open swarm
    _attempt_runners: tuple = ()  # the all-reduce runners of the current attempt, whose bytes attempt_bytes adds

    def get_current_state(self):
        """Host process, background thread: what a joining peer downloads from us."""
        metadata, tensors = self.state_provider()
        return metadata, tensors, None

    def _is_allowed(self, peer_id: PeerID) -> bool:
        return self.allowed is None or peer_id.to_base58() in self.allowed

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        self._last_stats = {}
        if len(set(group_info.peer_ids)) != len(group_info.peer_ids):
            # hivemind's follower checks only that it is in the leader's list: a leader listed twice would hold two
            # members' slots (two votes in every slice, on the data plane under its one pair key per reducer)
            raise AllreduceException("the leader's group lists a member more than once")
        target = self._matchmaking.target_group_size
        if target is not None and group_info.group_size != target:
            # only a leader that breaks the protocol sends one (the size is in the group key): refused before any
            # byte moves rather than by the commit step after the whole transfer
            raise AllreduceException(f"the leader's group has {group_info.group_size} members, we asked for {target}")
        strangers = [p.to_base58() for p in group_info.peer_ids if not self._is_allowed(p)]
        if strangers:  # cannot happen between allowed peers (both ends refuse); a last check before any byte moves
            raise AllreduceException(f"group contains peers outside swarm.allowed_peers: {strangers}")
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        lost = self._last_stats.get("lost", ())  # died mid-all-reduce, their slices re-reduced (slice_repair.py)
        gathered = {pid: data for pid, data in gathered.items() if pid.to_base58() not in lost}
        return {"gathered": gathered, "group_size": group_info.group_size - len(lost), **self._last_stats}

    def _in_place(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the data plane averages in ``tensors`` (our shared buffer) itself: one contiguous fp32 vector,
        and a host that can give our input back for a repair (source_channel.py)."""
        return (self.source_channel is not None and len(tensors) == 1 and tensors[0].dtype == torch.float32
                and tensors[0].is_contiguous())

    def _data_peers(self, group_info: GroupInfo) -> list[DataPeer] | None:
        """Every member's data-plane entry, checked against the peer id it stands for (data_auth.py), or None if
        any member has none (the group then uses libp2p: the same decision on every member, from the same data;
        a leader that strips entries only moves the group to libp2p's own authenticated, encrypted streams).

        The entries reach us through the leader, which cannot change one: an entry not signed by its member (an
        address rewritten, another key put in its place) fails the all-reduce here, before any byte is sent."""
        entries = []
        for peer_id, raw in zip(group_info.peer_ids, group_info.gathered, strict=True):
            user = self.serializer.loads(self.serializer.loads(raw)[2])
            entry = user.get("data") if isinstance(user, dict) else None
            if entry is None or isinstance(entry, str):  # (a str: a peer from before signed entries)
                return None
            entries.append((peer_id.to_base58(), entry))
        try:
            peers = [verify_advertisement(self.prefix, peer_id, entry) for peer_id, entry in entries]
        except DataAuthError as e:
            raise AllreduceException(f"refused the group's data plane: {e}") from None
        if peers[group_info.peer_ids.index(self.peer_id)].public != self.data_key.public:
            raise AllreduceException("refused the group's data plane: our own entry is not the one we sent")
        try:  # a member's key that gives no shared secret fails the group now, not after a silent timeout
            for peer in peers:
                self.data_key.check(peer.public)
        except DataAuthError as e:
            raise AllreduceException(f"refused the group's data plane: {e}") from None
        return peers

    async def _fast_allreduce(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, peers: list[DataPeer],
                              weight: float, peer_fractions: Sequence[float]) -> None:
        if self._data_server is None:  # started on first use; earlier connections wait in the listen backlog
            self._data_server = DataServer(self.data_socket, register_timeout=self._allreduce_timeout or 60.0)
            await self._data_server.start()
        if self._workspace is None:
            self._workspace = Workspace()
        in_place = self._in_place(tensors)
        if in_place:  # the runner averages in our shared buffer itself; a repair reads our input from the host
            flat = tensors[0].view(-1)
            timeout = self.next_chunk_timeout or 10.0

            async def read_source(start: int, stop: int) -> torch.Tensor:
                return await self.source_channel.read(start, stop, timeout)
        else:
            flat = self._workspace.get("flat", sum(t.numel() for t in tensors))  # a copy: averaged in place
            torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors], out=flat)

            async def read_source(start: int, stop: int) -> torch.Tensor:
                return cut(tensors, start, stop)
        cuts = torch.tensor([0.0, *peer_fractions]).cumsum(0) / max(sum(peer_fractions), 1e-9) * flat.numel()
        # slices start on the codec's chunk boundaries (topk: its error feedback cut the same chunks, so the slices'
        # encodings lose nothing more); 1 for the other codecs
        align = self.codec.align
        bounds = [min(flat.numel(), int(round(float(c) / align)) * align) for c in cuts]
        bounds[-1] = flat.numel()
        runner = FastAllReduce(group_info.group_id, group_info.peer_ids.index(self.peer_id), peers, flat,
                               bounds, weight, self.codec, chunk_timeout=self.next_chunk_timeout or 10.0,
                               key=self.data_key, policy=self.policy, workspace=self._workspace,
                               read_source=read_source)
        runner.part_delay = self.part_delay
        self._attempt_runners += (runner,)
        self._data_server.register(runner)
        try:
            out = await runner.run(connect_timeout=self.request_timeout * 3,
                                   wait_timeout=self._allreduce_timeout or 60.0)
        finally:
            self._data_server.unregister(runner)
            if not runner.settled:  # its reduction still runs in a thread after an abort: leave it its buffers,
                self._workspace = None
                if in_place:  # and our shared buffer only once it is done (the host writes the next input there)
                    await runner.settle()
        heap.trim_in_background()  # this all-reduce's freed memory, before the host's next round (runtime/heap.py)
        if not in_place:
            offset = 0
            for t in tensors:
                t.copy_(out[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        excluded = {group_info.peer_ids[i].to_base58(): reason for i, reason in runner.excluded.items()}
        repair = runner.repair
        self._last_stats = {"bytes_sent": runner.bytes_sent, "bytes_received": runner.bytes_received,
                            "transport": "tcp", "excluded": excluded,
                            "lost": tuple(group_info.peer_ids[i].to_base58() for i in runner.dead),
                            "resent": 0 if repair is None else repair.bytes_sent}

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id=None, **kwargs):
        peers = self._data_peers(group_info) if self.data_socket is not None else None
        if peers is not None:  # the same decision on every member: it depends only on the gathered data
            assert group_info.group_id in self._running_groups, "group must be registered"
            self._running_groups[group_info.group_id].set_result(None)
            return await self._fast_allreduce(tensors, group_info, peers, kwargs["weight"],
                                              kwargs["peer_fractions"])
        group_id = group_info.group_id if group_id is None else group_id
        started = time.monotonic()
        runner = ExactAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, policy=self.policy, **kwargs,
        )
        runner.part_delay = self.part_delay
        self._attempt_runners += (runner,)
        assert group_id in self._running_groups, "group must be registered by _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)

        async def copy_outputs():
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)

        # Race the output iteration against the runner's own future: after _abort, hivemind's
        # iterate_output_tensors can wait forever for a part that will never come (seen: a 57 s hang until
        # allreduce_timeout), so the failure must be taken from the future, not from the iterator.
        copying = asyncio.ensure_future(copy_outputs())
        try:
            await asyncio.wait({copying, runner._future}, return_when=asyncio.FIRST_COMPLETED)
            if runner._future.done() and runner._future.exception() is not None:
                raise runner._future.exception()
            await copying
        finally:
            copying.cancel()
        container = runner.tensor_part_container
        if container.failed_size:
            raise AllreduceException(
                f"partial all-reduce refused: {container.failed_size} of {container.total_size} values not averaged"
            )
        # Bounded so that a stalled sender cannot turn our finished all-reduce into a timeout (hivemind's
        # allreduce_timeout counts from about when this runner started).
        deadline = started + max((self._allreduce_timeout or 60.0) - 1.0, 0.0)
        if not await runner.wait_served(self.next_chunk_timeout or STREAM_OPEN_TIMEOUT, deadline):
            # Our result is complete and exact; a sender that stopped reading has its own timeout to fail on.
            logger.warning(f"all-reduce done, but {runner._to_serve - runner._served} sender(s) not fully answered")
        self._last_stats = {"bytes_sent": runner.bytes_sent, "bytes_received": runner.bytes_received,
                            "excluded": runner.excluded}

    async def _set_round_params(self, group_bits: str, group_size: int, future, matchmaking_time=None,
                                allreduce_timeout=None, leader=None, regroup=False):
        """Executed in the averager process: key this attempt's matchmaking (:func:`attempt_key_bits`), require
        exactly ``group_size``, take this attempt's deadlines (adaptive deadlines change them between attempts),
        its matchmaking leader (led_matchmaking.py; None: hivemind's election; ``regroup``: end the attempt if
        that leader expects another group), and start counting its bytes from 0."""
        try:
            mm = self._matchmaking
            self._guard_matchmaking(mm)
            designate(mm, leader, regroup)
            mm.group_key_manager.group_bits = attempt_key_bits(group_bits, group_size)
            mm.group_key_manager.update_key_on_group_assembled = _keep_key
            self._attempt_runners = ()
            mm.group_key_manager.target_group_size = group_size
            mm.target_group_size = mm.min_group_size = group_size
            mm.potential_leaders.target_group_size = group_size
            if matchmaking_time is not None:
                mm.min_matchmaking_time = mm.potential_leaders.min_matchmaking_time = matchmaking_time
            if allreduce_timeout is not None:
                self._allreduce_timeout = allreduce_timeout
            future.set_result(None)
        except Exception as e:  # report to the host instead of killing the averager's loop
            future.set_exception(e)

    def _guard_matchmaking(self, mm) -> None:
        """In a private run, never ask a stranger to lead our group (the leaders' side is rpc_join_group)."""
        if self.allowed is None or getattr(mm, "_guarded", False):
            return
        request_join_group = mm._request_join_group

        async def guarded(leader: PeerID):
            if not self._is_allowed(leader):
                logger.debug(f"not joining a group led by {leader}: not in swarm.allowed_peers")
                return None
            return await request_join_group(leader)

        mm._request_join_group, mm._guarded = guarded, True

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """Refuse a stranger's request to join the group we lead (private runs); else hivemind's matchmaking."""
        if not self._is_allowed(context.remote_id):
            logger.info(f"refused a join request from {context.remote_id}: not in swarm.allowed_peers")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def set_round_params(self, group_bits: str, group_size: int, timeout: float, matchmaking_time: float | None = None,
                         allreduce_timeout: float | None = None, leader: str | None = None,
                         regroup: bool = False) -> None:
        if matchmaking_time is not None:  # the host side schedules the step with it (DecentralizedAverager.step)
            self.matchmaking_kwargs["min_matchmaking_time"] = matchmaking_time
        future = MPFuture()
        self._outer_pipe.send(("_set_round_params", [], dict(group_bits=group_bits, group_size=group_size,
                                                              future=future, matchmaking_time=matchmaking_time,
                                                              allreduce_timeout=allreduce_timeout, leader=leader,
                                                              regroup=regroup)))
        future.result(timeout=timeout)

    async def _attempt_bytes(self, future) -> None:
        future.set_result((sum(r.bytes_sent for r in self._attempt_runners),
                           sum(r.bytes_received for r in self._attempt_runners)))

    def attempt_bytes(self, timeout: float) -> tuple[int, int]:
        """(bytes sent, bytes received) by the all-reduce of the current attempt (since the last
        :meth:`set_round_params`), as far as it went: a failed one's too (the step's own result carries the
        counts of a successful one). What is counted: the runners' ``bytes_sent`` / ``bytes_received``
        (fastpath.py: every byte of the attempt's TCP connections; runner.py: the serialized tensor parts handed
        to or taken from the libp2p streams). Raises TimeoutError if the averager process does not answer."""
        future = MPFuture()
        self._outer_pipe.send(("_attempt_bytes", [], dict(future=future)))
        return future.result(timeout=timeout)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not self._is_allowed(context.remote_id):  # a private run's state goes to its members only
            logger.info(f"refused a state download by {context.remote_id}: not in swarm.allowed_peers")
            return
        async for message in super().rpc_download_state(request, context):
            if self.state_delay:  # fault tests only: stretch the transfer so a donor can be killed in the middle
                await asyncio.sleep(self.state_delay)
            yield message

    async def _download_state(self, peer: str, timeout: float, max_bytes: int, future: MPFuture) -> None:
        """Averager process: stream ``peer``'s (metadata, tensors), bounded in time, per chunk and in bytes."""

        async def fetch():
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            return await read_state(stream, max_bytes, self.next_chunk_timeout or self.request_timeout,
                                    self.serializer, self.state_shapes)

        try:
            metadata, tensors = await asyncio.wait_for(fetch(), timeout=timeout)
            if metadata is None:
                raise RuntimeError("the peer sent no state (it is not sharing state)")
            future.set_result((metadata, tensors))
        except BaseException as e:  # the host gets the reason; the averager's loop must survive
            if not future.done():
                future.set_exception(RuntimeError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__))
            if not isinstance(e, Exception):
                raise

    def download_state(self, peer: str, timeout: float, max_bytes: int):
        """Download ``(metadata, tensors)`` from one given peer (base58 id), at most ``max_bytes`` of it, or raise.
        Unlike hivemind's ``load_state_from_peers`` the host chooses the donor, so it can ask for the majority's
        weights and move on to the next donor when one dies mid-transfer."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state", [], dict(peer=peer, timeout=timeout, max_bytes=max_bytes,
                                                           future=future)))
        return future.result(timeout=timeout + 5)
