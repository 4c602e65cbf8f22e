"""Protocol scenarios in one process: real peers (:class:`~p2p_diloco.peer.peer.Peer`, with the real decisions, outer
step and global state) on an in-memory swarm (:mod:`.fake_swarm`), with a fake model (:mod:`.fake_training`), on a
virtual clock (:mod:`.sim`). A scenario of minutes of swarm time runs in well under a second, the same way every time.

    with SimSwarm(["run.max_rounds=3"]) as swarm:     # settings (section.key=value) of every peer
        a, b = swarm.add(), swarm.add()
        running = lambda e: e["event"] == Event.ALLREDUCE_RUNNING and e["round"] == 2
        swarm.when(b, running, lambda: swarm.net.kill(b.name))
        swarm.finish()
        assert a.summary()["rounds_completed"] == 3
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..config import Config, load_config
from ..metrics.events import Event
from ..peer import Peer
from ..peer.build import build_state
from ..peer.context import PeerContext
from .fake_swarm import FakeNetwork
from .fake_training import FakeTraining
from .recorder import EventRecorder
from .sim import SimEvent, Simulation, SimTask

# Short waits, as the subprocess fault tests use (a lost peer costs seconds, not minutes).
SETTINGS = ["swarm.matchmaking_time=5.0", "swarm.request_timeout=2.0", "swarm.allreduce_timeout=20",
            "swarm.next_chunk_timeout=5", "train.inner_steps=20"]


@dataclass
class SimPeer:
    """One simulated peer: its driver, its task, its events and its stop request (a SIGTERM)."""

    name: str
    cfg: Config
    peer: Peer
    recorder: EventRecorder
    stop: SimEvent
    training: FakeTraining
    task: SimTask | None = None
    started_at: float = 0.0

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.recorder.events

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        """Its events of one kind (and with the given field values)."""
        return [e for e in self.events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]

    def summary(self) -> dict[str, Any]:
        """The run's summary (``--summary-json``); raises what the peer raised."""
        assert self.task is not None and self.task.done(), f"{self.name} has not finished"
        return self.task.result()

    @property
    def state(self):
        return self.peer.ctx.state


@dataclass
class SimSwarm:
    """Peers of one run on one in-memory swarm (module docstring).

    Args:
        sets: ``section.key=value`` settings for every peer (on top of :data:`SETTINGS`).
        transfer_seconds, assemble_seconds, download_seconds: the fake network's timings.
    """

    sets: Sequence[str] = ()
    transfer_seconds: float = 0.2
    assemble_seconds: float = 0.2
    download_seconds: float = 0.5
    sim: Simulation = field(default_factory=Simulation)
    peers: list[SimPeer] = field(default_factory=list)
    hooks: list[Callable] = field(default_factory=list)

    def __post_init__(self):
        self.net = FakeNetwork(self.sim, self.transfer_seconds, self.assemble_seconds, self.download_seconds)

    def __enter__(self) -> SimSwarm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sim.close()

    def add(self, sets: Sequence[str] = (), step_seconds: float = 0.05, stalls: dict[int, float] | None = None,
            at: float | None = None, name: str | None = None, resume_from: Any = None) -> SimPeer:
        """A new peer, started now or at virtual time ``at``. ``sets``: its own settings; ``stalls``: see
        :class:`FakeTraining`; ``resume_from``: a :class:`~p2p_diloco.checkpoint.PeerState` to continue from."""
        name = name or f"peer{len(self.peers)}"
        cfg = load_config(None, [*SETTINGS, *self.sets, *sets])
        clock = self.sim.clock
        training = FakeTraining(cfg, clock, step_seconds, stalls)
        state = build_state(cfg, None, training.params)
        swarm = self.net.factory(name)(cfg, state.tensors_like(), state.donate, **state.swarm_options())
        recorder = EventRecorder(name, clock, self.hooks, dead=lambda: swarm.dead)
        stop = clock.event()
        ctx = PeerContext(cfg, clock, stop, recorder, swarm, state, random.Random(len(self.peers)))
        peer = SimPeer(name, cfg, Peer(ctx, training, resumed=resume_from), recorder, stop, training)
        self.peers.append(peer)

        def start() -> None:
            peer.started_at = self.sim.now
            peer.task = self.sim.spawn(peer.peer.run, name, group=name)

        if at is None:
            start()
        else:
            self.sim.call_at(at, start)
        return peer

    def when(self, peer: SimPeer, predicate: Callable[[dict], bool], action: Callable[[], None]) -> None:
        """Run ``action`` once, right after ``peer`` emits an event that satisfies ``predicate``."""
        def hook(name: str, event: dict) -> None:
            if name == peer.name and hook in self.hooks and predicate(event):
                self.hooks.remove(hook)
                action()
        self.hooks.append(hook)

    def run_until(self, predicate: Callable[[], bool], max_time: float = 600.0) -> None:
        """Run until ``predicate()`` holds; fail if it does not by virtual time ``max_time`` from now."""
        if not self.sim.run(predicate, max_time=self.sim.now + max_time):
            raise AssertionError(f"not reached within {max_time} s of swarm time; {self.sim.describe()}")

    def finish(self, peers: Sequence[SimPeer] | None = None, max_time: float = 600.0) -> None:
        """Run until ``peers`` (default: every peer) have finished their run."""
        peers = list(peers or self.peers)
        self.run_until(lambda: all(p.task is not None and p.task.done() for p in peers), max_time)

    def digests_by_round(self, peers: Sequence[SimPeer] | None = None) -> dict[int, set[str]]:
        """Every digest each peer held after each round (from outer steps and state loads)."""
        out: dict[int, set[str]] = {}
        for p in peers or self.peers:
            for e in p.events:
                if e["event"] in (Event.OUTER_STEP, Event.STATE_LOADED):
                    out.setdefault(e["round"], set()).add(e["digest"])
        return out
