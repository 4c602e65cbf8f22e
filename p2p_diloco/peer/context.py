"""What the parts of a peer share, handed to each part's constructor: the config, the clock, the stop request,
the event sink, the swarm port and the global state. Each part owns the rest of its state itself."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..metrics import Metrics
from ..metrics.events import Event
from ..outer.state import GlobalState
from ..protocol.records import PeerRecord
from ..runtime.clock import Clock
from ..runtime.clock import Event as StopEvent
from ..swarm.port import SwarmPort

log = logging.getLogger("p2p_diloco.peer")


@dataclass
class PeerStats:
    """What this peer did, for its summary and its checkpoints."""

    tokens_trained: int = 0  # tokens of this peer's inner steps, all rounds
    inner_steps: int = 0  # this peer's inner steps, all rounds (``global_step`` of inner_progress)
    rounds_participated: int = 0  # outer steps this peer took with its own pseudo-gradient in the average
    bytes_sent: int = 0
    bytes_received: int = 0
    eval_first: float | None = None
    eval_last: float | None = None


@dataclass
class PeerContext:
    """Shared by every part of one peer (module docstring)."""

    cfg: Config
    clock: Clock
    stop: StopEvent
    metrics: Metrics
    swarm: SwarmPort
    state: GlobalState
    rng: random.Random  # donor order (spreads the download load)

    def view(self) -> dict[str, PeerRecord]:
        """The other live peers' records. A DHT hiccup is retried: guessing "no peers" would mean a solo step."""
        while True:
            try:
                return self.swarm.live_peers()
            except TimeoutError:
                log.warning("DHT did not answer; retrying")
                if self.sleep(1.0):
                    raise

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until a stop request; True if stopped."""
        return self.clock.wait(self.stop, seconds)

    def emit(self, event: Event, round_: int, **fields: Any) -> None:
        """An event about theta(``round_``) (an outer step, a download, an eval, a checkpoint)."""
        self.metrics.event(event, round_, **fields)

    def emit_in_round(self, event: Event, held: int, **fields: Any) -> None:
        """An event of the round that starts from theta(``held``): events call it by its number, ``held + 1``,
        the index of the theta it produces (docs/glossary.md)."""
        self.metrics.event(event, held + 1, **fields)

    def status(self, text: str) -> None:
        self.metrics.status(text)
