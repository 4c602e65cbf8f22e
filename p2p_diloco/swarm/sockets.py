"""Non-blocking socket IO of the direct-TCP data plane (fastpath.py, data_server.py, data_auth.py).

Zero-copy both ways: the kernel reads straight into the destination buffer and writes straight from the source,
and every wait is bounded, so a frozen or dead peer is detected in seconds.
"""

from __future__ import annotations

import asyncio
import socket

import torch



class FastPathError(RuntimeError):
    """The direct-TCP all-reduce (fastpath.py) failed; nothing may be applied."""


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A bound, listening TCP socket (created in the host process so the port is known before the fork)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


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
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that arrives in the loop
        # iteration its future completes in, and a cancelled reader would read on (tests/unit/test_sockets.py)
        async with asyncio.timeout(timeout):
            await waiter
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


async def send_all(sock: socket.socket, view: memoryview, timeout: float) -> None:
    """Send all of ``view`` (no copy), with at most ``timeout`` seconds without progress."""
    sent, n = 0, len(view)
    while sent < n:
        try:
            sent += sock.send(view[sent:])
        except (BlockingIOError, InterruptedError):
            await _ready(sock, True, timeout)


def view_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy."""
    return memoryview(t.numpy()).cast("B")


async def connect(address: str, timeout: float) -> socket.socket:
    """A tuned, connected socket to ``"host:port"`` within ``timeout`` seconds."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tune(sock)
    try:
        await asyncio.wait_for(asyncio.get_event_loop().sock_connect(sock, (host, int(port))), timeout)
    except BaseException:
        sock.close()
        raise
    return sock
