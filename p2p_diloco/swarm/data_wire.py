"""The frames of the direct-TCP data plane (fastpath.py) and the small parts its all-reduce and repair share.

Protocol, one connection per (sender, reducer) pair, opened by the sender to the address the reducer signed:

* sender -> reducer: the header ``MAGIC | route | sender index | reducer index | weight | payload bytes | the
  slice (start, stop, vector length) | nonce | tag``, where ``route`` names the group on the reducer's port (a hash
  of the group id) and ``tag`` is a Poly1305 tag under the (sender, reducer) pair key and ``nonce``: the reducer
  knows who sends before it takes a byte of payload, and drops a header that does not authenticate without failing
  the group. The slice is the reducer's own, or a dead member's sent to its re-reducer (slice_repair.py). Then the
  sender's part of that slice, encoded with the run's codec and sealed (a tag, or encrypted in chunks with
  ``swarm.encrypt_data``).
* reducer -> sender: ``status | reducer's nonce | payload bytes`` and the weighted average of the slice, encoded
  once and sealed under a key of both nonces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import socket
import struct
from typing import NamedTuple

from .data_auth import NONCE, TAG
from .sockets import send_all

MAGIC = b"P2PDILOCO2"
# sender, reducer, weight, payload bytes, and the reducer's slice as the sender cuts the vector (start, stop, length)
INDICES = struct.Struct("!HHdQQQQ")
HEADER_SIZE = len(MAGIC) + 16 + INDICES.size + NONCE + TAG
REPLY = struct.Struct(f"!B{NONCE}sQ")  # status (0 = ok), the reducer's nonce, payload bytes (status read alone)
_threads: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, pool): see executor


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The data plane's own thread pool (one per process: a forked child makes its own). Its jobs are tracked as
    the pool's futures, which are done only once the thread is: asyncio's wrapper of a job is done as soon as the
    task awaiting it is cancelled, while the thread may still be writing into the workspace."""
    global _threads
    if _threads is None or _threads[0] != os.getpid():
        _threads = (os.getpid(), concurrent.futures.ThreadPoolExecutor(thread_name_prefix="p2p-diloco-data"))
    return _threads[1]


class Sender(NamedTuple):
    """A sender that authenticated its connection's header (``FastAllReduce.authenticate``)."""

    index: int
    weight: float
    pair_key: bytes
    nonce: bytes
    slice: int  # whose slice its part is of: the reducer's own, or a dead member's (slice_repair.py)


class Counted:
    """One of an all-reduce's connections, counting into its runner's ``bytes_sent`` / ``bytes_received`` every
    byte the kernel takes from us or gives us, as it moves: a failed all-reduce then knows exactly what it had
    sent and received (a count after each whole message missed the message cut off). Has what the socket IO of
    sockets.py and data_auth.py uses: ``send``, ``recv_into``, ``fileno``."""

    __slots__ = ("_sock", "_runner", "_also")

    def __init__(self, sock: socket.socket, runner, also=None):
        self._sock, self._runner, self._also = sock, runner, also  # also: a repair's count of resent bytes

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, data) -> int:
        k = self._sock.send(data)
        self._runner.bytes_sent += k
        if self._also is not None:
            self._also.bytes_sent += k
        return k

    def recv_into(self, view) -> int:
        k = self._sock.recv_into(view)
        self._runner.bytes_received += k
        if self._also is not None:
            self._also.bytes_received += k
        return k


def group_key(group_id: bytes) -> bytes:
    """The routing key of a group on the data plane (the group id itself is never sent)."""
    return hashlib.sha256(b"p2p-diloco data plane" + group_id).digest()[:16]


async def paced(sock, view: memoryview, timeout: float, delay: float) -> None:
    """Fault tests only (``part_delay``): send 16 KiB at a time, ``delay`` s apart, so that a signal lands in the
    middle of a transfer."""
    for start in range(0, len(view), 2**14):
        await asyncio.sleep(delay)
        await send_all(sock, view[start:start + 2**14], timeout)
