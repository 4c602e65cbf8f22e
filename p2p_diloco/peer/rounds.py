"""One round, start to end, and what happens at every round boundary.

A round, seen from one peer holding the global weights theta(r) (bit-identical on every synced peer):

1. start from theta(r) and run the inner AdamW steps on this peer's own data (:class:`~.inner_loop.InnerLoop`);
2. ``pseudo_gradient = theta(r) - local weights`` (:meth:`GlobalState.pseudo_gradient`);
3. average it, weighted by tokens trained, with *every* live peer of round r (:class:`~.syncer.Syncer`);
4. compute the outer Nesterov step aside, sign the round's statement with the group, and commit theta(r+1) once
   every member signed (:class:`~.certifier.Certifier`, :meth:`GlobalState.commit`);
5. the boundary: theta(r+1) into the model, announced, checkpointed, evaluated.

Round numbers are swarm-wide: ``run.max_rounds`` R means "stop once theta(R) exists", for late joiners too.
"""

from __future__ import annotations

from ..metrics.events import Event
from ..outer.error_feedback import ErrorFeedback, FragmentFeedback
from ..protocol.records import Phase
from .checkpoints import Checkpointer
from .context import PeerContext, PeerStats
from .inner_loop import InnerLoop
from .syncer import Syncer


class Rounds:
    """Runs rounds and round boundaries for one peer.

    Args:
        ctx: the peer's shared context.
        training: the local model (:class:`~p2p_diloco.training.part.Training`).
        inner: the inner steps.
        syncer: the end-of-round sync.
        checkpoints: round-boundary checkpoints.
        stats: the peer's counters.
        feedback: ``topk``'s error feedback (per fragment with ``outer.fragments``), or None (every other codec
            sends the pseudo-gradient itself).
    """

    def __init__(self, ctx: PeerContext, training, inner: InnerLoop, syncer: Syncer, checkpoints: Checkpointer,
                 stats: PeerStats, feedback: ErrorFeedback | FragmentFeedback | None = None):
        self.ctx, self.training, self.inner, self.syncer = ctx, training, inner, syncer
        self.checkpoints, self.stats, self.feedback = checkpoints, stats, feedback

    def finished(self) -> bool:
        return 0 < self.ctx.cfg.run.max_rounds <= self.ctx.state.round

    def run_round(self) -> None:
        """One blocking round from theta(r): inner steps, sync, outer step, boundary."""
        ctx = self.ctx
        r = ctx.state.round
        ctx.emit_in_round(Event.ROUND_START, r, digest=ctx.state.digest)
        tokens, steps = self.inner.train(r)
        if ctx.stop.is_set():
            return
        buffer = ctx.state.new_buffer()
        ctx.state.pseudo_gradient(self.training.replica, buffer)
        self.sync_and_step(r, buffer, tokens, steps)
        self.boundary()

    def sync_and_step(self, r: int, buffer: list, tokens: int, steps: int) -> bool:
        """Average ``buffer`` (our pseudo-gradient from theta(``r``)) with the round's peers and apply the outer
        step: theta(r + 1). False if we fell behind, repaired or stopped instead."""
        ctx = self.ctx
        # with error feedback, what we send is the codec's encoding of (pseudo-gradient + the error kept so far);
        # the rest becomes the error only if this round commits (error_feedback.py's commit contract)
        sent = buffer if self.feedback is None else self.feedback.compensate(buffer)
        certificate = self.syncer.sync(r, sent, tokens)
        if certificate is None:
            if self.feedback is not None:
                self.feedback.reject()
            return False
        ctx.state.commit(certificate)  # the step prepared from the swarm's average, now that every member signed
        if self.feedback is not None:
            self.feedback.accept()
        self.stats.rounds_participated += 1
        ctx.emit(Event.OUTER_STEP, ctx.state.round, digest=ctx.state.digest, inner_steps=steps,
                 certificate=certificate.id, signers=len(certificate.signatures))
        return True

    def boundary(self, phase: Phase = Phase.TRAIN) -> None:
        """theta(round) is set (outer step or download): load it, announce it, checkpoint, evaluate."""
        ctx = self.ctx
        ctx.state.load_into(self.training.replica)
        self.inner.stepped = False
        ctx.announce(phase, inner_step=0, round_tokens=0)
        ctx.swarm.set_donor_round(ctx.state.round)
        self.checkpoints.save()
        if ctx.state.round % ctx.cfg.eval.every_rounds == 0 or self.finished():
            self.evaluate()

    def evaluate(self) -> None:
        with self.ctx.state.theta_in_model(self.training.replica):  # (outer.fragments: the model holds local weights)
            loss = self.training.evaluate()
        self.stats.eval_first = loss if self.stats.eval_first is None else self.stats.eval_first
        self.stats.eval_last = loss
        self.ctx.swarm.update(eval_loss=loss)
        self.ctx.emit(Event.EVAL, self.ctx.state.round, loss=round(loss, 6))
