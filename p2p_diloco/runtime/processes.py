"""Process hygiene: a peer is several processes (main, DHT, averager, p2pd); none may outlive it.

hivemind forks the DHT and the averager and the DHT spawns the Go ``p2pd`` daemon (in a process group of its own,
killed by the kernel when the DHT process dies: swarm/starting.py). If the main process exits
without shutting them down they keep running (and an orphaned averager even keeps serving rounds), so every exit
path ends with :func:`reap_children`. Launchers put each peer in its own process group and kill the group.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import psutil


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt() parameters
_KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Let glibc reuse freed large blocks instead of returning them to the kernel; returns True if applied.

    By default glibc serves every allocation above 128 KiB-32 MiB with a fresh ``mmap`` and unmaps it on free, so
    each new tensor of a pseudo-gradient's size (and every bytes object the data plane used to make) pays a page
    fault per 4 KiB: measured here, 18-20 ms for 40 MB against 2-3 ms to write memory that is already mapped. That
    was most of the sync's CPU (docs/performance.md). With both thresholds at 1 GiB, blocks below 1 GiB come from
    the heap, freed memory is kept for the next round (up to 1 GiB of free space at its top), and the resident
    size stays at the peak of a round instead of rising and falling. Applies to this process and to everything
    it forks later (the DHT and averager processes), so call it before starting them. A no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                          _KEEP_BYTES))
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False


_PR_SET_CHILD_SUBREAPER = 36  # prctl() option (Linux >= 3.4)


def adopt_orphans() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); returns True if applied.

    Killing a DHT process while it starts leaves the ``p2pd`` it was spawning running, re-parented to init, out of
    :func:`reap_children`'s sight (seen: a DHT process killed mid-start, its p2pd still alive). As a subreaper, this
    process gets such orphans as its own children, and :func:`reap_children` finds them. A no-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants() -> set[int]:
    """Pids of every descendant of this process now."""
    try:
        return {c.pid for c in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def reap_children(timeout: float = 5.0, only: set[int] | None = None) -> None:
    """Terminate, then kill, every descendant of this process that is still running (with ``only``: just those
    pids and their own descendants, so that processes other parts started, e.g. a W&B service, are left alone).

    torch's ``torch_shm_manager`` is spared: it deletes the shared-memory files of our tensors (hivemind uses the
    file_system sharing strategy) once this process exits, and killing it first leaks them in /dev/shm. Without
    ``only``, descendants orphaned meanwhile (a p2pd whose DHT process was just killed) come back to us as
    children (:func:`adopt_orphans`) and are reaped by a second pass.
    """
    for _ in range(1 if only is not None else 3):
        if not _reap_once(timeout, only):
            return


def _reap_once(timeout: float, only: set[int] | None) -> bool:
    """One pass of :func:`reap_children`; False if there was nothing to reap."""
    try:
        children = [c for c in psutil.Process().children(recursive=True) if not c.name().startswith("torch_shm")]
        if only is not None:
            targets = set(only)
            for c in children:
                if c.pid in only:
                    try:
                        targets |= {d.pid for d in c.children(recursive=True)}
                    except psutil.Error:
                        pass
            children = [c for c in children if c.pid in targets]
    except psutil.Error:
        return False
    if not children:
        return False
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
    return True


SHARED_MEMORY = Path("/dev/shm")  # where torch's file_system sharing strategy names its tensors' files


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to a whole process group, ignoring a group that is already gone.

    With SIGKILL, the shared-memory files of the group's live processes' tensors are deleted too. hivemind has torch
    share tensors through named files (the file_system strategy). torch's ``torch_shm_manager`` (a process of its
    own group) deletes them 2 s after its last client is gone, but not if it is killed in those 2 s (the tests'
    reaper did, until it spared the manager: tests/conftest.py), and then they stay in /dev/shm, in memory, until the
    machine restarts; here they go at once, whatever happens to the manager.
    """
    members = group_members(pgid) if sig == signal.SIGKILL else []
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    remove_shared_tensors(members)


def group_members(pgid: int) -> list[int]:
    """Pids of the processes of group ``pgid`` now."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid:
                members.append(pid)
        except OSError:
            pass
    return members


def remove_shared_tensors(pids: list[int]) -> None:
    """Delete the shared-memory files that torch named after these (killed) processes: ``torch_<pid>_*``. A mapping
    that a process still holds stays valid; only the name goes."""
    for pid in pids:
        for path in SHARED_MEMORY.glob(f"torch_{pid}_*"):
            try:
                path.unlink()
            except OSError:
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
