"""The data plane's socket waits (swarm/sockets.py) obey cancellation.

Python 3.11's ``asyncio.wait_for`` returns the result of a future that completed in the same loop iteration as the
cancellation of its caller, dropping the cancellation. ``recv_into`` waited that way, so a data-server handler
cancelled (evicted, or the server closing) just as its stranger hung up went on reading, failed with
ConnectionResetError, and its task's exception was never retrieved: asyncio logs such tasks when they are garbage
collected, and the traceback formatting that logging does (``ast.parse`` of the failing line) inside another
``ast.parse`` that the collection interrupted broke CPython's shared AST recursion counter. CI saw it as
"SystemError: AST constructor recursion depth mismatch" in an unrelated test of the same worker.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from p2p_diloco.swarm.sockets import recv_into

pytestmark = pytest.mark.unit


async def _cancelled_after(iterations: int) -> tuple[bool, BaseException | None]:
    """Cancel a ``recv_into`` waiting on a socket ``iterations`` loop iterations after its peer hung up: whether
    the cancel was taken (the task not done yet) and what the task ended with."""
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        task = asyncio.ensure_future(recv_into(a, memoryview(bytearray(8)), 5.0))
        await asyncio.sleep(0.01)  # waiting for bytes
        b.close()
        for _ in range(max(iterations, 0)):
            await asyncio.sleep(0)
        taken = task.cancel()
        try:
            await task
        except BaseException as e:  # noqa: BLE001 - what the task ended with is the result
            return taken, e
        return taken, None
    finally:
        a.close()


@pytest.mark.parametrize("iterations", range(6))
def test_a_cancelled_recv_raises_cancelled_even_when_its_peer_hangs_up_in_the_same_iteration(iterations):
    taken, ended = asyncio.run(_cancelled_after(iterations))
    if taken:  # the cancel reached a task still waiting: it must end cancelled, never read on
        assert isinstance(ended, asyncio.CancelledError), repr(ended)
    else:  # it had already seen the hang-up
        assert isinstance(ended, ConnectionResetError), repr(ended)
