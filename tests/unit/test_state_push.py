"""The receiving end of a state push (swarm/state_push.py, ``rpc_push_state``) in one process, no network: only the
peer we asked may push, while the wish lasts, at most our own state's size; what it pushes comes back whole."""

import asyncio
import time

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from p2p_diloco.protocol.push import PushSlot, push_limit
from p2p_diloco.swarm.state_push import REFUSED, PushMixin, read_state

pytestmark = pytest.mark.unit


class Receiver(PushMixin):
    serializer = MSGPackSerializer
    next_chunk_timeout = 2.0
    request_timeout = 2.0


class Context:
    def __init__(self, sender: str):
        self.remote_id = type("Id", (), {"to_base58": lambda _self: sender})()


def messages(metadata: dict, tensors):
    meta = MSGPackSerializer.dumps(metadata)
    out = []
    for t in tensors:
        for part in split_for_streaming(serialize_torch_tensor(t), 1024):
            out.append(averaging_pb2.DownloadData(tensor_part=part, metadata=meta) if meta else
                       averaging_pb2.DownloadData(tensor_part=part))
            meta = None
    return out


async def stream(items):
    for item in items:
        yield item


STATE = [torch.arange(1000, dtype=torch.float32), torch.ones(3, 5)]
META = {"round": 4, "digest": "ab", "certificate": None}


def push(receiver, sender, items, max_bytes, deadline=60.0):
    async def go():
        loop = asyncio.get_running_loop()
        receiver._push_slot = PushSlot("c1", 4, max_bytes, time.monotonic() + deadline)
        receiver._push_result = loop.create_future()
        reply = await receiver.rpc_push_state(stream(items), Context(sender))
        result = receiver._push_result
        return reply.code, (result.result() if result.done() and not result.exception() else result.done() and
                            str(result.exception()))
    return asyncio.run(go())


def test_the_peer_we_asked_pushes_our_state_whole():
    size = sum(t.numel() * t.element_size() for t in STATE)
    code, (meta, tensors) = push(Receiver(), "c1", messages(META, STATE), push_limit(size, len(STATE)))
    assert code == averaging_pb2.ACCEPTED and meta == META
    assert all(torch.equal(a, b) for a, b in zip(tensors, STATE, strict=True))


def test_a_peer_we_did_not_ask_is_refused_and_changes_nothing():
    code, result = push(Receiver(), "stranger", messages(META, STATE), 10**9)
    assert code == REFUSED and result is False


def test_an_expired_wish_takes_nothing():
    code, result = push(Receiver(), "c1", messages(META, STATE), 10**9, deadline=-1.0)
    assert code == REFUSED and result is False


def test_a_push_larger_than_our_state_is_cut_off():
    big = [torch.zeros(100_000)]
    code, result = push(Receiver(), "c1", messages(META, big), push_limit(4000, 1) - 256 * 1024)
    assert code == averaging_pb2.PROTOCOL_VIOLATION and "exceeds" in result


def test_with_nobody_asked_every_push_is_refused():
    async def go():
        return await Receiver().rpc_push_state(stream(messages(META, STATE)), Context("c1"))
    assert asyncio.run(go()).code == REFUSED


def test_a_download_stops_reading_at_the_bound():
    """Downloads read with the same reader (swarm/state_push.read_state): a donor streaming without end is cut
    off once it sent more than the size of our state and its metadata, whatever it claims."""
    sent = []

    async def endless():
        meta = MSGPackSerializer.dumps(META)
        part = next(iter(split_for_streaming(serialize_torch_tensor(torch.zeros(256)), 1024)))
        while True:
            sent.append(1)
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=meta if len(sent) == 1 else b"")

    limit = push_limit(4000, 1)
    with pytest.raises(ValueError, match="exceeds"):
        asyncio.run(read_state(endless(), limit, 2.0, MSGPackSerializer))
    assert len(sent) * 1024 < 2 * limit
    meta, tensors = asyncio.run(read_state(stream(messages(META, STATE)), 10**6, 2.0, MSGPackSerializer))
    assert meta == META and all(torch.equal(a, b) for a, b in zip(tensors, STATE, strict=True))


SHAPES = [tuple(t.shape) for t in STATE]


def read(items, shapes=SHAPES):
    return asyncio.run(read_state(stream(items), 10**6, 2.0, MSGPackSerializer, shapes))


def test_a_state_of_our_shapes_is_filled_in_place():
    meta, tensors = read(messages(META, STATE))
    assert meta == META and all(torch.equal(a, b) for a, b in zip(tensors, STATE, strict=True))


@pytest.mark.parametrize("state, refusal", [
    ([STATE[0], torch.ones(5, 3)], r"state tensor 1 is float32\[5, 3\]"),  # a shape of its own choosing
    ([STATE[0], torch.ones(3, 5, dtype=torch.float64)], "state tensor 1 is float64"),
    ([*STATE, torch.ones(1)], "more than our 2 tensors"),  # an extra tensor after ours
    (STATE[:1], "ended after 1 of our 2 tensors"),
])
def test_a_state_that_is_not_ours_in_shape_or_count_is_refused(state, refusal):
    with pytest.raises(ValueError, match=refusal):
        read(messages(META, state))


def test_a_tensor_with_a_byte_more_or_less_than_its_shape_is_refused():
    """The first part of a tensor declares its shape; the parts must then carry exactly that many bytes."""
    items = messages(META, STATE)
    longer = averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"\0"))
    with pytest.raises(ValueError, match="state tensor 1 has more than its 60 bytes"):
        read(items + [longer])
    first = items[0].tensor_part  # tensor 0 (4000 bytes in 4 parts) without the last byte of its first part
    short = averaging_pb2.DownloadData(metadata=items[0].metadata, tensor_part=runtime_pb2.Tensor(
        buffer=first.buffer[:-1], size=first.size, dtype=first.dtype, chunks=first.chunks))
    with pytest.raises(ValueError, match="state tensor 0 ended after 3999 of its 4000 bytes"):
        read([short] + items[1:])
