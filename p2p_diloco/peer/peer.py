"""One DiLoCo peer's life, top to bottom: join the swarm, take its state, train rounds, leave.

The peer is composed of parts that own their state, each given what it needs in its constructor
(:class:`~.context.PeerContext`): :class:`~.inner_loop.InnerLoop` (inner steps), :class:`~.syncer.Syncer` (the
end-of-round sync), :class:`~.state_sync.StateSync` (catch-up, repair, joining), :class:`~.checkpoints.Checkpointer`,
:class:`~.rounds.Rounds` (a round and its boundary) and, with ``outer.overlap``, :class:`~.overlap.OverlapLoop`.
Every decision they carry out is a pure function of :mod:`p2p_diloco.protocol.rules`; no hivemind here: the swarm
is a :class:`~p2p_diloco.swarm.port.SwarmPort` (the real one, or the in-memory fake of :mod:`p2p_diloco.testing`).

Failure rules, checked before every all-reduce attempt (:func:`~p2p_diloco.protocol.rules.decide_sync`; each wait is
bounded by a ``[swarm]`` timeout, see docs/protocol.md):

* the swarm is already past round r -> we missed the round: download (round, theta, momentum) from a peer
  holding the majority digest of the swarm's round, trying the next donor on a failure;
* the peers of round r mostly hold another digest than ours -> our theta is corrupt: download theta(r) from the
  majority, sit the rest of the round out (phase "repair"), and take theta(r+1) when the others have it;
* no other live peer is in round r, confirmed over a record lifetime -> we are the whole swarm: solo step;
* the all-reduce fails in any way (a peer died, froze, left) -> apply nothing, re-read the records, try again.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

from ..checkpoint import PeerState
from ..outer.codecs import codec_for
from ..outer.error_feedback import ErrorFeedback, FragmentFeedback
from ..protocol import rules
from ..protocol.actions import Leave, Repair, Start
from ..protocol.records import Phase
from .chain import Chain
from .checkpoints import Checkpointer
from .context import PeerContext, PeerStats
from .inner_loop import InnerLoop
from .overlap import OverlapLoop
from .streaming import StreamingLoop
from .rounds import Rounds
from .state_sync import StateSync
from .syncer import Syncer

log = logging.getLogger("p2p_diloco.peer")
START_POLL = 0.25  # waiting for swarm.min_peers: they all start within a short window


def data_seed_for(peer_id: str) -> int:
    """Default data order of a peer: derived from its peer id, so every peer reads a different order."""
    return int(hashlib.sha256(peer_id.encode()).hexdigest()[:8], 16)


def _error_feedback(ctx: PeerContext) -> ErrorFeedback | FragmentFeedback:
    """topk's error feedback for this peer's state: one accumulator, or one per fragment (``outer.fragments``)."""
    o = ctx.cfg.outer
    codec, like = codec_for(o), ctx.state.tensors_like()
    if o.fragments > 1:
        return FragmentFeedback(codec, like, o.topk_error_decay, o.fragments, lambda: ctx.state.fragment())
    return ErrorFeedback(codec, like, o.topk_error_decay)


class Peer:
    """A DiLoCo peer (module docstring); built by :func:`p2p_diloco.peer.build.build_peer`.

    Args:
        ctx: the shared context: config, clock, stop request, events, swarm port, global state.
        training: the local model and its trainer (:class:`~p2p_diloco.training.part.Training` or a fake).
        resumed: a verified checkpoint to continue from, or None.
        cluster: this peer's local ranks under torchrun (we are rank 0), or None.
        on_started: called with the swarm once it is up (the CLI prints the join line from it).
        on_training: called once, when the first round starts (start-up is over: the CLI's first stop signal no
            longer aborts at once, it stops at the next safe point).
    """

    def __init__(self, ctx: PeerContext, training, resumed: PeerState | None = None, cluster=None,
                 on_started: Callable[[Any], None] | None = None, on_training: Callable[[], None] | None = None):
        self.ctx, self.training, self.resumed = ctx, training, resumed
        self.cluster, self.on_started, self.on_training = cluster, on_started, on_training
        self.stats = PeerStats()
        self.chain = Chain(ctx)
        ctx.verify = self.chain.verified
        self.state_sync = StateSync(ctx, self.chain, self.stats)
        self.inner = InnerLoop(ctx, training, self.stats)
        self.syncer = Syncer(ctx, self.state_sync, self.stats, self.chain)
        # topk's error feedback (outer/error_feedback.py): what this peer has not sent yet, local to it
        self.feedback = _error_feedback(ctx) if ctx.cfg.outer.compression == "topk" else None
        self.checkpoints = Checkpointer(ctx, training, self.stats, cluster, self.feedback)
        self.rounds = Rounds(ctx, training, self.inner, self.syncer, self.checkpoints, self.stats, self.feedback)
        loop = StreamingLoop if ctx.cfg.outer.fragments > 1 else OverlapLoop
        self.overlap = loop(ctx, self.rounds, self.state_sync) if ctx.cfg.outer.overlap else None

    def run(self) -> dict[str, Any]:
        """Join the swarm, train until ``max_rounds`` (or a stop request), and return the summary."""
        ctx = self.ctx
        ctx.swarm.start()
        try:
            if self.on_started:
                self.on_started(ctx.swarm)
            self.training.start(self._data_seed())
            ctx.state.attach(ctx.swarm, self.training.replica)
            if self.resumed:
                self.checkpoints.restore(self.resumed)
                # a restart without --identity-path has a new peer id: it still continues the chain it wrote
                self.chain.former_ids.add(str(self.resumed.extra.get("peer_id") or ""))
            ctx.swarm.publish(ready=True)  # data and model are built: we can start a round at once
            self._wait_for_peers()
            phase = self.state_sync.join(self.rounds.finished)
            if self.on_training:
                self.on_training()
            self.rounds.boundary(phase)
            if self.overlap:
                self.overlap.run()
            while not ctx.stop.is_set() and not self.rounds.finished():
                self.rounds.run_round()
            if self.rounds.finished():
                self._linger()
            elif not self.inner.stepped:
                self.checkpoints.save(force=True)  # stopped between rounds: keep exactly this point
        finally:
            if self.cluster:  # the other local ranks stop first: the swarm's shutdown can take a few seconds
                self.cluster.stop_followers()
            ctx.swarm.shutdown()
            self.training.close()
        return self.summary()

    def _data_seed(self) -> int:
        saved = self.resumed.extra if self.resumed else {}
        seed = saved.get("data_seed", self.ctx.cfg.data.seed)
        return data_seed_for(self.ctx.swarm.peer_id) if seed is None or seed < 0 else seed

    def _wait_for_peers(self) -> None:
        """Hold the first round until ``swarm.min_peers`` peers are live and ready to train (their data is built:
        that can take a while), so that they all start it together and all take part in it."""
        ctx, sc = self.ctx, self.ctx.cfg.swarm
        deadline = ctx.clock.monotonic() + sc.min_peers_timeout
        while not ctx.stop.is_set():
            action = rules.decide_first_round(ctx.view(), ctx.state.round, sc.min_peers, ctx.clock.monotonic(),
                                              deadline, min(START_POLL, sc.heartbeat_period))
            if isinstance(action, Start):
                if ctx.clock.monotonic() >= deadline:
                    log.warning("%s after %.0fs; starting anyway", action.reason, sc.min_peers_timeout)
                return
            ctx.status(action.reason)
            ctx.sleep(action.seconds)

    def _linger(self) -> None:
        """The run is over: stay a state donor for a while so a peer that missed the last round can catch up."""
        ctx = self.ctx
        ctx.announce(Phase.DONE)
        deadline = ctx.clock.monotonic() + ctx.cfg.swarm.state_timeout
        while not ctx.stop.is_set():
            view, r = ctx.view(), ctx.state.round
            unverified = [pid for pid, claimed in self.chain.unverified.items() if claimed == r]
            action = rules.decide_linger(r, view, ctx.clock.monotonic(), deadline, ctx.cfg.swarm.heartbeat_period,
                                         ctx.state.digest, unverified)
            if isinstance(action, Leave):
                return
            if isinstance(action, Repair):
                self.state_sync.repair_last_round(action)
                continue
            ctx.status(action.reason)
            ctx.sleep(action.seconds)

    def summary(self) -> dict[str, Any]:
        s, state = self.stats, self.ctx.state
        return {
            "peer_id": self.ctx.swarm.peer_id, "run_id": self.ctx.cfg.run.run_id,
            "rounds_completed": state.round, "rounds_participated": s.rounds_participated,
            "global_digest": state.digest, "chain_head": state.chain_head,
            "eval_loss_first": s.eval_first, "eval_loss_last": s.eval_last,
            "tokens_trained": s.tokens_trained, "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
            "stopped_early": not self.rounds.finished(),
        }
