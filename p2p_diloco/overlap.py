"""Overlapped rounds (``outer.overlap = true``): the all-reduce of round r runs in the background while the peer
already trains round r+1, and the outer step lands one round late. A mixin of :class:`p2p_diloco.peer.Peer`.

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
as it exists (:meth:`OverlappedRounds._enter`). Without that it would always arrive one round late and never
contribute.

What stays exactly as in blocking mode: theta only ever changes by an outer step on an average computed by a
whole group (or a confirmed solo step), so it stays bit-identical across peers; the failure rules of
:meth:`Peer._sync` are the same, run from the background thread. What changes: a peer's local start point lags
theta by one round, and when a sync ends in a download that leaves us more than one round behind, the round
trained meanwhile is dropped, since its pseudo-gradient is for a round the swarm has left. A checkpoint is taken
at the moment the outer step lands, with the model reset to theta: ``--resume`` continues from there, without the
round that was in flight (not bit-exact, unlike blocking mode).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import consensus
from . import outer as outer_mod

log = logging.getLogger("p2p_diloco.peer")


class OverlappedRounds:
    """The round loop of ``outer.overlap`` (see the module docstring). Uses the peer's round protocol."""

    def run_overlapped(self) -> None:
        """Train and sync until ``max_rounds`` or a stop request, each sync hidden behind the next round."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync")
        start = outer_mod.snapshot(self.theta)  # theta(self.round), already in the model (Peer._join_swarm)
        base = self.round  # the theta round that ``start`` was computed from
        pending: Future | None = None
        pending_r = -1  # the round being synced in the background (self.round changes when it lands there)
        try:
            while not self.stop.is_set() and not self._finished():
                if pending is None:
                    pending, pending_r = self._enter(pool)
                if pending is not None and 0 < self.cfg.run.max_rounds <= pending_r + 1:
                    self._land(pending)  # the last round's sync is in flight: nothing left to train
                    pending = None
                    continue
                r = pending_r + 1 if pending is not None else self.round  # the round this training is meant for
                self.metrics.event("round_start", r + 1, digest=self.digest)
                tokens, steps = self._train_inner(r)
                if self.stop.is_set():
                    break
                delta = [torch.empty_like(t) for t in self.theta]
                outer_mod.pseudo_gradient(start, self.params, delta)
                if pending is not None:
                    self._land(pending)
                    pending = None
                if not 0 <= self.round - base <= 1:  # a pseudo-gradient from theta(base) may go into round base+1
                    log.info("round %d: dropping inner steps that started from theta(%d), now %d rounds stale",
                             r + 1, base, self.round - base)
                    start, base = outer_mod.snapshot(self.theta), self.round
                    continue
                r, base = self.round, self.round
                self.outer.lookahead(delta, start)  # before the sync thread may step theta
                pending, pending_r = pool.submit(self._background_round, r, delta, tokens, steps), r
                outer_mod.load_into(self.params, start)
        except BaseException:
            self.stop.set()  # the sync thread must not go on averaging for a peer that is going down
            raise
        finally:
            if pending is not None:  # a stop request reaches the sync thread within a poll period
                self._land(pending, stopping=self.stop.is_set())
            pool.shutdown(wait=True)

    def _enter(self, pool: ThreadPoolExecutor) -> tuple[Future | None, int]:
        """Start training with no sync in flight (first round, after a join or a lost round).

        If the peers of our round are already averaging it, their pseudo-gradients for it are made: ours can only
        go into the next round. We train for that one at once (in step with them), announced as ``join`` so that
        nobody waits for us in the current round, while a background task takes theta(r+1) from them as soon as
        it exists. Otherwise we are a member of our round like everyone else.
        """
        r = self.round
        if any(p.get("phase") == "sync" for p in consensus.synced(self._live_peers(), r).values()):
            self.swarm.publish(phase="join")
            return pool.submit(self._background_catch_up, r), r
        self.swarm.publish(phase="train", round=r, digest=self.digest)
        return None, -1

    def _background_round(self, r: int, delta: list[torch.Tensor], tokens: int, steps: int) -> bool:
        """Sync thread: average, step, and announce theta(r+1) at once, so that peers already in round r+1 (they
        may finish their inner steps sooner) count us as a member of it. If the swarm went on without us and we
        took its state instead, we announce that round: our next pseudo-gradient may still be in time for it."""
        stepped = self._sync_and_step(r, delta, tokens, steps)
        if stepped or self.round > r:
            self.swarm.publish(phase="train", round=self.round, digest=self.digest)
            self.swarm.set_donor_round(self.round)
        return stepped

    def _background_catch_up(self, r: int) -> bool:
        """Sync thread: wait until the swarm holds theta(r+1), then download it and announce that round. (If the
        others are gone instead, whatever happens next starts from our theta(r).)"""
        self._wait_for_round_end(r, min(0.5, self.cfg.swarm.heartbeat_period))
        if self.round > r:
            self.swarm.publish(phase="train", round=self.round, digest=self.digest)
            self.swarm.set_donor_round(self.round)
        return False

    def _land(self, pending: Future, stopping: bool = False) -> None:
        """Wait for the sync in flight; then theta (stepped, downloaded or unchanged) goes into the model, is
        announced and checkpointed (Peer._boundary)."""
        if not pending.done():
            self.metrics.status(f"round {self.round + 1}: waiting for the all-reduce running in the background")
        pending.result()
        if stopping:
            outer_mod.load_into(self.params, self.theta)
            self._at_boundary = True  # Peer.run saves this point
        else:
            self._boundary()
