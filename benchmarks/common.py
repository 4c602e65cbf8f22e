"""Code shared by the benchmarks: running ``p2p-diloco swarm`` as a child that is always stopped cleanly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from p2p_diloco.runtime.peer_process import PeerProcess, stop_all

# ``p2p-diloco swarm`` stops its peers within its own grace (40 s) plus the group clean-up (up to 20 s per peer).
SWARM_STOP_GRACE = 120.0


@contextlib.contextmanager
def swarm_process(args: Sequence[str], log: Path) -> Iterator[PeerProcess]:
    """Run ``p2p-diloco swarm ARGS`` in its own session while the ``with`` block runs, and stop it whatever happens.

    On leaving the block (normally, on a timeout, on Ctrl-C) a launcher still running gets SIGTERM, which it
    handles as Ctrl-C: it stops every peer and prints its table. Whatever is left of its process group is then
    killed (its peers live in their own sessions: the launcher's own stop is what ends them).

    Args:
        args: the arguments after ``swarm``.
        log: the launcher's stderr, then (once it is done) its stdout.

    Yields:
        The launcher's process.
    """
    proc = PeerProcess(["swarm", *args], stderr=log)
    try:
        yield proc
    finally:
        stop_all([proc], grace=SWARM_STOP_GRACE)
        proc.wait_output(5)
        with open(log, "a") as f:
            f.write("".join(proc.lines))


def run_swarm(args: Sequence[str], log: Path, timeout: float) -> int:
    """Run ``p2p-diloco swarm ARGS`` to its end (see :func:`swarm_process`) and return its exit code.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` s (it was stopped).
    """
    with swarm_process(args, log) as proc:
        return proc.wait(timeout)
