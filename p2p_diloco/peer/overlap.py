"""Overlapped rounds (``outer.overlap = true``): the all-reduce of round r runs in the background while the peer
already trains round r+1, and the outer step lands one round late.

Blocking DiLoCo idles every peer for the whole all-reduce. Here a peer never waits for the network unless the
all-reduce takes longer than a round of inner steps (Streaming DiLoCo, https://arxiv.org/abs/2501.18512, and the
eager updates of Kale et al., https://arxiv.org/abs/2502.12996):

1. a round ends: ``pseudo_gradient = start - local weights``, where ``start`` is where this round's inner steps
   began (theta itself in blocking mode);
2. the previous round's all-reduce is joined (usually long finished); its outer step was applied in the
   background the moment it finished, so theta(r) is already here;
3. the next round starts from ``lookahead(theta(r), our pseudo_gradient)``: the theta the outer step would give
   if everyone's pseudo-gradient were ours, since the real average is not known yet;
4. the all-reduce of our pseudo-gradient for round r starts in the background, and gives theta(r+1).

A newcomer (or a peer that fell behind) that finds the peers of its round already averaging it cannot add to
that round: it trains for the next one at once, in step with them, and takes theta(r+1) in the background as soon
as it exists (:func:`~p2p_diloco.protocol.rules.decide_overlap_entry`). Without that it would always arrive one
round late and never contribute.

What stays exactly as in blocking mode: theta only ever changes by an outer step on an average computed by a
whole group (or a confirmed solo step), so it stays bit-identical across peers; the failure rules of the sync are
the same, run from the background task. What changes: a peer's local start point lags theta by one round, and
when a sync ends in a download that leaves us more than one round behind, the round trained meanwhile is dropped,
since its pseudo-gradient is for a round the swarm has left. A checkpoint is taken at the moment the outer step
lands, with the model reset to theta: ``--resume`` continues from there, without the round that was in flight
(not bit-exact, unlike blocking mode). The background task never touches the local ranks of a cluster peer (it
only averages and steps theta), so the inner steps' collectives run undisturbed in the main thread.
"""

from __future__ import annotations

import functools
import logging

from ..metrics.events import Event
from ..protocol import rules
from ..protocol.actions import TrainAhead
from ..protocol.records import Phase
from ..runtime.clock import Task
from .context import PeerContext
from .rounds import Rounds
from .state_sync import StateSync

log = logging.getLogger("p2p_diloco.peer")


class OverlapLoop:
    """The round loop of ``outer.overlap`` (module docstring)."""

    def __init__(self, ctx: PeerContext, rounds: Rounds, state_sync: StateSync):
        self.ctx, self.rounds, self.state_sync = ctx, rounds, state_sync
        self.start: list | None = None  # where the round in training started: theta(base) or a look-ahead of it
        self.base = 0  # the theta round that ``start`` was computed from

    def run(self) -> None:
        """Train and sync until ``max_rounds`` or a stop request, each sync hidden behind the next round."""
        ctx, state = self.ctx, self.ctx.state
        self._begin()
        pending: Task | None = None
        pending_r = -1  # the round being synced in the background (state.round changes when it lands there)
        try:
            while not ctx.stop.is_set() and not self.rounds.finished():
                if pending is None:
                    pending, pending_r = self._enter()
                if pending is not None and 0 < ctx.cfg.run.max_rounds <= pending_r + 1:
                    self._land(pending)  # the last round's sync is in flight: nothing left to train
                    pending = None
                    continue
                r = pending_r + 1 if pending is not None else state.round  # the round this training is meant for
                ctx.emit_in_round(Event.ROUND_START, r, digest=state.digest)
                tokens, steps = self.rounds.inner.train(r)
                if ctx.stop.is_set():
                    break
                pending, pending_r = self._next(r, pending, tokens, steps)
        except BaseException:
            ctx.stop.set()  # the background task must not go on averaging for a peer that is going down
            raise
        finally:
            if pending is not None:  # a stop request reaches the background task within a poll period
                self._land(pending, stopping=ctx.stop.is_set())

    def _begin(self) -> None:
        self.start, self.base = self.ctx.state.snapshot(), self.ctx.state.round  # in the model (the join's boundary)

    def _next(self, r: int, pending: Task | None, tokens: int, steps: int) -> tuple[Task | None, int]:
        """The end of the inner steps meant for round ``r``: land the sync in flight, start this round's in the
        background, and load the next round's start into the model. Returns the new sync in flight and its round
        (None, -1: none, the round's steps were dropped)."""
        ctx, state, replica = self.ctx, self.ctx.state, self.rounds.training.replica
        buffer = state.new_buffer()
        state.pseudo_gradient(replica, buffer, start=self.start)
        if pending is not None:
            self._land(pending)
        if not 0 <= state.round - self.base <= 1:  # a pseudo-gradient from theta(base) may go into round base+1
            log.info("round %d: dropping inner steps that started from theta(%d), now %d rounds stale",
                     r + 1, self.base, state.round - self.base)
            self.start, self.base = state.snapshot(), state.round
            return None, -1
        r, self.base = state.round, state.round
        state.lookahead(buffer, self.start)  # before the background task may step theta
        # (bound now: the caller rebinds its names before the task runs)
        task = ctx.clock.spawn(functools.partial(self._background_round, r, buffer, tokens, steps), "sync")
        state.load_into(replica, self.start)
        return task, r

    def _enter(self) -> tuple[Task | None, int]:
        """Start training with no sync in flight (first round, after a join or a lost round)."""
        ctx, r = self.ctx, self.ctx.state.round
        if isinstance(rules.decide_overlap_entry(r, ctx.view()), TrainAhead):
            ctx.swarm.publish(phase=Phase.JOIN)  # nobody waits for us in round r
            return ctx.clock.spawn(functools.partial(self._background_catch_up, r), "catch-up"), r
        ctx.announce(Phase.TRAIN)
        return None, -1

    def _background_round(self, r: int, buffer: list, tokens: int, steps: int) -> bool:
        """Background: average, step, and announce theta(r+1) at once, so that peers already in round r+1 (they
        may finish their inner steps sooner) count us as a member of it. If the swarm went on without us and we
        took its state instead, we announce that round: our next pseudo-gradient may still be in time for it."""
        stepped = self.rounds.sync_and_step(r, buffer, tokens, steps)
        if stepped or self.ctx.state.round > r:
            self._announce()
        return stepped

    def _background_catch_up(self, r: int) -> bool:
        """Background: wait until the swarm holds theta(r+1), then download it and announce that round. (If the
        others are gone instead, whatever happens next starts from our theta(r).)"""
        self.state_sync.wait_for_round_end(r, min(0.5, self.ctx.cfg.swarm.heartbeat_period))
        if self.ctx.state.round > r:
            self._announce()
        return False

    def _announce(self) -> None:
        ctx = self.ctx
        ctx.announce(Phase.TRAIN)
        ctx.swarm.set_donor_round(ctx.state.round)

    def _land(self, pending: Task, stopping: bool = False) -> None:
        """Wait for the sync in flight; then theta (stepped, downloaded or unchanged) goes into the model, is
        announced and checkpointed (the round boundary)."""
        if not pending.done():
            self.ctx.status(f"round {self.ctx.state.round + 1}: waiting for the all-reduce running in the background")
        pending.result()
        if stopping:
            self.ctx.state.load_into(self.rounds.training.replica)
            self.rounds.inner.stepped = False  # the peer saves this point
        else:
            self.rounds.boundary()
