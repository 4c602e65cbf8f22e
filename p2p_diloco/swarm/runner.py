"""The all-reduce runner of :class:`~p2p_diloco.swarm.exact_averager.ExactAverager` on libp2p streams.

It makes hivemind's butterfly all-reduce exact and all-or-nothing (exact_averager.py explains why), and reduces its
own slice with :class:`~p2p_diloco.swarm.reducer.ValidatingPartReducer`, so that a bad contribution is left out,
not averaged in (``outer.aggregation``).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import amap_in_executor

from ..outer.aggregation import Policy
from .reducer import ValidatingPartReducer

logger = get_logger(__name__)
STREAM_OPEN_TIMEOUT = 10.0


class ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose outputs are the averages themselves, identical on every peer, or an error."""

    def __init__(self, *, compression, policy: Policy = Policy(), **kwargs):
        super().__init__(compression=compression, **kwargs)
        self.compression = compression
        # Replaces hivemind's running-sum reducer before any part can arrive (nothing is awaited in between). The
        # old one is marked finished first: its __del__ would otherwise warn that it "received 0.0%" of its inputs.
        self.tensor_part_reducer.finished.set()
        own = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        self.tensor_part_reducer = ValidatingPartReducer(self.tensor_part_reducer.part_shapes,
                                                         len(self.sender_peer_ids), policy, own)
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
            if container.finished.is_set():  # the round is over (done, or aborted: its parts are cleared, and
                return                          # registering them raised IndexError: deque index out of range)
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
        """True iff every sender contributed to this part (no sender was banned before submitting it) and at least
        one contribution was valid."""
        reducer = self.tensor_part_reducer
        return (part_index < min(reducer.sender_failed_after, default=float("inf"))
                and part_index not in reducer.failed_parts)

    @property
    def excluded(self) -> dict[str, str]:
        """``{peer id: reason}`` of the senders our reducer left out of at least one part of our slice."""
        return {self.sender_peer_ids[i].to_base58(): reason
                for i, reason in self.tensor_part_reducer.excluded.items()}

    def _encode(self, tensor: torch.Tensor):
        """Always our own codec object, never hivemind's table lookup by the sender's enum: every peer runs the
        same ``outer.compression`` (it is part of the config fingerprint)."""
        return self.compression.compress(tensor, CompressionInfo.from_tensor(tensor))

    def _round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        """Exactly what a remote peer receives for ``tensor`` (the codec's quantize -> dequantize round trip)."""
        return deserialize_torch_tensor(self._encode(tensor))

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            try:
                return await super()._communicate_with_peer(peer_id)
            except Exception as e:
                # hivemind logs why a reducer's stream failed at debug level only; this reason is what tells a
                # timeout from a broken stream when a member aborts a round the others completed (README).
                logger.warning(f"stream with reducer {peer_id} failed: {type(e).__name__}: {e}")
                raise
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

        answered = 0
        try:
            async for msg in super().rpc_aggregate_part(counted(stream), context):
                self.bytes_sent += msg.tensor_part.ByteSize()
                self._last_answer = time.monotonic()
                answered += msg.code == averaging_pb2.AVERAGED_PART
                yield msg
            if answered == self.tensor_part_reducer.num_parts:
                # Every part is answered, but not yet received: hivemind closes the stream as soon as this
                # generator ends, and p2pd's teardown of the libp2p stream can drop what the sender has not read
                # yet; hivemind's client reads that as a clean end of stream ("sent 9 parts, but we expected 10").
                # So we stay until the sender hangs up, which it does once it holds all its parts (_CountingStub):
                # the handler is then cancelled here. The bound only matters for a sender that never does.
                await asyncio.sleep(self.reducer_timeout or self.sender_timeout or STREAM_OPEN_TIMEOUT)
        finally:  # runs once the sender hung up after our last answer, or the stream broke
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
        return _CountingStub(super()._get_peer_stub(peer), self, peer)


class _CountingStub:
    """Wraps a peer stub: bounds the time to open the stream, counts the averaged parts streamed back to us, and
    hangs up once all of them are in (the reducer waits for that before it closes: see rpc_aggregate_part).

    hivemind puts no timeout on opening the stream (the dial to a peer that just died is up to p2pd), so it is
    bounded here like every other wait. This is defensive: the hang actually seen under load was the one that
    :meth:`ExactAllReduceRunner._abort` fixes.
    """

    def __init__(self, stub, runner: ExactAllReduceRunner, peer):
        self._stub, self._runner, self._peer = stub, runner, peer

    async def rpc_aggregate_part(self, inputs):
        runner = self._runner
        timeout = runner.reducer_timeout or STREAM_OPEN_TIMEOUT
        stream = await asyncio.wait_for(self._stub.rpc_aggregate_part(inputs), timeout=timeout)
        expected = runner.tensor_part_container.num_parts_by_peer[runner.ordered_peer_ids.index(self._peer)]

        async def counted():
            received = 0
            try:
                async for msg in stream:
                    runner.bytes_received += msg.tensor_part.ByteSize()
                    yield msg
                    received += 1
                    if received == expected:  # every part of this slice is in: hang up (closes our end)
                        break
            finally:
                await stream.aclose()

        return counted()
