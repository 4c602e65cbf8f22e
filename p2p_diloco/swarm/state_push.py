"""State pushes over libp2p: a client-mode peer hands its state to a reachable peer that asked for it.

The rules (who may push what to whom, the byte bound, the pending slot) are :mod:`p2p_diloco.protocol.push`'s. Here:

* :class:`PushMixin`, part of :class:`~p2p_diloco.swarm.exact_averager.ExactAverager`: ``rpc_push_state`` is a
  client-streaming handler, the mirror of hivemind's ``rpc_download_state``: the pusher sends the same
  ``DownloadData`` messages (metadata with the first chunk, then each tensor's serialised parts) and the receiver
  answers once. The receiver takes a push only into the slot :meth:`PushMixin.await_push` opened, from the peer it
  names, up to its byte bound, each chunk within ``next_chunk_timeout``, the slot dropped after its timeout.
* :class:`Pusher`, the host side of a client-mode peer: every heartbeat it reads the live records and pushes its
  state to each peer that asked it (one push at a time, in its own thread, so heartbeats go on meanwhile).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence

import torch

from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from ..protocol.push import PushSlot, over_limit, push_targets, slot_refusal
from ..protocol.records import PeerRecord
from .sockets import view_of

logger = get_logger(__name__)
# The answer to a push we did not ask for (hivemind's message codes have no better name for "not expecting this").
REFUSED = averaging_pb2.NOT_LOOKING_FOR_GROUP


async def read_state(messages: AsyncIterator[averaging_pb2.DownloadData], max_bytes: int, chunk_timeout: float,
                     serializer: Any, shapes: Sequence[tuple[int, ...]] | None = None
                     ) -> tuple[Any, list[torch.Tensor]]:
    """``(metadata, tensors)`` from a stream of ``DownloadData`` messages (a download or a push: the same format,
    metadata with the first chunk, then each tensor's serialised parts). ``ValueError`` once more than
    ``max_bytes`` came; ``TimeoutError`` if a chunk takes more than ``chunk_timeout``. ``metadata`` is None if
    the stream carried none.

    With ``shapes`` (those of our own state: a donated one has exactly ours), the tensors are fp32 of those shapes,
    allocated before the first byte and filled in place as the parts come (:class:`StateFiller`): a tensor of
    another dtype, shape or count, or one byte more or less than its size, is refused as it arrives."""
    metadata, received = None, 0
    filler = StateFiller(shapes) if shapes is not None else None
    tensors, parts = [], []
    async for message in aiter_with_timeout(messages, timeout=chunk_timeout):
        received += len(message.metadata) + len(message.tensor_part.buffer)
        problem = over_limit(received, max_bytes)
        if problem:  # before decoding anything of it: a donor or pusher cannot make us hold more than this
            raise ValueError(problem)
        if message.metadata:
            metadata = serializer.loads(message.metadata)
        if filler is not None:
            filler.add(message.tensor_part)
            continue
        if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        parts.append(message.tensor_part)
    if filler is not None:
        return metadata, filler.result()
    if parts:
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    return metadata, tensors


class StateFiller:
    """Fills fp32 tensors of known shapes from a state's serialised parts (hivemind's uncompressed format: the
    first part of each tensor names its dtype and shape, every part carries the next bytes), refusing anything else.

    The memory is the state itself, allocated once: no list of parts, no joined copy, no second tensor."""

    def __init__(self, shapes: Sequence[tuple[int, ...]]):
        self.tensors = [torch.empty(tuple(shape), dtype=torch.float32) for shape in shapes]
        self.index, self.filled, self.view = -1, 0, memoryview(b"")

    def add(self, part: runtime_pb2.Tensor) -> None:
        """Take the next part; ValueError if it does not fit our state."""
        if part.dtype:  # the first part of the next tensor
            self._check_complete()
            self.index += 1
            if self.index >= len(self.tensors):
                raise ValueError(f"the state has more than our {len(self.tensors)} tensors")
            ours = self.tensors[self.index]
            if (part.compression != runtime_pb2.CompressionType.NONE or part.dtype != "float32"
                    or tuple(part.size) != tuple(ours.shape)):
                raise ValueError(f"state tensor {self.index} is {part.dtype}{list(part.size)} (compression "
                                 f"{part.compression}), ours float32{list(ours.shape)} uncompressed")
            self.view, self.filled = view_of(ours), 0
        elif self.index < 0:
            raise ValueError("a state part came before the first tensor's")
        end = self.filled + len(part.buffer)
        if end > len(self.view):
            raise ValueError(f"state tensor {self.index} has more than its {len(self.view)} bytes")
        self.view[self.filled:end] = part.buffer
        self.filled = end

    def result(self) -> list[torch.Tensor]:
        """The tensors, once every one of them came whole; ValueError otherwise."""
        self._check_complete()
        if self.index != len(self.tensors) - 1:
            raise ValueError(f"the state ended after {self.index + 1} of our {len(self.tensors)} tensors")
        return self.tensors

    def _check_complete(self) -> None:
        if self.index >= 0 and self.filled != len(self.view):
            raise ValueError(f"state tensor {self.index} ended after {self.filled} of its {len(self.view)} bytes")


class PushMixin:
    """Both ends of a state push, for a ``DecentralizedAverager`` subclass (module docstring)."""

    _push_slot: PushSlot | None = None
    state_shapes: list[tuple[int, ...]] | None = None  # our own state's (theta, then momentum): see read_state
    _push_result: asyncio.Future | None = None

    # ------------------------------------------------------------------------------------------ receiving end
    async def rpc_push_state(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                             context: P2PContext) -> averaging_pb2.MessageFromLeader:
        """Averager process: take a pushed ``(metadata, tensors)`` into the pending slot, or refuse it."""
        slot, result = self._push_slot, self._push_result
        sender = context.remote_id.to_base58()
        problem = slot_refusal(slot, sender, time.monotonic())
        if problem:
            logger.info(f"refused a state push from {sender}: {problem}")
            return averaging_pb2.MessageFromLeader(code=REFUSED)
        slot.busy = True
        try:
            state = await asyncio.wait_for(self._read_push(requests, slot.max_bytes),
                                           timeout=max(slot.deadline - time.monotonic(), 0.0))
        except Exception as e:
            if not result.done():
                result.set_exception(RuntimeError(f"the push from {sender} failed: {type(e).__name__}: {e}"))
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        finally:
            slot.busy = False
        if not result.done():
            result.set_result(state)
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)

    async def _read_push(self, requests: AsyncIterator[averaging_pb2.DownloadData], max_bytes: int):
        metadata, tensors = await read_state(requests, max_bytes, self.next_chunk_timeout or self.request_timeout,
                                             self.serializer, self.state_shapes)
        if metadata is None:
            raise ValueError("the push carried no metadata")
        return metadata, tensors

    async def _await_push(self, peer: str, round_: int, max_bytes: int, timeout: float, future: MPFuture) -> None:
        """Averager process: open the slot (replacing any previous one), wait for the push, close the slot."""
        slot = PushSlot(peer, round_, max_bytes, time.monotonic() + timeout)
        result = asyncio.get_event_loop().create_future()
        if self._push_result is not None and not self._push_result.done():
            self._push_result.set_exception(RuntimeError("replaced by a newer wish"))
        self._push_slot, self._push_result = slot, result
        try:
            future.set_result(await asyncio.wait_for(asyncio.shield(result), timeout=timeout))
        except BaseException as e:  # the host gets the reason; the averager's loop must survive
            if not future.done():
                future.set_exception(RuntimeError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__))
            if not isinstance(e, Exception):
                raise
        finally:
            if self._push_slot is slot:
                self._push_slot, self._push_result = None, None

    def await_push(self, peer: str, round_: int, max_bytes: int, timeout: float) -> MPFuture:
        """Host: expect a push of round ``round_`` from ``peer``; the future holds ``(metadata, tensors)``."""
        future = MPFuture()
        self._outer_pipe.send(("_await_push", [], dict(peer=peer, round_=round_, max_bytes=max_bytes,
                                                        timeout=timeout, future=future)))
        return future

    # -------------------------------------------------------------------------------------------- pushing end
    async def _push_messages(self) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Our state as ``rpc_download_state`` would stream it."""
        metadata, tensors, infos = await self._get_current_state_from_host_process()
        if infos is None:
            infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
        for tensor, info in zip(tensors, infos):
            for part in split_for_streaming(self.state_compression.compress(tensor, info, allow_inplace=False)):
                if metadata is not None:
                    yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                    metadata = None
                else:
                    yield averaging_pb2.DownloadData(tensor_part=part)

    async def _push_state(self, peer: str, timeout: float, future: MPFuture) -> None:
        """Averager process: dial ``peer`` and stream our state to it; the future says whether it was taken."""
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            reply = await asyncio.wait_for(stub.rpc_push_state(self._push_messages()), timeout=timeout)
            future.set_result(reply.code == averaging_pb2.ACCEPTED)
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__))
            if not isinstance(e, Exception):
                raise

    def push_state(self, peer: str, timeout: float) -> bool:
        """Host: push our state to ``peer`` (base58 id); True if it took it, False if it refused; raises on
        failure."""
        future = MPFuture()
        self._outer_pipe.send(("_push_state", [], dict(peer=peer, timeout=timeout, future=future)))
        return future.result(timeout=timeout + 5)


class Pusher:
    """A client-mode peer's host side: push our state to the reachable peers that ask us (module docstring).

    Args:
        me: our peer id.
        push: ``(peer, timeout) -> bool``, one push (:meth:`PushMixin.push_state`).
        timeout: ``swarm.state_timeout``, the bound on one push.
    """

    def __init__(self, me: str, push: Callable[[str, float], bool], timeout: float):
        self.me, self.push, self.timeout = me, push, timeout
        self._busy = threading.Lock()
        self._served: dict[tuple[str, int], float] = {}  # (asker, round wanted) -> when it took our push

    def poll(self, records: dict[str, dict], ours: dict) -> None:
        """Called every heartbeat with the raw live records and our own record: start the pushes that are due."""
        round_ = int(ours.get("round", -1))
        certified = round_ == 0 or bool(ours.get("head"))
        synced = ours.get("phase") in ("train", "sync", "done")
        view = {pid: PeerRecord.from_wire(r) for pid, r in records.items() if pid != self.me}
        now = time.monotonic()
        self._served = {k: t for k, t in self._served.items() if now - t < self.timeout}
        due = [pid for pid in push_targets(view, self.me, round_, certified and synced)
               if (pid, view[pid].wants) not in self._served]
        if due and self._busy.acquire(blocking=False):
            threading.Thread(target=self._run, args=(due, view), name="state-push", daemon=True).start()

    def _run(self, due: list[str], view: dict[str, PeerRecord]) -> None:
        try:
            for pid in due:
                try:
                    if self.push(pid, self.timeout):
                        self._served[(pid, view[pid].wants)] = time.monotonic()
                        logger.info(f"pushed our state to {pid}, which asked for round {view[pid].wants}")
                    else:
                        logger.info(f"{pid} refused our state push (not ready yet: retried at the next heartbeat)")
                except Exception as e:
                    logger.warning(f"state push to {pid} failed: {e}")
        finally:
            self._busy.release()
