"""What the parts of a peer share, handed to each part's constructor: the config, the clock, the stop request,
the event sink, the swarm port and the global state. Each part owns the rest of its state itself."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Callable

from ..config import Config
from ..errors import SwarmError
from ..metrics import Metrics
from ..metrics.events import Event
from ..outer.state import GlobalState
from ..protocol.records import PeerRecord, Phase
from ..runtime.clock import Clock
from ..runtime.clock import Event as StopEvent
from ..swarm.port import SwarmPort

log = logging.getLogger("p2p_diloco.peer")
VIEW_TRIES = 5  # reads of the live records in a row that may time out before the peer gives up on the swarm


@dataclass
class PeerStats:
    """What this peer did, for its summary and its checkpoints."""

    tokens_trained: int = 0  # tokens of this peer's inner steps, all rounds
    inner_steps: int = 0  # this peer's own inner steps, all rounds (not ``global_step``: the run's position)
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
    verify: Callable[[dict], dict] | None = None  # set by the Peer: its Chain leaves out records it cannot trust

    def view(self) -> dict[str, PeerRecord]:
        """The other live peers' records whose claims we can verify (:class:`~.chain.Chain`). A read that times
        out is retried, a second later (guessing "no peers" would mean a solo step), but at most
        :data:`VIEW_TRIES` reads in a row: each is bounded (15 s on the real swarm), so a DHT that stopped answering
        ends the peer with a one-line :class:`SwarmError` after about 80 s instead of holding it in a loop forever
        (its own record has expired long before: it is out of the swarm).
        A stop request during the wait re-raises the ``TimeoutError``."""
        for tries in range(1, VIEW_TRIES + 1):
            try:
                records = self.swarm.live_peers()
                return records if self.verify is None else self.verify(records)
            except TimeoutError:
                if tries == VIEW_TRIES:
                    break
                log.warning("DHT did not answer (read %d of at most %d); retrying", tries, VIEW_TRIES)
                if self.sleep(1.0):
                    raise
        raise SwarmError(f"the DHT did not answer {VIEW_TRIES} reads of the live records in a row: this peer has "
                         f"lost the swarm")

    def announce(self, phase: Phase, **fields: Any) -> None:
        """Publish our record now with the state we hold (round, digest, and the certificate that backs them, which
        we keep in the swarm for whoever reads the record) and ``phase``."""
        state = self.state
        self.swarm.publish(phase=phase, round=state.round, digest=state.digest, head=state.chain_head, **fields)
        if state.certificate is not None:
            self.swarm.keep_blob("cert", state.certificate.to_bytes())

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
