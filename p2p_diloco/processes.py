"""Process hygiene: a peer is several processes (main, DHT, averager, p2pd); none may outlive it.

hivemind forks the DHT and the averager and the DHT spawns the Go ``p2pd`` daemon. If the main process exits
without shutting them down they keep running (and an orphaned averager even keeps serving rounds), so every exit
path ends with :func:`reap_children`. Launchers put each peer in its own process group and kill the group.
"""

from __future__ import annotations

import os
import signal
import time

import psutil


def reap_children(timeout: float = 5.0) -> None:
    """Terminate, then kill, every descendant of this process that is still running.

    torch's ``torch_shm_manager`` is spared: it deletes the shared-memory files of our tensors (hivemind uses the
    file_system sharing strategy) once this process exits, and killing it first leaks them in /dev/shm.
    """
    try:
        children = [c for c in psutil.Process().children(recursive=True) if not c.name().startswith("torch_shm")]
    except psutil.Error:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to a whole process group, ignoring a group that is already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies included until reaped)."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def wait_group_gone(pgid: int, timeout: float) -> bool:
    """Poll until the process group is empty; returns False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return not group_alive(pgid)
