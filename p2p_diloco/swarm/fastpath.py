"""A direct-TCP data plane for the butterfly all-reduce, used when every member of a group advertises one.

Why: through p2pd every byte is protobuf-serialised in Python, copied over a unix socket to the Go daemon,
encrypted, multiplexed, and the same again on the other side; on 2 cores that caps the whole all-reduce at
~110-120 MB/s (field notes). Matchmaking, the DHT and state downloads stay on libp2p; only the bulk tensor bytes
of an already-assembled group take plain TCP sockets between the members, each authenticated as one member's
(data_auth.py: the keys, the advertisements, the sealing).

Protocol, one connection per (sender, reducer) pair, opened by the sender to the address the reducer signed:

* sender -> reducer: the header ``MAGIC | route | sender index | reducer index | weight | payload bytes | the
  reducer's slice (start, stop, vector length) | nonce | tag``, where ``route`` names the group on the reducer's
  port (a hash of the group id) and ``tag`` is a Poly1305 tag under the (sender, reducer) pair key and ``nonce``:
  the reducer knows who sends before it takes a byte of payload, and drops a header that does not authenticate
  without failing the group. Then the sender's slice for this reducer, encoded with the run's codec and sealed (a
  tag, or encrypted in chunks with ``swarm.encrypt_data``).
* reducer -> sender: ``status | reducer's nonce | payload bytes`` and the weighted average of the slice, encoded
  once and sealed under a key of both nonces.

Every member, the reducer included, decodes those same bytes, so the result is bit-identical on every peer.
Any error of a member (an authenticated one), missing sender, bad frame or timeout aborts the whole all-reduce
(all-or-nothing, like :class:`~p2p_diloco.swarm.runner.ExactAllReduceRunner`). Every read has an inactivity bound
(``chunk_timeout``), so a frozen peer costs seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import socket
import struct
import time
from typing import NamedTuple, Sequence

import torch

from ..outer.aggregation import Contribution, Policy, combine, rms, validate
from ..outer.codecs import Codec
from .data_auth import (NONCE, TAG, DataAuthError, DataKey, DataPeer, check, fresh_nonce, recv_sealed, send_sealed,
                        subkey, tag)
from .sockets import connect, listen_socket, recv_into, send_all, tune, view_of
from .workspace import Workspace

__all__ = ["FastAllReduce", "FastPathError", "HEADER_SIZE", "MAGIC", "group_key", "listen_socket", "recv_into", "tune"]

MAGIC = b"P2PDILOCO2"
# sender, reducer, weight, payload bytes, and the reducer's slice as the sender cuts the vector (start, stop, length)
INDICES = struct.Struct("!HHdQQQQ")
HEADER_SIZE = len(MAGIC) + 16 + INDICES.size + NONCE + TAG
_REPLY = struct.Struct(f"!B{NONCE}sQ")  # status (0 = ok), the reducer's nonce, payload bytes (status read alone)
REDUCE_CHUNK = 2**18  # values validated and combined at once (1 MiB of fp32, as the libp2p parts by default)
_threads: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, pool): see _executor


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The data plane's own thread pool (one per process: a forked child makes its own). Its jobs are tracked as
    the pool's futures, which are done only once the thread is: asyncio's wrapper of a job is done as soon as the
    task awaiting it is cancelled, while the thread may still be writing into the workspace."""
    global _threads
    if _threads is None or _threads[0] != os.getpid():
        _threads = (os.getpid(), concurrent.futures.ThreadPoolExecutor(thread_name_prefix="p2p-diloco-data"))
    return _threads[1]


class Sender(NamedTuple):
    """A sender that authenticated its connection's header (:meth:`FastAllReduce.authenticate`)."""

    index: int
    weight: float
    pair_key: bytes
    nonce: bytes


class FastPathError(RuntimeError):
    """The direct-TCP all-reduce failed; nothing may be applied."""


class _Counted:
    """One of an all-reduce's connections, counting into its runner's ``bytes_sent`` / ``bytes_received`` every
    byte the kernel takes from us or gives us, as it moves: a failed all-reduce then knows exactly what it had
    sent and received (a count after each whole message missed the message cut off). Has what the socket IO of
    sockets.py and data_auth.py uses: ``send``, ``recv_into``, ``fileno``."""

    __slots__ = ("_sock", "_runner")

    def __init__(self, sock: socket.socket, runner: "FastAllReduce"):
        self._sock, self._runner = sock, runner

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, data) -> int:
        k = self._sock.send(data)
        self._runner.bytes_sent += k
        return k

    def recv_into(self, view) -> int:
        k = self._sock.recv_into(view)
        self._runner.bytes_received += k
        return k


def group_key(group_id: bytes) -> bytes:
    """The routing key of a group on the data plane (the group id itself is never sent)."""
    return hashlib.sha256(b"p2p-diloco data plane" + group_id).digest()[:16]


class FastAllReduce:
    """One butterfly all-reduce of a flat fp32 vector over direct TCP (runs in the averager's event loop).

    Args:
        group_id: the group's random id (the pair keys are bound to it).
        index: our position in ``peers``.
        peers: every member as its verified advertisement says (data_auth.py), in the group's order.
        flat: our flat fp32 vector; ``bounds[i]:bounds[i + 1]`` is reducer i's slice. Overwritten with the result,
            each slice once our part of it is out: pass a copy.
        weight: our weight in the average.
        codec: the run's codec.
        chunk_timeout: the longest silence tolerated on any connection.
        key: our data-plane key (its public half is ``peers[index].public``).
        policy: how our slice's contributions are validated and combined (aggregation.py).
        workspace: where the parts we receive and our reduction go (workspace.py); a new one if None.

    ``bytes_sent`` / ``bytes_received`` count every byte of this all-reduce's connections as the kernel takes or
    gives it: a sender's header, the sealed parts and answers, the reply headers; not the header of a sender's
    connection to us, which the data server reads (data_server.py). Exact at any time, after a failure too.
    """

    def __init__(self, group_id: bytes, index: int, peers: Sequence[DataPeer], flat: torch.Tensor,
                 bounds: Sequence[int], weight: float, codec: Codec, chunk_timeout: float, key: DataKey,
                 policy: Policy = Policy(), workspace: Workspace | None = None):
        self.group_id, self.key, self.index = group_id, group_key(group_id), index
        self.peers, self.data_key = list(peers), key
        self.addresses = [p.address for p in self.peers]
        self.encrypt = any(p.encrypt for p in self.peers)  # one member asking is enough: all decide alike
        self.chunk_timeout = chunk_timeout
        self.part_delay = 0.0
        self.flat, self.bounds, self.weight, self.codec = flat, list(bounds), weight, codec
        self.n = len(self.peers)
        self.output = flat  # (in place: no second vector of the model's size to fault in and hold)
        self.workspace = workspace if workspace is not None else Workspace()
        self._jobs: list[concurrent.futures.Future] = []  # our work in threads: it reads and writes the workspace
        self._serving: set[asyncio.Task] = set()  # the data port's tasks that serve our slice
        # Every member's contribution to our slice is kept until all are in, then validated and combined: a bad
        # one is left out instead of summed in (memory: group size x our slice).
        self.policy = policy
        self.contributions = [Contribution(index, self._slice(flat, index).to(torch.float32), weight)]
        self.excluded: dict[int, str] = {}  # {member index: reason} of the contributions left out
        self.chunk_rms: dict[int, list[float]] = {}  # {member index: the RMS of each REDUCE_CHUNK of its part}
        self.contributed: set[int] = {index}
        self.connected: set[int] = set()  # senders whose authenticated connection we took (one each)
        self.refused = 0  # connections whose header did not authenticate
        self.averaged: asyncio.Future = asyncio.get_event_loop().create_future()  # our slice's encoded average
        self.served = 0  # senders whose answer has gone out (or failed)
        self.all_served: asyncio.Future = asyncio.get_event_loop().create_future()
        self.last_activity = time.monotonic()
        self.bytes_sent = self.bytes_received = 0
        self.wait_timeout = 60.0

    def _pair_key(self, sender: int, reducer: int) -> bytes:
        other = self.peers[reducer if sender == self.index else sender]
        return self.data_key.pair_key(other.public, self.group_id, self.peers[sender].peer_id,
                                      self.peers[reducer].peer_id)

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
        return self.workspace.get(f"answer{i}", self.codec.payload_bytes(self._numel(i)), torch.uint8)

    def _in_thread(self, fn, *args) -> asyncio.Future:
        """Run ``fn(*args)`` in a thread (off the event loop), tracked for :attr:`settled`."""
        job = _executor().submit(fn, *args)
        self._jobs.append(job)
        return asyncio.wrap_future(job)

    @property
    def settled(self) -> bool:
        """True once no work of ours is left in a thread: the workspace may serve the next all-reduce."""
        return all(job.done() for job in self._jobs)

    # ----------------------------------------------------------------------------------------- reducer side
    def authenticate(self, header: bytes) -> Sender:
        """The sender of a connection's header; DataAuthError unless the member it names
        sent it (only that member and we hold the pair key) and we have not taken a connection from it yet."""
        sender, reducer, weight, length, *layout = INDICES.unpack_from(header, len(MAGIC) + 16)
        nonce, expected = header[-NONCE - TAG:-TAG], header[-TAG:]
        if reducer != self.index or not 0 <= sender < self.n or sender == self.index:
            raise DataAuthError(f"a header for reducer {reducer} from member {sender} sent to reducer {self.index}")
        pair_key = self._pair_key(sender, self.index)
        try:
            check(subkey(pair_key, b"hdr", nonce), expected, header[:-TAG])
        except DataAuthError:
            self.refused += 1
            raise DataAuthError(f"a header in the name of member {sender} did not authenticate") from None
        if sender in self.connected:  # a replay of its header: the one connection we took stays
            raise DataAuthError(f"a second connection from member {sender}")
        if layout != [self.bounds[self.index], self.bounds[self.index + 1], self.flat.numel()]:
            # the leader relays every member's bandwidth, so it could cut the vector differently for each: a part of
            # the right length at another offset would be averaged with the wrong coordinates
            raise FastPathError(f"member {sender} cuts our slice as {layout}, we as "
                                f"{[self.bounds[self.index], self.bounds[self.index + 1], self.flat.numel()]}")
        if length != self.codec.payload_bytes(self._numel(self.index)):
            raise FastPathError(f"member {sender} sends {length} bytes, expected "
                                f"{self.codec.payload_bytes(self._numel(self.index))}")
        self.connected.add(sender)
        return Sender(sender, weight, pair_key, nonce)

    async def serve(self, sock: socket.socket, sender: Sender) -> None:
        """Take the contribution to our slice of the ``sender`` that :meth:`authenticate` returned, and answer with
        the encoded average. Any failure is that member's and fails our slice."""
        task = asyncio.current_task()
        self._serving.add(task)  # cancelled when our all-reduce ends: it may not write into the workspace after
        try:
            await self._serve(sock, sender)
        except DataAuthError as e:  # the member's own connection carried bytes that are not its
            raise FastPathError(f"the part of member {sender.index} did not authenticate: {e}") from None
        finally:
            self._serving.discard(task)
            self.served += 1
            if self.served == self.n - 1 and not self.all_served.done():
                self.all_served.set_result(None)

    async def _serve(self, sock: socket.socket, sender: Sender) -> None:
        numel = self._numel(self.index)
        data = self.workspace.get(f"part{sender.index}", self.codec.payload_bytes(numel), torch.uint8)
        sock = _Counted(sock, self)
        await recv_sealed(sock, view_of(data), subkey(sender.pair_key, b"up", sender.nonce), self.encrypt,
                          self.chunk_timeout, self._touch)
        contribution = Contribution(sender.index, self.codec.decode(data, numel), sender.weight)
        # Its chunks' RMS now, off the event loop, while the other parts are still arriving and it is still in the
        # cache: after the last arrival the reduction only compares them (issue 18, point 6: measuring them there
        # made the sync ~20 % slower than before validation).
        self.chunk_rms[sender.index] = await self._in_thread(self._chunk_rms, contribution.tensor)
        self.contributions.append(contribution)
        self.contributed.add(sender.index)
        self._touch()
        if len(self.contributed) == self.n and not self.averaged.done():
            await self._reduce()
        encoded = await asyncio.shield(self.averaged)
        reply_nonce = fresh_nonce()
        await send_all(sock, memoryview(_REPLY.pack(0, reply_nonce, encoded.numel())), self.chunk_timeout)
        await send_sealed(sock, view_of(encoded), subkey(sender.pair_key, b"down", sender.nonce + reply_nonce),
                          self.encrypt, self.chunk_timeout)

    async def _reduce(self) -> None:
        """All contributions are in: our slice's encoded aggregate, or an error if a chunk had no valid one.

        Off the event loop (the other connections keep being served) and chunk by chunk, so the extra memory is
        that of one chunk, not of the whole slice (which is half the model in a group of two)."""
        known_rms = dict(self.chunk_rms)  # (a copy: the executor must not see the event loop add to it)
        encoded = await self._in_thread(self._reduce_slice, known_rms)
        self.contributions = []
        if self.averaged.done():  # aborted meanwhile
            return
        if encoded is None:
            self.averaged.set_exception(FastPathError(f"no valid contribution to our slice: {self.excluded}"))
        else:
            self.averaged.set_result(encoded)

    @staticmethod
    def _chunk_rms(t: torch.Tensor) -> list[float]:
        return [rms(t[start:start + REDUCE_CHUNK]) for start in range(0, t.numel(), REDUCE_CHUNK)]

    def _reduce_slice(self, known_rms: dict[int, list[float]]) -> torch.Tensor | None:
        contributions = sorted(self.contributions, key=lambda c: c.sender)  # same bytes whatever the arrival order
        numel = self._numel(self.index)
        out = self.workspace.get("reduced", numel)
        for start in range(0, numel, REDUCE_CHUNK):
            stop = min(start + REDUCE_CHUNK, numel)
            chunk = [Contribution(c.sender, c.tensor[start:stop], c.weight) for c in contributions]
            known = {sender: values[start // REDUCE_CHUNK] for sender, values in known_rms.items()}
            kept, excluded = validate(chunk, self.policy, stop - start, own=self.index, known_rms=known)
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
            sock = await connect(self.addresses[j], connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise FastPathError(f"cannot connect to member {j} at {self.addresses[j]}: {type(e).__name__}") from None
        raw, sock = sock, _Counted(sock, self)
        try:
            pair_key, nonce = self._pair_key(self.index, j), fresh_nonce()
            payload = view_of(self.codec.encode(self._slice(self.flat, j)))
            layout = (self.bounds[j], self.bounds[j + 1], self.flat.numel())
            header = MAGIC + self.key + INDICES.pack(self.index, j, self.weight, len(payload), *layout) + nonce
            header += tag(subkey(pair_key, b"hdr", nonce), header)
            await send_all(sock, memoryview(header), self.chunk_timeout)
            await send_sealed(sock, payload, subkey(pair_key, b"up", nonce), self.encrypt, self.chunk_timeout,
                              send=self._paced if self.part_delay else send_all)
            # The reducer answers only once every member's part is in: allow for the slowest sender's transfer.
            reply = bytearray(_REPLY.size)
            await recv_into(sock, memoryview(reply)[:1], self.wait_timeout)
            if reply[0] != 0:
                raise FastPathError(f"reducer {j} refused our part")
            await recv_into(sock, memoryview(reply)[1:], self.chunk_timeout)
            _, reply_nonce, length = _REPLY.unpack(reply)
            data = self._receive_buffer(j)
            if length != data.numel():
                raise FastPathError(f"reducer {j} answers {length} bytes, expected {data.numel()}")
            await recv_sealed(sock, view_of(data), subkey(pair_key, b"down", nonce + reply_nonce), self.encrypt,
                              self.chunk_timeout)
            self._decode_into(data, j)
        except ConnectionError as e:
            # The reducer hung up: it aborted its slice (another member failed it) or it died.
            raise FastPathError(f"reducer {j} dropped our connection: {type(e).__name__}") from None
        except DataAuthError as e:
            raise FastPathError(f"the answer of reducer {j} did not authenticate: {e}") from None
        finally:
            raw.close()

    async def _paced(self, sock: _Counted, view: memoryview, timeout: float) -> None:
        """Fault tests only: stretch the transfer so that a signal lands in the middle of it."""
        for start in range(0, len(view), 2**14):
            await asyncio.sleep(self.part_delay)
            await send_all(sock, view[start:start + 2**14], timeout)

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
        else:  # our own part's chunk RMS while our parts go out (the reduction computes any it lacks itself)
            own = self._slice(self.flat, self.index)
            self.chunk_rms[self.index] = await self._in_thread(self._chunk_rms, own)
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
            for task in [*tasks, *self._serving]:
                task.cancel()
            self.abort("all-reduce finished or aborted")
            for task in tasks:  # retrieve exceptions so that asyncio does not log them as never retrieved
                if task.done() and not task.cancelled():
                    task.exception()
        return self.output
