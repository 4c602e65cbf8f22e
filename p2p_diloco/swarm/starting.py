"""Starting hivemind's processes so that Ctrl-C keeps working, and saying why a start failed.

hivemind starts a DHT or an averager by forking a process and waiting for it to be ready; the DHT's process then
starts the Go ``p2pd``, which may spend seconds trying to reach the initial peers. The forks must ignore SIGINT
(only our main process acts on Ctrl-C: see :mod:`p2p_diloco.runtime.signals`), but the wait must not: so the
process is forked with SIGINT ignored and waited for with our own handlers in place. hivemind's
``DecentralizedAverager.run_in_background`` would instead set SIGINT to ``SIG_IGN`` in *this* process for good;
it is not used.

``p2pd`` cannot ignore SIGINT: it is started by uvloop, whose libuv resets every signal to its default action in
the child before ``exec``, and p2pd asks Go for SIGINT itself (started with SIGINT ignored, it had a handler 0.1 s
later: /proc/<pid>/status). So it died at the first Ctrl-C in a terminal, in the middle of the round the peer was
finishing. It is therefore started through a small script that moves it out of the terminal's process group (Ctrl-C
signals only the foreground group) and asks the kernel to kill it when the DHT process that started it dies
(``PR_SET_PDEATHSIG``), since a kill of the peer's process group no longer reaches it; then execs the real p2pd.

The DHT and averager processes die with the main process the same way (:func:`children_die_with_us`): a
``kill -9`` of the main process alone (the OOM killer picks one process) left them all running, orphaned, p2pd
still accepting dials (measured: DHT, averager and p2pd alive and listening 8 s after the kill, and for good),
so other peers saw a dead peer answer (a libp2p dial or a TCP connect succeeded) and its orphaned averager could
still join rounds. Now they are gone within milliseconds of the kill, and a dial of the dead peer's address is
refused at once (swarm/probe.py relies on it).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import os
import re
import shlex
import signal
import shutil
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import hivemind

from ..errors import SwarmError
from ..runtime.processes import reap_children
from ..runtime.signals import children_ignore_sigint

log = logging.getLogger("p2p_diloco.swarm")


def one_line(e: BaseException) -> str:
    """A short single-line reason from hivemind's (often multi-line, timestamped) exception texts."""
    text = " ".join(str(e).split()) or type(e).__name__
    return re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", text)[:300]


# argv: the parent's pid when the script started, the real p2pd, its arguments (1: PR_SET_PDEATHSIG)
_P2PD_LAUNCH = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                "os.getppid() == int(sys.argv[1]) or os._exit(1); os.setpgid(0, 0); "
                "os.execv(sys.argv[2], sys.argv[2:])")
_P2PD_SHIM = ("#!/bin/sh\n# p2p-diloco: p2pd outside the terminal's process group (Ctrl-C is for our main process, "
              "which stops p2pd in order), killed with the process that started it\n"
              "exec {python} -S -c {code} \"$PPID\" {real} \"$@\"\n")
_shim_dir: Path | None = None


def keep_ctrl_c_from_p2pd() -> bool:
    """Make hivemind start ``p2pd`` through a script that keeps Ctrl-C from it (module docstring), in this process
    and its later forks; True if in place. Idempotent. Off Linux, or where no script can be run from the temporary
    directory (mounted ``noexec``), p2pd is started as before."""
    global _shim_dir
    from hivemind.p2p import p2p_daemon

    if _shim_dir is not None:
        return True
    if not sys.platform.startswith("linux"):  # PR_SET_PDEATHSIG is Linux's
        return False
    try:
        with resources.path(p2p_daemon.cli, p2p_daemon.P2PD_FILENAME) as real:
            real = Path(real)
        directory = Path(tempfile.mkdtemp(prefix="p2p-diloco-p2pd-"))
        if os.statvfs(directory).f_flag & os.ST_NOEXEC:
            shutil.rmtree(directory, ignore_errors=True)
            return False
        shim = directory / p2p_daemon.P2PD_FILENAME
        shim.write_text(_P2PD_SHIM.format(python=shlex.quote(sys.executable), code=shlex.quote(_P2PD_LAUNCH),
                                          real=shlex.quote(str(real))))
        shim.chmod(0o700)
    except OSError as e:
        log.debug("p2pd stays in our process group (a Ctrl-C ends it): %r", e)
        return False
    _shim_dir = directory
    atexit.register(shutil.rmtree, directory, True)  # p2pd has long been exec'd by then

    @contextlib.contextmanager
    def path(package, name) -> Iterator[Path]:
        if name == p2p_daemon.P2PD_FILENAME:
            yield shim
        else:
            with resources.path(package, name) as found:
                yield found

    p2p_daemon.path = path  # the only use of this name in hivemind: P2P.create finding the binary
    return True


_PR_SET_PDEATHSIG = 1  # prctl() option
_die_with: int | None = None  # set around our forks: the pid whose death must kill the child being forked


def _die_with_parent() -> None:
    """Runs in every child this process forks (``os.register_at_fork``): inside :func:`children_die_with_us`,
    ask the kernel for SIGKILL when the parent dies, and exit at once if it already died before the ask."""
    global _die_with
    parent, _die_with = _die_with, None  # the child's own forks (p2pd is started by the DHT process) are not ours
    if parent is None:
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def children_die_with_us() -> Iterator[None]:
    """Fork inside this block: the children are killed by the kernel when this process dies, however it dies
    (module docstring). Linux only, and only from the main thread: the kernel sends the signal when the *thread*
    that forked the child ends, and only the main thread lives as long as the process."""
    global _die_with
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        yield
        return
    _register_fork_hook()
    _die_with = os.getpid()
    try:
        yield
    finally:
        _die_with = None


_hooked = False


def _register_fork_hook() -> None:
    global _hooked
    if not _hooked:
        os.register_at_fork(after_in_child=_die_with_parent)
        _hooked = True


PIPE_LOCK_TIMEOUT = 30.0  # seconds a DHT command waits for another process's command to be written


class _SerializedPipe:
    """The sending end of a DHT's command pipe, written by one process at a time (see
    :func:`serialize_command_pipe`); everything else is the pipe's own."""

    def __init__(self, conn, lock):
        self._conn, self._lock = conn, lock

    def send(self, message) -> None:
        if not self._lock.acquire(timeout=PIPE_LOCK_TIMEOUT):
            raise TimeoutError(f"the DHT's command pipe stayed busy for {PIPE_LOCK_TIMEOUT:.0f} s")
        try:
            self._conn.send(message)
        finally:
            self._lock.release()

    def __getattr__(self, name):
        return getattr(self._conn, name)


def serialize_command_pipe(dht: hivemind.DHT) -> None:
    """Make every process that forks from ours after this (the averager) write ``dht``'s commands one at a time.

    Why: hivemind sends every DHT command (``store``, ``get``, ``run_coroutine``) down one pipe, which our process
    and the averager process (forked, holding the same pipe) both write; ``multiprocessing`` writes a large message
    as several writes, so two processes writing at once interleave them and the DHT process dies unpickling
    garbage (``UnpicklingError: invalid load key``; seen 3 times in two 16-peer chaos runs). Reproduced: 3 forked
    processes storing 30 KB values at once killed the DHT within seconds; with this lock, shared by every process
    through the fork, all 180 stores succeed (tests/swarm/test_records.py). Threads of one process go through it
    too."""
    if not isinstance(dht._outer_pipe, _SerializedPipe):
        dht._outer_pipe = _SerializedPipe(dht._outer_pipe, multiprocessing.get_context("fork").Lock())


async def _blocking_command_pipe(dht: hivemind.DHT, node) -> bool:
    """Run inside the DHT process: make its end of the command pipe blocking again (see fix_command_pipe)."""
    os.set_blocking(dht._inner_pipe.fileno(), True)
    return os.get_blocking(dht._inner_pipe.fileno())


def fix_command_pipe(dht: hivemind.DHT, timeout: float = 15.0) -> None:
    """Let ``dht`` take commands larger than 16 KiB (a ``put_blob`` of a certificate) without dying.

    hivemind's DHT process reads its command pipe after uvloop's ``add_reader`` made it non-blocking, while
    ``multiprocessing`` writes a message over 16 KiB as two writes (header, then payload): the reader gets
    ``BlockingIOError`` mid-message, the command is lost (its caller times out) and the stream is out of step; the
    next read can unpickle garbage and end the DHT process (``EOFError``/``UnpicklingError`` are not caught there).
    Measured here: a single 40-65 KB ``store`` failed or killed the DHT in about half the tries; with the pipe
    blocking, 60 stores of 40 KB to 1 MB all succeeded. (Several *processes* writing at once, ours and the
    averager's, interleaved messages too: starting.serialize_command_pipe.)"""
    if not dht.run_coroutine(_blocking_command_pipe, return_future=True).result(timeout=timeout):
        raise SwarmError("could not make the DHT's command pipe blocking")


def start_dht(initial_peers_wait: float = 0.0, **kwargs) -> hivemind.DHT:
    """A started, ready DHT.

    Any failure or interruption (a stop signal raises in the wait) stops whatever was started, p2pd included,
    before it propagates.

    Args:
        initial_peers_wait: with a value > 0, a start that failed only because no initial peer answered is tried
            again until that many seconds have passed (:func:`retry_delay`): for peers started together with their
            initial peer, which is not listening yet.
        **kwargs: ``hivemind.DHT``'s (``start``/``await_ready`` are ours to set).

    Returns:
        The DHT, its process running and its command pipe made safe (:func:`serialize_command_pipe`).
    """
    return with_retries(lambda: _start_dht_once(**kwargs), initial_peers_wait)


def _start_dht_once(**kwargs) -> hivemind.DHT:
    keep_ctrl_c_from_p2pd()
    dht = hivemind.DHT(start=False, **kwargs)
    try:
        with children_ignore_sigint(), children_die_with_us():
            dht.start()
        dht.wait_until_ready()  # bounded by p2pd's startup_timeout; a stop signal raises here
    except Exception:
        # The DHT process reported its failure and is ending: let it. Killed right after the report, it could still
        # hold hivemind's lock for such reports (MPFuture._update_lock, shared by every process we fork), and the
        # next DHT process we start would block on it for good (seen when the start was tried again).
        try:
            if dht.is_alive():
                dht.join(FAILED_EXIT_WAIT)
        finally:  # a stop signal during that wait too
            reap_children(timeout=5.0)
        raise
    except BaseException:  # a stop signal: nothing to wait for
        reap_children(timeout=5.0)
        raise
    serialize_command_pipe(dht)
    return dht


FAILED_EXIT_WAIT = 5.0  # seconds a DHT process that failed to start gets to end by itself
# What hivemind says when no initial peer answered: p2pd could not dial any (nothing listens there yet, or it is
# unreachable), or p2pd connected but no DHT node answered its ping (the peer's DHT was not serving yet).
UNANSWERED = ("failed to connect to bootstrap peers", "none of the initial_peers responded")
FIRST_RETRY, MAX_RETRY = 0.25, 2.0  # seconds between tries of the initial peers: doubling from the first


def retry_delay(reason: str, tries: int, left: float) -> float | None:
    """Whether to try the initial peers again after a failed start, and after how long.

    Args:
        reason: the failure's one line (:func:`one_line`).
        tries: how many starts failed so far (>= 1).
        left: seconds left of ``swarm.initial_peers_wait``.

    Returns:
        Seconds to sleep before the next try, or None to give up: any other failure (a bad address, a port in use,
        an identity taken) fails at once, and so does everything once the wait is over.
    """
    if left <= 0 or not any(text in reason for text in UNANSWERED):
        return None
    return min(FIRST_RETRY * 2 ** min(tries - 1, 16), MAX_RETRY, left)  # (2 ** 1024 would not fit a float)


T = TypeVar("T")


def with_retries(start: Callable[[], T], wait: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """``start()``, tried again as :func:`retry_delay` says.

    Args:
        start: what to try; its exceptions are the failures (a stop signal's ``KeyboardInterrupt`` is not one).
        wait: seconds to keep trying (``swarm.initial_peers_wait``).
        clock, sleep: the time source and the wait between tries (tests give virtual ones).

    Returns:
        ``start()``'s first result; its last failure propagates.
    """
    deadline, tries = clock() + wait, 0
    while True:
        try:
            return start()
        except Exception as e:
            tries += 1
            delay = retry_delay(one_line(e), tries, deadline - clock())
            if delay is None:
                raise
            if tries == 1:
                log.info("no initial peer answered yet: trying again for up to %.0f s", deadline - clock())
            sleep(delay)  # a stop signal raises here


def start_process(process, timeout: float) -> None:
    """Start a hivemind averager (or any ``mp.Process`` with ``wait_until_ready``) the way :func:`start_dht`
    starts a DHT: forked with SIGINT ignored, waited for with our handlers in place."""
    with children_ignore_sigint(), children_die_with_us():
        process.start()
    process.wait_until_ready(timeout)


def start_failure(e: BaseException, initial_peers: Sequence[str], what: str, waited: float = 0.0) -> str:
    """One line saying why a DHT did not start (``what``: e.g. "could not start or join the swarm"), and what to
    check when it could not reach its initial peers (``waited``: the ``swarm.initial_peers_wait`` it had)."""
    reason = one_line(e)
    if any(text in reason for text in UNANSWERED) and initial_peers:
        within = f" within {waited:g} s" if waited > 0 else ""
        return (f"{what}: no initial peer answered{within} (tried {' '.join(initial_peers)}): check that a peer runs "
                f"there, that the address and port are right and reachable from this machine (firewall, NAT), and "
                f"that the /p2p/ id is the one that peer printed")
    return f"{what}: {reason}"


def dht_rpc_timeout(peer_ttl: float) -> float:
    """How long our DHT node waits for one kademlia RPC (hivemind's ``wait_timeout``, 3 s by default).

    A frozen or unreachable DHT node stalls every store and read that routes through it until the RPC times out,
    and a store waits twice (the search for the nearest nodes, then the store itself: measured 2 x wait_timeout), after
    which hivemind blacklists the node for a while. With hivemind's 3 s that stall is 6 s = ``swarm.peer_ttl``: every
    live record of the run expired at once during it (measured with 4 DHT nodes, one SIGSTOPped: both readers saw
    no record at all for a second, so survivors lost each other and a round). A quarter of the record lifetime keeps
    the stall (2 RPCs) plus one heartbeat well inside it; capped at hivemind's own 3 s for long lifetimes.
    """
    return min(3.0, peer_ttl / 4)
