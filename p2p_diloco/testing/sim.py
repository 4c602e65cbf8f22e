"""A deterministic simulation of time: many tasks (peers, their background syncs) in one process, on a virtual
clock that jumps from one event to the next, so that a scenario of minutes runs in milliseconds.

Every task is a real thread, but only one runs at a time: the one the scheduler hands control to. A task gives
control back only when it waits, through the :class:`SimClock` (``wait``, ``sleep``, a task's ``result``); the
scheduler then resumes the task whose wake-up comes first (ties in the order they were scheduled) and moves the
virtual clock to that moment. The same code thus always runs the same schedule: one seed, one run (the approach of
FoundationDB's simulation testing). Code under simulation must not block any other way (a thread's lock held
across a wait, ``time.sleep``, real IO that waits for another task): the scheduler notices a task that does not
give control back within ``resume_timeout`` real seconds and raises :class:`SimStuck` with its stack.

Faults act on *groups* of tasks (a peer and the background tasks it spawned): :meth:`Simulation.kill` makes each
task raise :class:`Killed` at its next wait (as SIGKILL would end a process: the task unwinds, and the fakes make
whatever it does meanwhile void), :meth:`Simulation.freeze` stops scheduling them until :meth:`Simulation.thaw`
(SIGSTOP / SIGCONT).
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
import traceback
from typing import Any, Callable, Hashable, TypeVar

T = TypeVar("T")
_TASK, _CALL = 0, 1


class Killed(BaseException):
    """Raised inside a task whose group was killed; it unwinds the task like the end of a process."""


class SimStuck(RuntimeError):
    """A task blocked outside the simulation (it kept control for too long in real time)."""


class SimEvent:
    """An event for tasks under simulation (``Clock.event()``): setting it wakes every task waiting for it."""

    def __init__(self, sim: Simulation):
        self._sim, self._set, self._waiters = sim, False, []

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, []
        for task, token in waiters:
            self._sim._wake(task, token)

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False

    def wait(self, timeout: float) -> bool:
        return self._sim.clock.wait(self, timeout)


class SimTask:
    """A function running as one task of the simulation (:meth:`Simulation.spawn`)."""

    def __init__(self, sim: Simulation, fn: Callable[[], Any], name: str, group: Hashable):
        self.sim, self.name, self.group = sim, name, group
        self.token: object = object()
        self.killed = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = SimEvent(sim)
        self.waiting_for = "start"
        self._go = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(fn,), name=f"sim:{name}", daemon=True)

    def _main(self, fn: Callable[[], Any]) -> None:
        self._go.wait()
        self._go.clear()
        try:
            if self.killed:
                raise Killed
            self.value = fn()
        except Killed:
            pass
        except BaseException as e:  # kept for result(); the scenario decides whether it is a failure
            self.error = e
        finally:
            self.waiting_for = "nothing (finished)"
            self.finished.set()
            self.sim._back.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def result(self) -> Any:
        """The task's return value (waiting for it first when called from another task); its exception is raised
        here. A killed task returns None."""
        if not self.done():
            self.sim.clock.wait(self.finished, float("inf"))
        if self.error is not None:
            raise self.error
        return self.value


class Simulation:
    """The scheduler and the virtual clock (:attr:`clock`). Use it as a context manager: leaving it kills every
    task still running, so no thread outlives the scenario.

    Args:
        epoch: ``clock.time()`` at virtual time 0.
        resume_timeout: real seconds a task may keep control before it is reported as stuck.
    """

    def __init__(self, epoch: float = 1_700_000_000.0, resume_timeout: float = 60.0):
        self.now, self.epoch, self.resume_timeout = 0.0, epoch, resume_timeout
        self.clock = SimClock(self)
        self.tasks: list[SimTask] = []
        self.current: SimTask | None = None
        self._heap: list[tuple] = []
        self._seq = itertools.count()
        self._back = threading.Event()
        self._frozen: set[Hashable] = set()
        self._parked: list[tuple] = []

    # ------------------------------------------------------------------------------------------------ tasks
    def spawn(self, fn: Callable[[], T], name: str, group: Hashable | None = None) -> SimTask:
        """Start ``fn`` as a task (at the current virtual time). Its group is ``group``, or the spawning task's,
        or its own name."""
        if group is None:
            group = self.current.group if self.current is not None else name
        task = SimTask(self, fn, name, group)
        self.tasks.append(task)
        task.thread.start()
        self._push(self.now, _TASK, task, task.token)
        return task

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``when``, between tasks (it must not wait)."""
        self._push(when, _CALL, fn, None)

    def kill(self, group: Hashable) -> None:
        """Every task of ``group`` raises :class:`Killed` at its next wait (at once if it is waiting now)."""
        for task in self.tasks:
            if task.group == group and not task.done():
                task.killed = True
                self._push(self.now, _TASK, task, task.token)

    def freeze(self, group: Hashable) -> None:
        """The tasks of ``group`` are not run until :meth:`thaw` (their timeouts wait too)."""
        self._frozen.add(group)

    def thaw(self, group: Hashable) -> None:
        self._frozen.discard(group)
        keep = []
        for entry in self._parked:
            if entry[3].group == group:
                self._push(max(entry[0], self.now), _TASK, entry[3], entry[4])
            else:
                keep.append(entry)
        self._parked = keep

    def frozen(self, group: Hashable) -> bool:
        return group in self._frozen

    # ------------------------------------------------------------------------------------------------- running
    def run(self, until: Callable[[], bool] | None = None, max_time: float = float("inf")) -> bool:
        """Run tasks and timed calls in order until ``until()`` holds (True), or nothing is left to run before
        ``max_time`` (False: every task finished, or waits for something that never comes)."""
        while not (until is not None and until()):
            entry = self._pop()
            if entry is None:
                return False
            if entry[0] > max_time:
                heapq.heappush(self._heap, entry)
                self.now = max(self.now, max_time)
                return False
            self.now = max(self.now, entry[0])
            if entry[2] == _CALL:
                entry[3]()
            else:
                self._resume(entry[3])
        return True

    def close(self) -> None:
        """Kill every task still running and let them unwind."""
        for task in self.tasks:
            if not task.done():
                task.killed = True
                self._push(self.now, _TASK, task, task.token)
        self._frozen.clear()
        self._parked.clear()
        self.run(until=lambda: all(t.done() for t in self.tasks))

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> str:
        """What every unfinished task waits for (for a failed scenario's message)."""
        return "; ".join(f"{t.name}: {t.waiting_for}" for t in self.tasks if not t.done()) or "no task left"

    # ------------------------------------------------------------------------------------------------- inside
    def _push(self, when: float, kind: int, obj: Any, token: object) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, obj, token))

    def _pop(self) -> tuple | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry[2] == _CALL:
                return entry
            task = entry[3]
            if entry[4] is not task.token or task.done():
                continue  # superseded: the task was woken another way since
            if task.group in self._frozen and not task.killed:
                self._parked.append(entry)
                continue
            return entry
        return None

    def _resume(self, task: SimTask) -> None:
        self.current = task
        self._back.clear()
        task._go.set()
        if not self._back.wait(self.resume_timeout):
            frame = sys._current_frames().get(task.thread.ident)
            stack = "".join(traceback.format_stack(frame)) if frame else "(no stack)"
            raise SimStuck(f"task {task.name} kept control for {self.resume_timeout} s: it blocks outside the "
                           f"simulation\n{stack}")
        self.current = None

    def _wake(self, task: SimTask, token: object) -> None:
        if task.token is token:
            self._push(self.now, _TASK, task, token)

    def _yield(self, wake_at: float | None, event: SimEvent | None, what: str) -> None:
        """Called by the running task: give control back until ``wake_at`` or until ``event`` is set."""
        task = self.current
        if task is None or threading.current_thread() is not task.thread:
            raise RuntimeError("only a task of the simulation can wait on its clock")
        if task.killed:
            raise Killed
        task.token = token = object()
        task.waiting_for = what
        if wake_at is not None:
            self._push(wake_at, _TASK, task, token)
        if event is not None:
            event._waiters.append((task, token))
        self._back.set()
        task._go.wait()
        task._go.clear()
        task.waiting_for = "running"
        if task.killed:
            raise Killed


class SimClock:
    """The :class:`~p2p_diloco.runtime.clock.Clock` of a :class:`Simulation`."""

    def __init__(self, sim: Simulation):
        self.sim = sim

    def monotonic(self) -> float:
        return self.sim.now

    def time(self) -> float:
        return self.sim.epoch + self.sim.now

    def event(self) -> SimEvent:
        return SimEvent(self.sim)

    def wait(self, event: SimEvent, timeout: float) -> bool:
        if event.is_set():
            return True
        wake = None if timeout == float("inf") else self.sim.now + max(0.0, timeout)
        self.sim._yield(wake, event, f"an event (timeout {timeout:.2f} s)")
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        self.sim._yield(self.sim.now + max(0.0, seconds), None, f"sleep {seconds:.2f} s")

    def spawn(self, fn: Callable[[], T], name: str) -> SimTask:
        return self.sim.spawn(fn, name)
