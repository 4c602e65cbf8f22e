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
:class:`~p2p_diloco.swarm.averager.ExactAllReduceRunner`). Not encrypted: pseudo-gradients cross the network in
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

from ..codecs import Codec

MAGIC = b"P2PDILOCO1"
_INDICES = struct.Struct("!HHd")
_LEN = struct.Struct("!Q")


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


async def _read_exact(reader: asyncio.StreamReader, n: int, timeout: float, touch=lambda: None) -> bytearray:
    """``n`` bytes, with at most ``timeout`` seconds between two arrivals: a frozen or dead peer is detected in
    seconds, while a slow but live link can take as long as it needs (the all-reduce timeout bounds the total)."""
    out = bytearray()
    while len(out) < n:
        piece = await asyncio.wait_for(reader.read(n - len(out)), timeout)
        if not piece:
            raise asyncio.IncompleteReadError(bytes(out), n)
        out += piece
        touch()
    return out


async def _read_frame(reader: asyncio.StreamReader, limit: int, timeout: float, touch=lambda: None) -> bytearray:
    (n,) = _LEN.unpack(await _read_exact(reader, _LEN.size, timeout, touch))
    if n > limit:
        raise FastPathError(f"frame of {n} bytes exceeds the expected {limit}")
    return await _read_exact(reader, n, timeout, touch)


class FastAllReduce:
    """One butterfly all-reduce of a flat fp32 vector over direct TCP (runs in the averager's event loop).

    Args:
        group_id: the group's random id (shared secret of its members).
        index: our position in ``addresses``.
        addresses: ``"host:port"`` of every member, in the group's order.
        flat: our flat fp32 vector; ``bounds[i]:bounds[i + 1]`` is reducer i's slice.
        weight: our weight in the average.
        codec: the run's codec.
    """

    def __init__(self, group_id: bytes, index: int, addresses: Sequence[str], flat: torch.Tensor,
                 bounds: Sequence[int], weight: float, codec: Codec, chunk_timeout: float):
        self.key, self.index, self.addresses = group_key(group_id), index, list(addresses)
        self.chunk_timeout = chunk_timeout
        self.part_delay = 0.0
        self.flat, self.bounds, self.weight, self.codec = flat, list(bounds), weight, codec
        self.n = len(addresses)
        self.output = torch.empty_like(flat)
        lo, hi = self.bounds[index], self.bounds[index + 1]
        self.accumulator = flat[lo:hi].to(torch.float32) * weight
        self.total_weight = weight
        self.contributed: set[int] = {index}
        self.averaged: asyncio.Future = asyncio.get_event_loop().create_future()
        self.last_activity = time.monotonic()
        self.bytes_sent = self.bytes_received = 0

    def _slice(self, i: int) -> torch.Tensor:
        return self.flat[self.bounds[i]:self.bounds[i + 1]]

    # ----------------------------------------------------------------------------------------- reducer side
    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sender: int,
                    weight: float) -> None:
        """Take ``sender``'s contribution to our slice and answer with the encoded average."""
        if sender in self.contributed or not 0 <= sender < self.n:
            raise FastPathError(f"duplicate or invalid sender {sender}")
        numel = self.bounds[self.index + 1] - self.bounds[self.index]
        data = await _read_frame(reader, self.codec.payload_bytes(numel), self.chunk_timeout, self._touch)
        self.bytes_received += len(data) + _LEN.size
        part = self.codec.decode(torch.frombuffer(data, dtype=torch.uint8), numel)
        self.accumulator.add_(part, alpha=weight)
        self.total_weight += weight
        self.contributed.add(sender)
        self._touch()
        if len(self.contributed) == self.n and not self.averaged.done():
            self.averaged.set_result(self.codec.encode(self.accumulator / self.total_weight).numpy().tobytes())
        encoded = await asyncio.shield(self.averaged)
        writer.write(b"\x00" + _LEN.pack(len(encoded)))
        writer.write(encoded)
        # Counted once handed to the transport: the sender may finish (and our stats be read) before drain returns.
        self.bytes_sent += len(encoded) + _LEN.size + 1
        await writer.drain()

    # ------------------------------------------------------------------------------------------ sender side
    async def _send_to(self, j: int, connect_timeout: float) -> None:
        host, port = self.addresses[j].rsplit(":", 1)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise FastPathError(f"cannot connect to member {j} at {self.addresses[j]}: {type(e).__name__}") from None
        try:
            header = MAGIC + self.key + _INDICES.pack(self.index, j, self.weight)
            payload = self.codec.encode(self._slice(j)).numpy().tobytes()
            writer.write(header + _LEN.pack(len(payload)))
            step = 2**14 if self.part_delay else len(payload) or 1
            for start in range(0, len(payload), step):
                if self.part_delay:  # fault tests only: stretch the transfer so a signal lands in the middle
                    await asyncio.sleep(self.part_delay)
                writer.write(memoryview(payload)[start:start + step])
                await writer.drain()
            self.bytes_sent += len(payload) + _LEN.size
            # The reducer answers only once every member's part is in: allow for the slowest sender's transfer.
            status = await asyncio.wait_for(reader.readexactly(1), self.wait_timeout)
            if status != b"\x00":
                raise FastPathError(f"reducer {j} refused our part")
            numel = self.bounds[j + 1] - self.bounds[j]
            data = await _read_frame(reader, self.codec.payload_bytes(numel), self.chunk_timeout)
            self.bytes_received += len(data) + _LEN.size + 1
            decoded = self.codec.decode(torch.frombuffer(data, dtype=torch.uint8), numel)
            self.output[self.bounds[j]:self.bounds[j + 1]] = decoded
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            # The reducer hung up: it aborted its slice (another member failed it) or it died.
            raise FastPathError(f"reducer {j} dropped our connection: {type(e).__name__}") from None
        finally:
            writer.close()

    def _touch(self) -> None:
        self.last_activity = time.monotonic()

    async def _wait_for_senders(self) -> bytes:
        """Our slice's average, once every sender's part is in. A sender that never connects (it died between
        matchmaking and its first byte) is noticed after ``chunk_timeout`` without progress from anyone."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(self.averaged), self.chunk_timeout)
            except asyncio.TimeoutError:
                if time.monotonic() - self.last_activity > self.chunk_timeout:
                    missing = sorted(set(range(self.n)) - self.contributed)
                    raise FastPathError(f"no part from members {missing} for {self.chunk_timeout:.0f} s") from None

    async def _own_slice(self) -> None:
        if self.n > 1:
            encoded = await self._wait_for_senders()
        else:
            encoded = self.codec.encode(self.accumulator).numpy().tobytes()
        numel = self.bounds[self.index + 1] - self.bounds[self.index]
        own = self.codec.decode(torch.frombuffer(bytearray(encoded), dtype=torch.uint8), numel)
        self.output[self.bounds[self.index]:self.bounds[self.index + 1]] = own

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


class DataServer:
    """Accepts data-plane connections in the averager process and routes them to their group's all-reduce."""

    def __init__(self, sock: socket.socket, register_timeout: float):
        self.sock, self.register_timeout = sock, register_timeout
        self.groups: dict[bytes, asyncio.Future] = {}
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._on_connection, sock=self.sock, limit=2**20)

    def _slot(self, key: bytes) -> asyncio.Future:
        if key not in self.groups:
            self.groups[key] = asyncio.get_event_loop().create_future()
        return self.groups[key]

    def register(self, allreduce: FastAllReduce) -> None:
        slot = self._slot(allreduce.key)
        if not slot.done():
            slot.set_result(allreduce)

    def unregister(self, allreduce: FastAllReduce) -> None:
        slot = self.groups.pop(allreduce.key, None)
        if slot is not None and not slot.done():
            slot.cancel()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key, allreduce = None, None
        try:
            header = await asyncio.wait_for(reader.readexactly(len(MAGIC) + 16 + _INDICES.size), 10.0)
            if header[:len(MAGIC)] != MAGIC:
                return
            key = bytes(header[len(MAGIC):len(MAGIC) + 16])
            sender, reducer, weight = _INDICES.unpack(header[len(MAGIC) + 16:])
            allreduce = await asyncio.wait_for(asyncio.shield(self._slot(key)), self.register_timeout)
            if reducer != allreduce.index:
                raise FastPathError(f"part for reducer {reducer} sent to reducer {allreduce.index}")
            await allreduce.serve(reader, writer, sender, weight)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, FastPathError, struct.error) as e:
            if allreduce is not None:  # a member's part is lost: our slice can never be complete
                allreduce.abort(f"a sender's part was lost: {type(e).__name__}")
            elif key is not None and key in self.groups and not self.groups[key].done():
                self.groups.pop(key).cancel()  # nobody registered this key in time: forget it
        finally:
            writer.close()
