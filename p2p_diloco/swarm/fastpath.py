"""A direct-TCP data plane for the butterfly all-reduce, used when every member of a group advertises one.

Why: through p2pd every byte is protobuf-serialised in Python, copied over a unix socket to the Go daemon,
encrypted, multiplexed, and the same again on the other side; on 2 cores that caps the whole all-reduce at
~110-120 MB/s (field notes). Matchmaking, the DHT and state downloads stay on libp2p; only the bulk tensor bytes
of an already-assembled group take plain TCP sockets between the members.

Protocol, one connection per (sender, reducer) pair, opened by the sender:

* sender -> reducer: ``MAGIC | key | sender index | reducer index | weight``, where ``key`` is a hash of the
  group id. The group id is random and reaches the members only over libp2p's authenticated, encrypted streams,
  so a peer outside the group cannot guess the key (one that can read the traffic can: see below); then one
  frame (``u64 length | bytes``): the sender's slice for this reducer, encoded with the run's codec.
* reducer -> sender: one status byte (0 = ok) and one frame: the weighted average of the slice, encoded once.

Every member, the reducer included, decodes those same bytes, so the result is bit-identical on every peer.
Any error, missing sender, bad header or timeout aborts the whole all-reduce (all-or-nothing, like
:class:`~p2p_diloco.swarm.runner.ExactAllReduceRunner`). Not encrypted: pseudo-gradients cross the network in
the clear and an on-path attacker could inject into a group (``swarm.transport = "p2p"`` keeps everything inside
libp2p's encryption). Every read has an inactivity bound (``chunk_timeout``), so a frozen peer costs seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import struct
import time
from typing import Sequence

import torch

from ..outer.aggregation import Contribution, Policy, combine, validate
from ..outer.codecs import Codec

MAGIC = b"P2PDILOCO1"
INDICES = struct.Struct("!HHd")
_LEN = struct.Struct("!Q")
REDUCE_CHUNK = 2**18  # values validated and combined at once (1 MiB of fp32, as the libp2p parts by default)


class FastPathError(RuntimeError):
    """The direct-TCP all-reduce failed; nothing may be applied."""


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A bound, listening TCP socket (created in the host process so the port is known before the fork)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def group_key(group_id: bytes) -> bytes:
    """The routing key of a group on the data plane (the group id itself is never sent)."""
    return hashlib.sha256(b"p2p-diloco data plane" + group_id).digest()[:16]


def tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _ready(sock: socket.socket, write: bool, timeout: float) -> None:
    """Wait until ``sock`` is readable (or writable), for at most ``timeout`` seconds."""
    loop = asyncio.get_event_loop()
    fd, waiter = sock.fileno(), loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: waiter.done() or waiter.set_result(None))
    try:
        await asyncio.wait_for(waiter, timeout)
    finally:
        remove(fd)


async def recv_into(sock: socket.socket, view: memoryview, timeout: float, touch=lambda: None) -> None:
    """Fill ``view`` from ``sock``, with at most ``timeout`` seconds between two arrivals: a frozen or dead peer
    is detected in seconds, while a slow but live link can take as long as it needs (the all-reduce timeout
    bounds the total).

    Zero-copy: the kernel writes straight into ``view`` (the decode buffer, or for fp32 the output itself). Reads
    go as far as the socket buffer allows before waiting on the event loop: on a fast link that is one system
    call per socket buffer, not one task per 64 KiB as with asyncio streams (the profile's top cost).
    """
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            await _ready(sock, False, timeout)
            continue
        if k == 0:
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k
        touch()


async def _send_all(sock: socket.socket, view: memoryview, timeout: float) -> None:
    """Send all of ``view`` (no copy), with at most ``timeout`` seconds without progress."""
    sent, n = 0, len(view)
    while sent < n:
        try:
            sent += sock.send(view[sent:])
        except (BlockingIOError, InterruptedError):
            await _ready(sock, True, timeout)


async def _recv_frame(sock: socket.socket, into: torch.Tensor, timeout: float, touch=lambda: None) -> None:
    """One frame (``u64 length | bytes``) whose length must be exactly ``into.numel()`` bytes."""
    head = bytearray(_LEN.size)
    await recv_into(sock, memoryview(head), timeout, touch)
    (n,) = _LEN.unpack(head)
    if n != into.numel():
        raise FastPathError(f"frame of {n} bytes, expected {into.numel()}")
    await recv_into(sock, _view(into), timeout, touch)


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy."""
    return memoryview(t.numpy()).cast("B")


async def _connect(address: str, timeout: float) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tune(sock)
    try:
        await asyncio.wait_for(asyncio.get_event_loop().sock_connect(sock, (host, int(port))), timeout)
    except BaseException:
        sock.close()
        raise
    return sock


class FastAllReduce:
    """One butterfly all-reduce of a flat fp32 vector over direct TCP (runs in the averager's event loop).

    Args:
        group_id: the group's random id (shared secret of its members).
        index: our position in ``addresses``.
        addresses: ``"host:port"`` of every member, in the group's order.
        flat: our flat fp32 vector; ``bounds[i]:bounds[i + 1]`` is reducer i's slice.
        weight: our weight in the average.
        codec: the run's codec.
        chunk_timeout: the longest silence tolerated on any connection.
        policy: how our slice's contributions are validated and combined (aggregation.py).
    """

    def __init__(self, group_id: bytes, index: int, addresses: Sequence[str], flat: torch.Tensor,
                 bounds: Sequence[int], weight: float, codec: Codec, chunk_timeout: float,
                 policy: Policy = Policy()):
        self.key, self.index, self.addresses = group_key(group_id), index, list(addresses)
        self.chunk_timeout = chunk_timeout
        self.part_delay = 0.0
        self.flat, self.bounds, self.weight, self.codec = flat, list(bounds), weight, codec
        self.n = len(addresses)
        self.output = torch.empty_like(flat)
        # Every member's contribution to our slice is kept until all are in, then validated and combined: a bad
        # one is left out instead of summed in (memory: group size x our slice).
        self.policy = policy
        self.contributions = [Contribution(index, self._slice(flat, index).to(torch.float32), weight)]
        self.excluded: dict[int, str] = {}  # {member index: reason} of the contributions left out
        self.contributed: set[int] = {index}
        self.averaged: asyncio.Future = asyncio.get_event_loop().create_future()  # our slice's encoded average
        self.served = 0  # senders whose answer has gone out (or failed)
        self.all_served: asyncio.Future = asyncio.get_event_loop().create_future()
        self.last_activity = time.monotonic()
        self.bytes_sent = self.bytes_received = 0
        self.wait_timeout = 60.0

    def _slice(self, t: torch.Tensor, i: int) -> torch.Tensor:
        return t[self.bounds[i]:self.bounds[i + 1]]

    def _numel(self, i: int) -> int:
        return self.bounds[i + 1] - self.bounds[i]

    def _decode_into(self, data: torch.Tensor, i: int) -> None:
        """Decode an encoded average of slice ``i`` into our output (a no-op when it was received in place)."""
        out = self._slice(self.output, i)
        decoded = self.codec.decode(data, out.numel())
        if decoded.data_ptr() != out.data_ptr():
            out.copy_(decoded)

    def _receive_buffer(self, i: int) -> torch.Tensor:
        """Where the encoded average of slice ``i`` lands: lossless fp32 goes straight into the output."""
        if self.codec.lossless_fp32:
            return self._slice(self.output, i).view(torch.uint8)
        return torch.empty(self.codec.payload_bytes(self._numel(i)), dtype=torch.uint8)

    # ----------------------------------------------------------------------------------------- reducer side
    async def serve(self, sock: socket.socket, sender: int, weight: float) -> None:
        """Take ``sender``'s contribution to our slice and answer with the encoded average."""
        if sender in self.contributed or not 0 <= sender < self.n:
            raise FastPathError(f"duplicate or invalid sender {sender}")
        try:
            await self._serve(sock, sender, weight)
        finally:
            self.served += 1
            if self.served == self.n - 1 and not self.all_served.done():
                self.all_served.set_result(None)

    async def _serve(self, sock: socket.socket, sender: int, weight: float) -> None:
        numel = self._numel(self.index)
        data = torch.empty(self.codec.payload_bytes(numel), dtype=torch.uint8)
        await _recv_frame(sock, data, self.chunk_timeout, self._touch)
        self.bytes_received += data.numel() + _LEN.size
        self.contributions.append(Contribution(sender, self.codec.decode(data, numel), weight))
        self.contributed.add(sender)
        self._touch()
        if len(self.contributed) == self.n and not self.averaged.done():
            await self._reduce()
        encoded = await asyncio.shield(self.averaged)
        # Counted once handed to the transport: the sender may finish (and our stats be read) before we return.
        self.bytes_sent += encoded.numel() + _LEN.size + 1
        await _send_all(sock, memoryview(b"\x00" + _LEN.pack(encoded.numel())), self.chunk_timeout)
        await _send_all(sock, _view(encoded), self.chunk_timeout)

    async def _reduce(self) -> None:
        """All contributions are in: our slice's encoded aggregate, or an error if a chunk had no valid one.

        Off the event loop (the other connections keep being served) and chunk by chunk, so the extra memory is
        that of one chunk, not of the whole slice (which is half the model in a group of two)."""
        encoded = await asyncio.get_event_loop().run_in_executor(None, self._reduce_slice)
        self.contributions = []
        if self.averaged.done():  # aborted meanwhile
            return
        if encoded is None:
            self.averaged.set_exception(FastPathError(f"no valid contribution to our slice: {self.excluded}"))
        else:
            self.averaged.set_result(encoded)

    def _reduce_slice(self) -> torch.Tensor | None:
        contributions = sorted(self.contributions, key=lambda c: c.sender)  # same bytes whatever the arrival order
        numel = self._numel(self.index)
        out = torch.empty(numel, dtype=torch.float32)
        for start in range(0, numel, REDUCE_CHUNK):
            stop = min(start + REDUCE_CHUNK, numel)
            chunk = [Contribution(c.sender, c.tensor[start:stop], c.weight) for c in contributions]
            kept, excluded = validate(chunk, self.policy, stop - start, own=self.index)
            for sender, reason in excluded.items():
                self.excluded.setdefault(sender, reason)
            if not kept:
                return None
            out[start:stop] = combine(kept, self.policy)
            self._touch()  # a long reduction is progress, not a silent peer (_wait_for_senders)
        return self.codec.encode(out)

    # ------------------------------------------------------------------------------------------ sender side
    async def _send_to(self, j: int, connect_timeout: float) -> None:
        try:
            sock = await _connect(self.addresses[j], connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise FastPathError(f"cannot connect to member {j} at {self.addresses[j]}: {type(e).__name__}") from None
        try:
            payload = _view(self.codec.encode(self._slice(self.flat, j)))
            header = MAGIC + self.key + INDICES.pack(self.index, j, self.weight) + _LEN.pack(len(payload))
            await _send_all(sock, memoryview(header), self.chunk_timeout)
            step = 2**14 if self.part_delay else len(payload) or 1
            for start in range(0, len(payload), step):
                if self.part_delay:  # fault tests only: stretch the transfer so a signal lands in the middle
                    await asyncio.sleep(self.part_delay)
                await _send_all(sock, payload[start:start + step], self.chunk_timeout)
            self.bytes_sent += len(payload) + _LEN.size
            # The reducer answers only once every member's part is in: allow for the slowest sender's transfer.
            status = bytearray(1)
            await recv_into(sock, memoryview(status), self.wait_timeout)
            if status != b"\x00":
                raise FastPathError(f"reducer {j} refused our part")
            data = self._receive_buffer(j)
            await _recv_frame(sock, data, self.chunk_timeout)
            self.bytes_received += data.numel() + _LEN.size + 1
            self._decode_into(data, j)
        except ConnectionError as e:
            # The reducer hung up: it aborted its slice (another member failed it) or it died.
            raise FastPathError(f"reducer {j} dropped our connection: {type(e).__name__}") from None
        finally:
            sock.close()

    def _touch(self) -> None:
        self.last_activity = time.monotonic()

    async def _wait_for_senders(self) -> torch.Tensor:
        """Our slice's encoded average, once every sender's part is in. A sender that never connects (it died
        between matchmaking and its first byte) is noticed after ``chunk_timeout`` without progress from anyone."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(self.averaged), self.chunk_timeout)
            except asyncio.TimeoutError:
                if time.monotonic() - self.last_activity > self.chunk_timeout:
                    missing = sorted(set(range(self.n)) - self.contributed)
                    raise FastPathError(f"no part from members {missing} for {self.chunk_timeout:.0f} s") from None

    async def _own_slice(self) -> None:
        # We keep exactly what the others receive: the decoded bytes of our encoded average, not the exact one.
        if self.n == 1:
            await self._reduce()
        encoded = await self._wait_for_senders()
        self._decode_into(encoded, self.index)
        if self.n > 1:
            # Our answers are written straight from our buffers, not queued in a transport that would flush them
            # after we return: stay until every sender has its average, or a peer that stops right after the
            # last round would cut the others' transfers short.
            await asyncio.wait_for(asyncio.shield(self.all_served), self.wait_timeout)

    def abort(self, reason: str) -> None:
        """Fail the reduction of our slice (a sender's connection broke): our run() raises at once."""
        if not self.averaged.done():
            self.averaged.set_exception(FastPathError(reason))

    async def run(self, connect_timeout: float, wait_timeout: float) -> torch.Tensor:
        """Send our parts, reduce our slice, collect the averages. Raises on the first failure of any of them."""
        self.wait_timeout = wait_timeout
        tasks = [asyncio.ensure_future(self._own_slice())]
        tasks += [asyncio.ensure_future(self._send_to(j, connect_timeout)) for j in range(self.n) if j != self.index]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            self.abort("all-reduce finished or aborted")
            for task in tasks:  # retrieve exceptions so that asyncio does not log them as never retrieved
                if task.done() and not task.cancelled():
                    task.exception()
        return self.output
