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

The averager also counts the payload bytes it sends and receives in each all-reduce, and lets the host change
the group key and group size per round (the round number lives in the group key, so peers in different rounds
can never match).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming

from .fastpath import DataServer, FastAllReduce

logger = get_logger(__name__)
STREAM_OPEN_TIMEOUT = 10.0


class ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose outputs are the averages themselves, identical on every peer, or an error."""

    def __init__(self, *, compression, **kwargs):
        super().__init__(compression=compression, **kwargs)
        self.compression = compression
        self.part_delay = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        container = self.tensor_part_container
        # Remote senders whose stream of averaged parts we (as a reducer) answer: see wait_served().
        has_slice = container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)] != 0
        self._to_serve = len([p for p in self.sender_peer_ids if p != self.peer_id]) if has_slice else 0
        self._served = 0
        self._last_answer = time.monotonic()
        self._all_served = asyncio.Event()
        if self._to_serve == 0:
            self._all_served.set()
        register_failed_reducer = container.register_failed_reducer

        def on_failed_reducer(peer_index: int) -> None:
            # hivemind calls this for any error on a reducer's stream, including one raised after that reducer
            # had handed us every averaged part of its slice (an error code or a timeout where only the stream's
            # end was still due). Such a failure loses nothing: aborting then made us drop a round that the
            # reducer and the others applied. Only a part still missing makes the result partial.
            missing = container.num_parts_by_peer[peer_index] - container._outputs_registered_by_peer[peer_index]
            register_failed_reducer(peer_index)
            if missing > 0:
                self._abort(f"reducer {self.ordered_peer_ids[peer_index]} failed ({missing} parts missing)")
            else:
                logger.debug(f"reducer {self.ordered_peer_ids[peer_index]} failed after its last part: nothing lost")

        container.register_failed_reducer = on_failed_reducer

    def _abort(self, reason: str) -> None:
        """Fail fast: once any part is lost the result can only be refused, so stop waiting for the rest.

        Without this a peer kept waiting for the other slices until ``allreduce_timeout`` (seen under load: a
        reducer handler blocked on writing to a dead peer's stream, so that sender was never banned and the
        reducer's own slice never completed).
        """
        if not self._future.done():
            self.finalize(exception=AllreduceException(f"all-reduce aborted: {reason}"))

    async def _ban_sender(self, peer_id):
        await super()._ban_sender(peer_id)
        lost_from = self.tensor_part_reducer.sender_failed_after[self.sender_peer_ids.index(peer_id)]
        if lost_from < self.tensor_part_reducer.num_parts:  # a ban after the last part loses nothing
            self._abort(f"sender {peer_id} failed")

    def _part_complete(self, part_index: int) -> bool:
        """True iff every sender contributed to this part (no sender was banned before submitting it)."""
        return part_index < min(self.tensor_part_reducer.sender_failed_after, default=float("inf"))

    def _encode(self, tensor: torch.Tensor):
        """Always our own codec object, never hivemind's table lookup by the sender's enum: every peer runs the
        same ``outer.compression`` (it is part of the config fingerprint)."""
        return self.compression.compress(tensor, CompressionInfo.from_tensor(tensor))

    def _round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        """Exactly what a remote peer receives for ``tensor`` (the codec's quantize -> dequantize round trip)."""
        return deserialize_torch_tensor(self._encode(tensor))

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        # Our own slice: reduce it locally, but hand ourselves exactly what the other peers get.
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_event_loop()
        for part_index, part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, self.weight)
            if not self._part_complete(part_index):
                self.tensor_part_container.register_failed_reducer(peer_index)
                return
            averaged = await loop.run_in_executor(None, self._round_trip, averaged)
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Reducer side: answer each part with the full average, or with an error if a sender went missing."""
        part_index = 0
        loop = asyncio.get_event_loop()
        try:
            async for part, weight in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight)
                except BannedException:
                    break
                if not self._part_complete(part_index):
                    yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
                    break
                part_index += 1
                serialized = await loop.run_in_executor(None, self._encode, averaged)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for msg in super()._generate_input_for_peer(peer_index):
            if self.part_delay:  # fault tests only: stretch the transfer so a signal can land in the middle of it
                await asyncio.sleep(self.part_delay)
            self.bytes_sent += msg.tensor_part.ByteSize()
            yield msg

    async def rpc_aggregate_part(self, stream, context):
        async def counted(inner):
            async for msg in inner:
                self.bytes_received += msg.tensor_part.ByteSize()
                yield msg

        try:
            async for msg in super().rpc_aggregate_part(counted(stream), context):
                self.bytes_sent += msg.tensor_part.ByteSize()
                self._last_answer = time.monotonic()
                yield msg
        finally:  # runs once the transport asked for more after our last answer, or the stream broke
            self._served += 1
            if self._served >= self._to_serve:
                self._all_served.set()

    async def wait_served(self, idle_timeout: float, deadline: float) -> bool:
        """Wait until every remote sender has been handed all its averaged parts of our slice; False if no answer
        went out for ``idle_timeout`` s or ``deadline`` (``time.monotonic()``) came first.

        Our own outputs can be complete while our answers to a slower sender are still being streamed (the last
        parts are encoded and written after the reduction that completed our slice). Leaving earlier read
        ``bytes_sent`` short (a CI failure: 607 kB counted of 721 kB sent) and, when the peer then shut down, cut
        the others' transfers short so that their all-reduce failed. The TCP data plane waits the same way
        (``FastAllReduce.all_served``).
        """
        while not self._all_served.is_set():
            now = time.monotonic()
            wait = min(self._last_answer + idle_timeout, deadline) - now
            if wait <= 0:
                return False
            try:
                await asyncio.wait_for(self._all_served.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return True

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self)


class _CountingStub:
    """Wraps a peer stub: bounds the time to open the stream, and counts the averaged parts streamed back to us.

    hivemind puts no timeout on opening the stream (the dial to a peer that just died is up to p2pd), so it is
    bounded here like every other wait. This is defensive: the hang actually seen under load was the one that
    :meth:`ExactAllReduceRunner._abort` fixes.
    """

    def __init__(self, stub, runner: ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs):
        timeout = self._runner.reducer_timeout or STREAM_OPEN_TIMEOUT
        stream = await asyncio.wait_for(self._stub.rpc_aggregate_part(inputs), timeout=timeout)

        async def counted():
            async for msg in stream:
                self._runner.bytes_received += msg.tensor_part.ByteSize()
                yield msg

        return counted()


class ExactAverager(DecentralizedAverager):
    """DecentralizedAverager that runs :class:`ExactAllReduceRunner` and refuses partial results.

    ``step()`` returns ``{"gathered": {peer_id: data}, "group_size": n, "bytes_sent": b, "bytes_received": b}``
    on success; the averaged tensors then hold the exact average. On any failure it raises, and the averaged
    tensors must be treated as garbage (the host discards them).
    """

    _last_stats: dict
    data_socket = None  # listening socket of the direct-TCP data plane (fastpath.py), created by the host; or None
    codec = None  # the run's Codec, used by the data plane
    _data_server = None
    state_provider = None  # host-side callable returning (metadata, tensors); set before the averager starts
    part_delay = 0.0  # seconds slept before sending each part: a fault-test hook (debug.part_delay), never in runs
    state_delay = 0.0  # the same for each chunk of a state download (debug.state_delay)

    def get_current_state(self):
        """Host process, background thread: what a joining peer downloads from us."""
        metadata, tensors = self.state_provider()
        return metadata, tensors, None

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        self._last_stats = {}
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return {"gathered": gathered, "group_size": group_info.group_size, **self._last_stats}

    def _data_addresses(self, group_info: GroupInfo) -> list[str] | None:
        """Every member's data-plane address (from the data it gathered), or None if any member has none."""
        addresses = []
        for raw in group_info.gathered:
            user = self.serializer.loads(self.serializer.loads(raw)[2])
            address = user.get("data") if isinstance(user, dict) else None
            if not isinstance(address, str):
                return None
            addresses.append(address)
        return addresses

    async def _fast_allreduce(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, addresses: list[str],
                              weight: float, peer_fractions: Sequence[float]) -> None:
        if self._data_server is None:  # started on first use; earlier connections wait in the listen backlog
            self._data_server = DataServer(self.data_socket, register_timeout=self._allreduce_timeout or 60.0)
            await self._data_server.start()
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        cuts = torch.tensor([0.0, *peer_fractions]).cumsum(0) / max(sum(peer_fractions), 1e-9) * flat.numel()
        bounds = [int(round(float(c))) for c in cuts]
        bounds[-1] = flat.numel()
        runner = FastAllReduce(group_info.group_id, group_info.peer_ids.index(self.peer_id), addresses, flat,
                               bounds, weight, self.codec, chunk_timeout=self.next_chunk_timeout or 10.0)
        runner.part_delay = self.part_delay
        self._data_server.register(runner)
        try:
            out = await runner.run(connect_timeout=self.request_timeout * 3,
                                   wait_timeout=self._allreduce_timeout or 60.0)
        finally:
            self._data_server.unregister(runner)
        offset = 0
        for t in tensors:
            t.copy_(out[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        self._last_stats = {"bytes_sent": runner.bytes_sent, "bytes_received": runner.bytes_received,
                            "transport": "tcp"}

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id=None, **kwargs):
        addresses = self._data_addresses(group_info) if self.data_socket is not None else None
        if addresses is not None:  # the same decision on every member: it depends only on the gathered data
            assert group_info.group_id in self._running_groups, "group must be registered"
            self._running_groups[group_info.group_id].set_result(None)
            return await self._fast_allreduce(tensors, group_info, addresses, kwargs["weight"],
                                              kwargs["peer_fractions"])
        group_id = group_info.group_id if group_id is None else group_id
        started = time.monotonic()
        runner = ExactAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, **kwargs,
        )
        runner.part_delay = self.part_delay
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
        self._last_stats = {"bytes_sent": runner.bytes_sent, "bytes_received": runner.bytes_received}

    async def _set_round_params(self, group_bits: str, group_size: int, future, matchmaking_time=None,
                                allreduce_timeout=None):
        """Executed in the averager process: key this round's matchmaking, require exactly ``group_size``, and
        take this attempt's deadlines (adaptive deadlines change them between attempts)."""
        try:
            mm = self._matchmaking
            mm.group_key_manager.group_bits = group_bits
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

    def set_round_params(self, group_bits: str, group_size: int, timeout: float, matchmaking_time: float | None = None,
                         allreduce_timeout: float | None = None) -> None:
        if matchmaking_time is not None:  # the host side schedules the step with it (DecentralizedAverager.step)
            self.matchmaking_kwargs["min_matchmaking_time"] = matchmaking_time
        future = MPFuture()
        self._outer_pipe.send(("_set_round_params", [], dict(group_bits=group_bits, group_size=group_size,
                                                              future=future, matchmaking_time=matchmaking_time,
                                                              allreduce_timeout=allreduce_timeout)))
        future.result(timeout=timeout)


    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in super().rpc_download_state(request, context):
            if self.state_delay:  # fault tests only: stretch the transfer so a donor can be killed in the middle
                await asyncio.sleep(self.state_delay)
            yield message

    async def _download_state(self, peer: str, timeout: float, future: MPFuture) -> None:
        """Averager process: stream ``peer``'s (metadata, tensors), bounded in total and per chunk."""

        async def fetch():
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata, tensors, parts = None, [], []
            async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout or self.request_timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            return metadata, tensors

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

    def download_state(self, peer: str, timeout: float):
        """Download ``(metadata, tensors)`` from one given peer (base58 id), or raise. Unlike hivemind's
        ``load_state_from_peers`` the host chooses the donor, so it can ask for the majority's weights and move
        on to the next donor when one dies mid-transfer."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state", [], dict(peer=peer, timeout=timeout, future=future)))
        return future.result(timeout=timeout + 5)
