"""Time, waiting and background tasks, behind one small interface, so that the round protocol can run on the real
clock (a peer) or on a virtual one (:mod:`p2p_diloco.testing.sim`: many peers in one process, in milliseconds).

Everything the peer's driver does that takes time goes through its :class:`Clock`: reading the time, sleeping,
waiting for an event (a stop request) and running a task in the background. Nothing in the driver calls
``time.sleep`` or blocks on a thread itself.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Generic, Protocol, TypeVar

T = TypeVar("T")


class Event(Protocol):
    """What the driver needs of an event (``threading.Event`` is one)."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...


class Task(Protocol[T]):
    """A function running in the background (:meth:`Clock.spawn`)."""

    def done(self) -> bool: ...

    def result(self) -> T:
        """Wait until it has finished; its return value, or its exception raised here."""


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines)."""

    def time(self) -> float:
        """Seconds since the epoch (published in records, compared across peers)."""

    def event(self) -> Event:
        """A new event that :meth:`wait` can wait for."""

    def wait(self, event: Event, timeout: float) -> bool:
        """Sleep until ``event`` is set or ``timeout`` seconds have passed; True if it is set."""

    def spawn(self, fn: Callable[[], T], name: str) -> Task[T]:
        """Run ``fn`` in the background."""


class _Thread(Generic[T]):
    def __init__(self, fn: Callable[[], T], name: str):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to whoever asks for the result
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class RealClock:
    """The machine's clocks and threads."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def event(self) -> threading.Event:
        return threading.Event()

    def wait(self, event: Event, timeout: float) -> bool:
        return event.wait(max(0.0, timeout))  # type: ignore[attr-defined]

    def spawn(self, fn: Callable[[], T], name: str) -> Task[T]:
        return _Thread(fn, name)
