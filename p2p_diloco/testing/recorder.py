"""An in-memory event sink for simulated peers: every event, checked against the catalogue, stamped with the
virtual time, and handed to the scenario's hooks as it happens (faults aimed at a moment of a round)."""

from __future__ import annotations

from typing import Any, Callable

from ..metrics import Metrics
from ..metrics.events import check

Hook = Callable[[str, dict[str, Any]], None]  # (peer id, event) -> None


class EventRecorder(Metrics):
    """Collects one peer's events (``{"t", "event", "round", ...fields}``, as in ``events.jsonl``).

    Args:
        peer_id: whose events these are.
        clock: the simulation's clock (``t`` is its ``time()``).
        hooks: called with (peer id, event) right after each event, inside the peer's task.
        dead: True once the peer is killed (it writes nothing more).
    """

    def __init__(self, peer_id: str, clock, hooks: list[Hook], dead: Callable[[], bool] = lambda: False):
        self.peer_id, self.clock, self.hooks, self.dead = peer_id, clock, hooks, dead
        self.events: list[dict[str, Any]] = []
        self.last_status = ""

    def event(self, name: str, round: int, **fields: Any) -> None:
        problem = check(name, fields)
        if problem:
            raise AssertionError(problem)
        if self.dead():  # a killed peer writes nothing more
            return
        event = {"t": self.clock.time(), "event": str(name), "round": round, **fields}
        self.events.append(event)
        for hook in list(self.hooks):
            hook(self.peer_id, event)

    def status(self, text: str) -> None:
        self.last_status = text
