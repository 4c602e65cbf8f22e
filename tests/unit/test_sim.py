"""The deterministic simulation the protocol scenarios run on (p2p_diloco/testing/sim.py)."""

from __future__ import annotations

import threading

import pytest

from p2p_diloco.testing.sim import SimStuck, Simulation

pytestmark = pytest.mark.unit


def _schedule(seed_delays):
    """Three tasks sleeping and waiting on each other; the order of what they log is the schedule."""
    log = []
    with Simulation() as sim:
        clock, go = sim.clock, sim.clock.event()

        def worker(name, delay):
            for i in range(3):
                clock.sleep(delay)
                log.append((round(clock.monotonic(), 3), name, i))
            if name == "a":
                go.set()
            else:
                clock.wait(go, 100.0)
                log.append((round(clock.monotonic(), 3), name, "woken"))

        for name, delay in seed_delays:
            sim.spawn(lambda n=name, d=delay: worker(n, d), name)
        sim.run()
    return log


def test_the_same_scenario_runs_the_same_schedule():
    delays = [("a", 0.3), ("b", 0.1), ("c", 0.2)]
    first = _schedule(delays)
    assert first == _schedule(delays)
    assert first[-2:] == [(0.9, "b", "woken"), (0.9, "c", "woken")]  # woken at the moment a sets the event
    assert [t for t, *_ in first] == sorted(t for t, *_ in first)  # virtual time never goes back


def test_freeze_holds_a_group_and_kill_unwinds_it():
    with Simulation() as sim:
        beats, cleaned = [], []

        def loop():
            try:
                while True:
                    sim.clock.sleep(1.0)
                    beats.append(sim.clock.monotonic())
            finally:
                cleaned.append(True)

        task = sim.spawn(loop, "beat", group="p")
        sim.call_at(3.5, lambda: sim.freeze("p"))
        sim.call_at(10.5, lambda: sim.thaw("p"))
        sim.call_at(12.2, lambda: sim.kill("p"))
        sim.run(until=task.done)
        assert beats == [1.0, 2.0, 3.0, 10.5, 11.5]  # nothing while frozen; the wake-up due at 4 comes at the thaw
        assert cleaned == [True] and task.killed and task.result() is None


def test_a_task_spawned_by_a_task_joins_its_group_and_returns_its_result():
    with Simulation() as sim:
        def parent():
            child = sim.clock.spawn(lambda: (sim.clock.sleep(2.0), 42)[1], "child")
            return child.result(), child.group

        task = sim.spawn(parent, "parent", group="g")
        sim.run(until=task.done)
        assert task.result() == (42, "g") and sim.now == 2.0


def test_an_exception_in_a_task_is_raised_by_its_result():
    with Simulation() as sim:
        task = sim.spawn(lambda: 1 / 0, "boom")
        sim.run()
        with pytest.raises(ZeroDivisionError):
            task.result()


def test_a_task_that_blocks_outside_the_simulation_is_reported():
    blocker = threading.Event()
    with Simulation(resume_timeout=0.5) as sim:
        sim.spawn(lambda: blocker.wait(5.0), "blocked")
        with pytest.raises(SimStuck, match="blocked"):
            sim.run()
        blocker.set()
