"""SIGINT and SIGTERM at every moment of a process's life, and the exit code of an interrupted command.

* **Start-up** (imports, config, model and data build, the DHT and averager start, waiting for the first round):
  nothing is worth saving yet, so the first signal aborts at once (:class:`Interrupted`); the caller's cleanup
  stops every process it started.
* **Running** (:meth:`StopSignals.running`): the first signal asks to stop at the next safe point (the end of the
  current step: a peer leaves the swarm and keeps its checkpoint); a second one interrupts at once.
* Once a signal has interrupted, later ones are ignored: the cleanup (bounded by its own timeouts) must not be cut
  short, or the DHT, averager and p2pd processes would outlive us (Ctrl-C is often pressed twice).
* An interrupted command exits with the shell's code for the signal, 128 + its number (130 for SIGINT, 143 for
  SIGTERM), after a clean shutdown: ``join``, ``swarm``, ``bootstrap`` and ``status --watch`` alike.

The processes hivemind forks (DHT, averager) must ignore SIGINT: Ctrl-C in a terminal signals the whole foreground
process group, and only the main process may act on it (it stops them in order). :func:`children_ignore_sigint`
makes the forks inherit an ignored SIGINT without ignoring it in this process for longer than the fork itself.
(``p2pd`` handles SIGINT itself whatever it inherits: it runs in a process group of its own, swarm/starting.py.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Iterator

log = logging.getLogger("p2p_diloco")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def interrupted_exit_code(signum: int) -> int:
    """The shell's exit code of a command ended by signal ``signum``: 128 + its number."""
    return 128 + int(signum)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by a stop signal that must act at once (during start-up, or a second signal).

    Attributes:
        signum: the signal that stopped the command (the first one received).
    """

    def __init__(self, signum: int, source: StopSignals | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.source = source  # the handlers that raised it (see _raise_swallowed_again)


def _raise_swallowed_again(unraisable) -> None:
    """``sys.unraisablehook``: an :class:`Interrupted` raised while Python ran a callback it cannot propagate from
    (a weakref callback, ``__del__``: seen in importlib's module-lock callback during the imports) is printed as
    "Exception ignored" and dropped, and the signal with it: the command went on as if nothing came (later signals
    were ignored, as during a cleanup). Raise it again in the main thread a moment later, out of the callback (if it
    lands in one again, this runs again). Not while the interpreter exits (atexit callbacks, finalization): the
    command is ending anyway."""
    exc = unraisable.exc_value
    exiting = sys.is_finalizing() or "atexit" in (unraisable.err_msg or "")
    if isinstance(exc, Interrupted) and not exiting:
        # the signal again, to the main thread (a wait there wakes up); sent from here, the handler would run inside
        # this hook, where the interrupt is dropped again
        retry = threading.Timer(RERAISE_DELAY, signal.pthread_kill, (threading.main_thread().ident, exc.signum))
        retry.daemon = True
        retry.start()
        if exc.source is not None:
            exc.source.interrupted = False  # no cleanup has run: let its handler raise once more
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook  # whatever was there first (install() takes its place once)
RERAISE_DELAY = 0.01  # seconds


class StopSignals:
    """The SIGINT/SIGTERM handlers of a command (module docstring); created in start-up mode.

    Args:
        stop: set by the first signal once :meth:`running`; a new event if None.
        quiet: log nothing when the first signal asks to stop (``status --watch``).
    """

    def __init__(self, stop: threading.Event | None = None, quiet: bool = False):
        self.stop = stop if stop is not None else threading.Event()
        self.quiet = quiet
        self.signum: int | None = None  # the first signal received
        self.starting = True
        self.interrupted = False  # an Interrupted was raised: the cleanup runs, later signals are ignored
        self._main_pid = os.getpid()

    def install(self) -> StopSignals:
        """Make these the process's SIGINT and SIGTERM handlers; returns self."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        sys.unraisablehook = _raise_swallowed_again  # passes everything else on to _previous_unraisablehook
        return self

    def running(self) -> None:
        """Start-up is over: from now on the first signal asks to stop at the next safe point."""
        self.starting = False

    @property
    def exit_code(self) -> int:
        """0 if no stop signal came, else the shell's code of the first one (:func:`interrupted_exit_code`)."""
        return 0 if self.signum is None else interrupted_exit_code(self.signum)

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._main_pid:
            # A child forked from this process inherited the handler (hivemind's processes are forks): SIGINT came
            # to the whole terminal group and is ours to act on; SIGTERM still ends the child as by default.
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.interrupted:
            return
        again = self.signum is not None
        if not again:
            self.signum = signum
        if self.starting or again:
            self.interrupted = True
            raise Interrupted(self.signum, self)
        if not self.quiet:
            log.warning("received %s: stopping after the current step (again: stop now)", signal.Signals(signum).name)
        self.stop.set()


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Fork inside this block: the children (and what they exec) start with SIGINT ignored.

    SIGINT is ignored in this process only while the block runs (a fork takes milliseconds); our own handler is
    back before anything waits for the children, so a Ctrl-C during a long start (p2pd trying to reach an
    unreachable peer) is seen at once. Only the main thread may change handlers: elsewhere the block does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
