"""The data port of the direct-TCP data plane (:mod:`~p2p_diloco.swarm.fastpath`): accepts the members'
connections in the averager process, routes each to its group's :class:`~p2p_diloco.swarm.fastpath.FastAllReduce`,
and bounds what anyone else can hold there."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket

from .data_auth import DataAuthError
from .fastpath import HEADER_SIZE, MAGIC, FastAllReduce
from .sockets import recv_into, tune

log = logging.getLogger("p2p_diloco.swarm")

# What a stranger can hold on our data port (issue 18): a connection is *pending* from its accept until a
# registered all-reduce of ours takes it (its header names a group we are in). Pending connections are capped in
# all and per remote address, and a header must arrive whole within HEADER_TIMEOUT, so that idle or trickling
# connections (slow-loris) cannot exhaust our file descriptors and shut out a group's members. Per address: a
# reducer takes one connection from each other member at once, and a local swarm's members share 127.0.0.1.
# When all MAX_PENDING are held, a new connection evicts the oldest pending one instead of being refused: headers
# naming made-up groups wait for a registration that never comes, and would otherwise hold every slot for the
# whole register timeout while the members' connections, which a registered all-reduce takes as soon as their
# header is in, were turned away at accept.
HEADER_TIMEOUT = 5.0
MAX_PENDING = 128
MAX_PENDING_PER_ADDRESS = 64


class DataServer:
    """Accepts data-plane connections in the averager process and routes them to their group's all-reduce."""

    def __init__(self, sock: socket.socket, register_timeout: float, max_pending: int = MAX_PENDING,
                 max_pending_per_address: int = MAX_PENDING_PER_ADDRESS, header_timeout: float = HEADER_TIMEOUT):
        self.sock, self.register_timeout = sock, register_timeout
        self.max_pending, self.max_pending_per_address = max_pending, max_pending_per_address
        self.header_timeout = header_timeout
        self.groups: dict[bytes, asyncio.Future] = {}
        self._accepting: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()
        self.pending: collections.Counter[str] = collections.Counter()  # remote address -> pending connections
        self._pending_tasks: dict[asyncio.Task, str] = {}  # the pending connections' tasks, oldest first
        self._waiters: collections.Counter[bytes] = collections.Counter()  # group key -> connections waiting for it
        self.refused = 0  # connections closed at accept: over the per-address cap
        self.evicted = 0  # pending connections closed to make room for a new one (over the total cap)
        self.unauthenticated = 0  # connections dropped because their header was not a member's

    async def start(self) -> None:
        self.sock.setblocking(False)
        self._accepting = asyncio.ensure_future(self._accept_forever())

    async def close(self) -> None:
        """Stop accepting and drop every open connection (tests; the averager process just exits)."""
        for task in [self._accepting, *self._handlers]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._accepting, *self._handlers] if t], return_exceptions=True)
        self.sock.close()

    async def _accept_forever(self) -> None:
        loop = asyncio.get_event_loop()
        while True:
            try:
                conn, remote = await loop.sock_accept(self.sock)
            except OSError:  # e.g. too many open files: back off instead of spinning
                await asyncio.sleep(0.1)
                continue
            address = remote[0] if isinstance(remote, tuple) else str(remote)
            if self.pending[address] >= self.max_pending_per_address:
                self.refused += 1
                conn.close()
                continue
            if len(self._pending_tasks) >= self.max_pending:
                oldest = next(iter(self._pending_tasks))
                self._release(oldest)  # counted free at once: its socket closes when the task wakes up, cancelled
                oldest.cancel()
                self.evicted += 1
            self.pending[address] += 1
            tune(conn)
            task = asyncio.ensure_future(self._on_connection(conn, address))
            self._pending_tasks[task] = address
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

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

    async def _on_connection(self, conn: socket.socket, address: str) -> None:
        key, allreduce, me = None, None, asyncio.current_task()
        try:
            header = bytearray(HEADER_SIZE)
            # the whole header within header_timeout (a deadline in total, not between bytes: slow-loris). (With
            # asyncio.timeout here instead, an evicted handler was later found waiting in _registered's wait_for
            # with its cancellation pending, in 6 runs of 6 of test_headers_for_made_up_groups_cannot_shut_the_
            # members_out; not understood, so wait_for stays: recv_into itself no longer drops a cancellation.)
            await asyncio.wait_for(recv_into(conn, memoryview(header), self.header_timeout), self.header_timeout)
            if header[:len(MAGIC)] != MAGIC:
                return
            key = bytes(header[len(MAGIC):len(MAGIC) + 16])
            allreduce = await self._registered(key)
            sender = allreduce.authenticate(bytes(header))  # DataAuthError: not a member's, or not its first
            self._release(me)  # a member of one of our groups: no longer a stranger's connection
            await allreduce.serve(conn, sender)
        except DataAuthError as e:  # someone else's bytes: drop them; the member it named may still come
            self.unauthenticated += 1
            log.warning("dropped a data-plane connection from %s: %s", address, e)
        except Exception as e:  # a timeout, a socket error, a FastPathError, or a bug: fail fast, never hang
            if allreduce is not None:  # a member's part is lost: our slice can never be complete
                allreduce.abort(f"a sender's part was lost: {type(e).__name__}: {e}")
        finally:
            self._release(me)
            conn.close()

    async def _registered(self, key: bytes) -> FastAllReduce:
        """The all-reduce registered under ``key``, waited for at most ``register_timeout``. A key that nobody
        registered is forgotten when its last waiter leaves (timed out, or evicted): made-up keys leave nothing."""
        slot = self._slot(key)
        self._waiters[key] += 1
        try:
            return await asyncio.wait_for(asyncio.shield(slot), self.register_timeout)
        finally:
            self._waiters[key] -= 1
            if self._waiters[key] <= 0:
                del self._waiters[key]
                if not slot.done() and self.groups.get(key) is slot:
                    self.groups.pop(key).cancel()

    def _release(self, task: asyncio.Task) -> None:
        """No longer count ``task``'s connection as pending (once: later calls do nothing)."""
        address = self._pending_tasks.pop(task, None)
        if address is None:
            return
        self.pending[address] -= 1
        if self.pending[address] <= 0:
            del self.pending[address]
