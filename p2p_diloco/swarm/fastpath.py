"""A direct-TCP data plane for the butterfly all-reduce, used when every member of a group advertises one.

Why: through p2pd every byte is protobuf-serialised in Python, copied over a unix socket to the Go daemon,
encrypted, multiplexed, and the same again on the other side; on 2 cores that caps the whole all-reduce at
~110-120 MB/s (field notes). Matchmaking, the DHT and state downloads stay on libp2p; only the bulk tensor bytes
of an already-assembled group take plain TCP sockets between the members, each authenticated as one member's
(data_auth.py: the keys, the advertisements, the sealing).

One connection per (sender, reducer) pair, opened by the sender to the address the reducer signed (the frames:
data_wire.py). Every member, the reducer included, decodes the same bytes of each slice's average, so the result
is bit-identical on every peer. A member whose connection breaks (it died) costs its slice, re-reduced by the
survivors (slice_repair.py); any other error of a member (an authenticated one), bad frame or timeout, or a second
death, aborts the whole all-reduce (all-or-nothing, like :class:`~p2p_diloco.swarm.runner.ExactAllReduceRunner`).
Every read has an inactivity bound (``chunk_timeout``), so a frozen peer costs seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import socket
import time
from typing import Awaitable, Callable, Sequence

import torch

from ..outer.aggregation import Contribution, Policy, combine, rms, validate
from ..outer.codecs import Codec
from .data_auth import (NONCE, TAG, DataAuthError, DataKey, DataPeer, check, fresh_nonce, recv_sealed, send_sealed,
                        subkey, tag)
from .data_wire import HEADER_SIZE, INDICES, MAGIC, REPLY, Counted, Sender, executor, group_key, paced
from .slice_repair import SliceRepair
from .sockets import FastPathError, connect, listen_socket, recv_into, send_all, tune, view_of
from .workspace import Workspace

__all__ = ["FastAllReduce", "FastPathError", "HEADER_SIZE", "INDICES", "MAGIC", "group_key", "listen_socket",
           "recv_into", "tune"]

REDUCE_CHUNK = 2**18  # values validated and combined at once (1 MiB of fp32, as the libp2p parts by default)


class FastAllReduce:
    """One butterfly all-reduce of a flat fp32 vector over direct TCP (runs in the averager's event loop).

    Args:
        group_id: the group's random id (the pair keys are bound to it).
        index: our position in ``peers``.
        peers: every member as its verified advertisement says (data_auth.py), in the group's order.
        flat: our flat fp32 vector; ``bounds[i]:bounds[i + 1]`` is reducer i's slice. Overwritten with the result
            (each slice once our part of it is out), our own slice by its reduction.
        weight: our weight in the average.
        codec: the run's codec.
        chunk_timeout: the longest silence tolerated on any connection.
        key: our data-plane key (its public half is ``peers[index].public``).
        policy: how our slice's contributions are validated and combined (aggregation.py).
        workspace: where the parts we receive go (workspace.py); a new one if None.
        read_source: ``await read_source(start, stop)``: values ``start:stop`` of ``flat`` as it was (a dead
            member's slice is re-reduced from them: slice_repair.py, source_channel.py). None: a death fails.

    ``bytes_sent`` / ``bytes_received`` count every byte of this all-reduce's connections as the kernel takes or
    gives it: a sender's header, the sealed parts and answers, the reply headers; not the header of a sender's
    connection to us, which the data server reads (data_server.py). Exact at any time, after a failure too.
    ``dead``: {member: reason} of a member whose connection broke (at most one: its slice was re-reduced).
    """

    def __init__(self, group_id: bytes, index: int, peers: Sequence[DataPeer], flat: torch.Tensor,
                 bounds: Sequence[int], weight: float, codec: Codec, chunk_timeout: float, key: DataKey,
                 policy: Policy = Policy(), workspace: Workspace | None = None,
                 read_source: Callable[[int, int], Awaitable[torch.Tensor]] | None = None):
        self.group_id, self.key, self.index = group_id, group_key(group_id), index
        self.peers, self.data_key = list(peers), key
        self.addresses = [p.address for p in self.peers]
        self.encrypt = any(p.encrypt for p in self.peers)  # one member asking is enough: all decide alike
        self.chunk_timeout = chunk_timeout
        self.part_delay = 0.0
        self.flat, self.bounds, self.weight, self.codec = flat, list(bounds), weight, codec
        self.read_source = read_source
        self.n = len(self.peers)
        self.output = flat  # (in place: no second vector of the model's size to fault in and hold)
        self.workspace = workspace if workspace is not None else Workspace()
        self._jobs: list[concurrent.futures.Future] = []  # our work in threads: it reads and writes the workspace
        self._serving: set[asyncio.Task] = set()  # the data port's tasks that serve our slice
        self.policy = policy  # every contribution to our slice is kept until all are in, then validated and combined
        self.contributions = [Contribution(index, self._slice(flat, index).to(torch.float32), weight)]
        self.excluded: dict[int, str] = {}  # {member index: reason} of the contributions left out
        self.chunk_rms: dict[int, list[float]] = {}  # {member index: the RMS of each REDUCE_CHUNK of its part}
        self.contributed: set[int] = {index}
        self.connected: set[int] = set()  # senders whose authenticated connection we took (one each)
        self.refused = 0  # connections whose header did not authenticate
        self.averaged: asyncio.Future = asyncio.get_event_loop().create_future()  # our slice's encoded average
        self._reducing = False
        self.served = 0  # senders whose answer has gone out (or failed)
        self.all_served: asyncio.Future = asyncio.get_event_loop().create_future()
        self.last_activity = time.monotonic()
        self.bytes_sent = self.bytes_received = 0
        self.wait_timeout = 60.0
        self.connect_timeout = 10.0
        self.dead: dict[int, str] = {}
        self.repair: SliceRepair | None = None
        self._repairing: asyncio.Task | None = None

    def _pair_key(self, sender: int, reducer: int) -> bytes:
        other = self.peers[reducer if sender == self.index else sender]
        return self.data_key.pair_key(other.public, self.group_id, self.peers[sender].peer_id,
                                      self.peers[reducer].peer_id)

    def _slice(self, t: torch.Tensor, i: int) -> torch.Tensor:
        return t[self.bounds[i]:self.bounds[i + 1]]

    def _numel(self, i: int) -> int:
        return self.bounds[i + 1] - self.bounds[i]

    def _layout(self, i: int) -> list[int]:
        return [self.bounds[i], self.bounds[i + 1], self.flat.numel()]

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
        job = executor().submit(fn, *args)
        self._jobs.append(job)
        return asyncio.wrap_future(job)

    async def settle(self) -> None:
        """Wait until no work of ours is left in a thread (it may write into our output until then)."""
        await asyncio.gather(*(asyncio.wrap_future(job) for job in self._jobs), return_exceptions=True)

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
        if layout != self._layout(self.index):
            # A part of another member's slice: that member's connection to the sender broke (slice_repair.py).
            # Else the leader, which relays every member's bandwidth, cut the vector differently for each: a part
            # of the right length at another offset would be averaged with the wrong coordinates.
            return self._repair_sender(sender, weight, pair_key, nonce, length, layout)
        if sender in self.connected:  # a replay of its header: the one connection we took stays
            raise DataAuthError(f"a second connection from member {sender}")
        if length != self.codec.payload_bytes(self._numel(self.index)):
            raise FastPathError(f"member {sender} sends {length} bytes, expected "
                                f"{self.codec.payload_bytes(self._numel(self.index))}")
        self.connected.add(sender)
        return Sender(sender, weight, pair_key, nonce, self.index)

    def _repair_sender(self, sender: int, weight: float, pair_key: bytes, nonce: bytes, length: int,
                       layout: list[int]) -> Sender:
        dead = next((i for i in range(self.n) if i not in (sender, self.index) and layout == self._layout(i)), None)
        if dead is None:
            raise FastPathError(f"member {sender} cuts our slice as {layout}, we as {self._layout(self.index)}")
        if length != self.codec.payload_bytes(self._numel(dead)):
            raise FastPathError(f"member {sender} sends {length} bytes of slice {dead}, expected "
                                f"{self.codec.payload_bytes(self._numel(dead))}")
        # The sender's claim that `dead` died is enough to re-reduce its slice: a member can fail a group anyway,
        # and one that lied only makes the group's results differ (the commit step then certifies nothing).
        if not self.member_died(dead, f"member {sender} lost its connection to it"):
            raise FastPathError(f"member {sender} re-reduces slice {dead}, which we cannot")
        if self.repair.reducer != self.index:
            raise FastPathError(f"member {sender} sends slice {dead} to us, its re-reducer is {self.repair.reducer}")
        return self.repair.authenticate(Sender(sender, weight, pair_key, nonce, dead))

    async def serve(self, sock: socket.socket, sender: Sender) -> None:
        """Take the contribution to our slice of the ``sender`` that :meth:`authenticate` returned, and answer with
        the encoded average (or, for a dead member's slice, let the repair take it). A broken connection is the
        sender's death (:meth:`member_died`); any other failure is that member's and fails our slice."""
        task, ours = asyncio.current_task(), sender.slice == self.index
        self._serving.add(task)  # cancelled when our all-reduce ends: it may not write into the workspace after
        try:
            await (self._serve(sock, sender) if ours else self.repair.serve(sock, sender))
        except DataAuthError as e:  # the member's own connection carried bytes that are not its
            raise FastPathError(f"the part of member {sender.index} did not authenticate: {e}") from None
        except ConnectionError as e:  # (during a repair: a second death, which fails the all-reduce)
            if not ours or not self.member_died(sender.index, f"its connection to us broke: {e}"):
                raise
        finally:
            self._serving.discard(task)
            if ours:
                self.served += 1
                self._check_served()

    async def receive_part(self, sock, sender: Sender, into: torch.Tensor, also=None) -> None:
        """The sealed part ``sender`` sends on ``sock`` (its header already read), into ``into``."""
        await recv_sealed(Counted(sock, self, also), view_of(into), subkey(sender.pair_key, b"up", sender.nonce),
                          self.encrypt, self.chunk_timeout, self._touch)

    async def answer(self, sock, sender: Sender, encoded: torch.Tensor, also=None) -> None:
        """Send ``sender`` the encoded average of the slice it sent a part of."""
        sock, reply_nonce = Counted(sock, self, also), fresh_nonce()
        await send_all(sock, memoryview(REPLY.pack(0, reply_nonce, encoded.numel())), self.chunk_timeout)
        await send_sealed(sock, view_of(encoded), subkey(sender.pair_key, b"down", sender.nonce + reply_nonce),
                          self.encrypt, self.chunk_timeout)

    async def _serve(self, sock: socket.socket, sender: Sender) -> None:
        numel = self._numel(self.index)
        data = self.workspace.get(f"part{sender.index}", self.codec.payload_bytes(numel), torch.uint8)
        await self.receive_part(sock, sender, data)
        contribution = Contribution(sender.index, self.codec.decode(data, numel), sender.weight)
        # Its chunks' RMS now, off the event loop, while the other parts are still arriving and it is still in the
        # cache: after the last arrival the reduction only compares them (issue 18, point 6: measuring them there
        # made the sync ~20 % slower than before validation).
        self.chunk_rms[sender.index] = await self._in_thread(self._chunk_rms, contribution.tensor)
        self.contributions.append(contribution)
        self.contributed.add(sender.index)
        self._touch()
        await self._reduce_when_complete()
        await self.answer(sock, sender, await asyncio.shield(self.averaged))

    def _check_served(self) -> None:
        never = len(set(self.dead) - self.connected)  # dead before they connected: nobody to answer
        if self.served + never >= self.n - 1 and not self.all_served.done():
            self.all_served.set_result(None)

    async def _reduce_when_complete(self) -> None:
        """Reduce our slice once every live member's part is in (once)."""
        if self._reducing or self.averaged.done() or not set(range(self.n)) - set(self.dead) <= self.contributed:
            return
        self._reducing = True
        known_rms = dict(self.chunk_rms)  # (copies: the executor must not see the event loop add to them)
        contributions = [c for c in self.contributions if c.sender not in self.dead]
        encoded = await self._in_thread(self._reduce_slice, contributions, known_rms, "reduced")
        self.contributions = []
        if self.averaged.done():  # aborted meanwhile
            return
        if encoded is None:
            self.averaged.set_exception(FastPathError(f"no valid contribution to our slice: {self.excluded}"))
        else:
            self.averaged.set_result(encoded)

    def _reduce_slice(self, contributions: list[Contribution], known_rms: dict[int, list[float]],
                      out: str) -> torch.Tensor | None:
        """In a thread: validate and combine ``contributions`` (of one slice) chunk by chunk into the workspace's
        ``out``, so the extra memory is one chunk's, not the slice's (half the model in a group of two); the encoded
        aggregate, or None if a chunk had no valid contribution. Exclusions go to :attr:`excluded`."""
        contributions = sorted(contributions, key=lambda c: c.sender)  # same bytes whatever the arrival order
        numel = contributions[0].tensor.numel()
        # our own slice in place: a chunk is written once every contribution's chunk (ours: a view of it) was read
        reduced = self._slice(self.output, self.index) if out == "reduced" else self.workspace.get(out, numel)
        for start in range(0, numel, REDUCE_CHUNK):
            stop = min(start + REDUCE_CHUNK, numel)
            chunk = [Contribution(c.sender, c.tensor[start:stop], c.weight) for c in contributions]
            known = {sender: values[start // REDUCE_CHUNK] for sender, values in known_rms.items()}
            kept, excluded = validate(chunk, self.policy, stop - start, own=self.index, known_rms=known)
            for sender, reason in excluded.items():
                self.excluded.setdefault(sender, reason)
            if not kept:
                return None
            reduced[start:stop] = combine(kept, self.policy)
            self._touch()  # a long reduction is progress, not a silent peer (_wait_for_senders)
        return self.codec.encode(reduced)

    @staticmethod
    def _chunk_rms(t: torch.Tensor) -> list[float]:
        return [rms(t[start:start + REDUCE_CHUNK]) for start in range(0, t.numel(), REDUCE_CHUNK)]

    # ------------------------------------------------------------------------------------------ sender side
    def member_died(self, j: int, reason: str) -> bool:
        """Member ``j``'s connection broke: leave it out of our slice and re-reduce its slice among the survivors
        (slice_repair.py). False (and our all-reduce fails) if that cannot keep the result right: a second
        death, a group of two, or no source to re-read our part of its slice from."""
        if j in self.dead:
            return self.repair is not None
        self.dead[j] = reason
        failed = self.averaged.done() and self.averaged.exception() is not None
        if len(self.dead) > 1 or self.n < 3 or self.read_source is None or failed:
            self.abort(f"member {j} died ({reason}) and its slice cannot be re-reduced: {sorted(self.dead)} dead")
            return False
        self.repair = SliceRepair(self, j)
        self._repairing = asyncio.ensure_future(self.repair.take_part())
        self._check_served()
        self._serving.add(asyncio.ensure_future(self._reduce_when_complete()))  # (cancelled with our run)
        return True

    async def exchange(self, j: int, slice_: int, payload: memoryview, into: torch.Tensor, also=None) -> None:
        """Send reducer ``j`` our encoded ``payload`` of slice ``slice_`` and receive the slice's encoded average
        into ``into``. ConnectionError if the connection breaks (the reducer died, or aborted)."""
        try:
            raw = await connect(self.addresses[j], self.connect_timeout)
        except ConnectionRefusedError as e:
            raise ConnectionRefusedError(f"cannot connect to member {j} at {self.addresses[j]}: {e}") from None
        except (OSError, asyncio.TimeoutError) as e:
            raise FastPathError(f"cannot connect to member {j} at {self.addresses[j]}: {type(e).__name__}") from None
        sock = Counted(raw, self, also)
        try:
            pair_key, nonce = self._pair_key(self.index, j), fresh_nonce()
            header = MAGIC + self.key + INDICES.pack(self.index, j, self.weight, len(payload),
                                                     *self._layout(slice_)) + nonce
            header += tag(subkey(pair_key, b"hdr", nonce), header)
            await send_all(sock, memoryview(header), self.chunk_timeout)
            await send_sealed(sock, payload, subkey(pair_key, b"up", nonce), self.encrypt, self.chunk_timeout,
                              send=functools.partial(paced, delay=self.part_delay) if self.part_delay else send_all)
            # The reducer answers only once every member's part is in: allow for the slowest sender's transfer.
            reply = bytearray(REPLY.size)
            await recv_into(sock, memoryview(reply)[:1], self.wait_timeout)
            if reply[0] != 0:
                raise FastPathError(f"reducer {j} refused our part")
            await recv_into(sock, memoryview(reply)[1:], self.chunk_timeout)
            _, reply_nonce, length = REPLY.unpack(reply)
            if length != into.numel():
                raise FastPathError(f"reducer {j} answers {length} bytes, expected {into.numel()}")
            await recv_sealed(sock, view_of(into), subkey(pair_key, b"down", nonce + reply_nonce), self.encrypt,
                              self.chunk_timeout)
        except DataAuthError as e:
            raise FastPathError(f"the answer of reducer {j} did not authenticate: {e}") from None
        finally:
            raw.close()

    async def _send_to(self, j: int) -> None:
        data = self._receive_buffer(j)
        try:
            await self.exchange(j, j, view_of(self.codec.encode(self._slice(self.flat, j))), data)
        except ConnectionError as e:
            # The reducer hung up or is gone: it died (or aborted its slice, and then fails too).
            if not self.member_died(j, str(e) or type(e).__name__):
                # (a refused dial keeps its "cannot connect to member" text: averagers.py then falls back to libp2p)
                raise FastPathError(f"reducer {j} dropped our connection: {type(e).__name__}: {e}") from None
            return  # its slice comes from the repair
        self._decode_into(data, j)

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
                    missing = sorted(set(range(self.n)) - self.contributed - set(self.dead))
                    raise FastPathError(f"no part from members {missing} for {self.chunk_timeout:.0f} s") from None

    async def _own_slice(self) -> None:
        # We keep exactly what the others receive: the decoded bytes of our encoded average, not the exact one.
        if self.n == 1:
            await self._reduce_when_complete()
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
            self.averaged.exception()  # (retrieved: after our run() nobody waits on it)
        if self.repair is not None:
            self.repair.fail(reason)

    async def run(self, connect_timeout: float, wait_timeout: float) -> torch.Tensor:
        """Send our parts, reduce our slice, collect the averages; re-reduce the slice of a member that died. Raises
        on any other failure, or a second death."""
        self.wait_timeout, self.connect_timeout = wait_timeout, connect_timeout
        tasks = [asyncio.ensure_future(self._own_slice())]
        tasks += [asyncio.ensure_future(self._send_to(j)) for j in range(self.n) if j != self.index]
        try:
            await asyncio.gather(*tasks)
            if self._repairing is not None:  # (a member that died after our exchanges with it: it may be late)
                await self._repairing
        finally:
            for task in [*tasks, *self._serving, *([self._repairing] if self._repairing else [])]:
                task.cancel()
            self.abort("all-reduce finished or aborted")
            for task in tasks:  # retrieve exceptions so that asyncio does not log them as never retrieved
                if task.done() and not task.cancelled():
                    task.exception()
        return self.output
