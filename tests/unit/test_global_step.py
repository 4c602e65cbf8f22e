"""``global_step`` of ``inner_progress`` (TensorBoard's and W&B's x axis; p2p_diloco/peer/inner_loop.py): derived from
the round and the inner step, so that a peer restarted with ``--resume`` goes on where it was instead of at 0."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest

from p2p_diloco.config import Config
from p2p_diloco.metrics.events import Event
from p2p_diloco.peer.context import PeerContext, PeerStats
from p2p_diloco.peer.inner_loop import InnerLoop
from p2p_diloco.testing.recorder import EventRecorder

pytestmark = pytest.mark.unit
H = 20


class Clock:
    """Each look at the clock moves it 0.1 s on (a step takes a while)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.1
        return self.now

    def time(self) -> float:
        return 1000.0 + self.now

    def wait(self, event, seconds: float) -> bool:
        return event.is_set()


class Training:
    tokens_per_step = 512

    def step(self, schedule_step: int) -> tuple[float, int]:
        return 5.0 - 0.01 * schedule_step, self.tokens_per_step

    def mfu(self, tokens_per_s: float) -> float | None:
        return None


def _peer() -> tuple[InnerLoop, EventRecorder]:
    cfg = Config()
    cfg.train.inner_steps = H
    clock = Clock()
    events = EventRecorder("p", clock, [])  # checks every event against the catalogue
    ctx = PeerContext(cfg=cfg, clock=clock, stop=threading.Event(), metrics=events,
                      swarm=SimpleNamespace(update=lambda **fields: None), state=None, rng=random.Random(0))
    return InnerLoop(ctx, Training(), PeerStats()), events


def _steps(events: EventRecorder) -> dict[tuple[int, int], int]:
    return {(e["round"], e["inner_step"]): e["global_step"] for e in events.events
            if e["event"] == Event.INNER_PROGRESS}


def test_global_step_is_the_runs_position_and_goes_on_after_a_resume():
    whole, seen = _peer()
    for held in range(3):  # rounds 1, 2, 3 (from θ(0), θ(1), θ(2))
        whole.train(held)
    steps = _steps(seen)
    assert steps == {(1, 10): 10, (1, 20): 20, (2, 10): 30, (2, 20): 40, (3, 10): 50, (3, 20): 60}
    resumed, seen_after = _peer()  # a new process: its own counters start at 0
    resumed.train(2)
    assert _steps(seen_after) == {(3, 10): 50, (3, 20): 60}
    progress = [e for e in seen.events if e["event"] == Event.INNER_PROGRESS]
    assert all(e["tokens_per_s"] > 0 for e in progress)
