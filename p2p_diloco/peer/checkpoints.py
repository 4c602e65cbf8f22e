"""A peer's round-boundary checkpoints: what is saved, and how a resumed peer continues exactly.

The file format and its atomic writes are in :mod:`p2p_diloco.checkpoint`; the outer state saves itself
(:meth:`GlobalState.save <p2p_diloco.outer.state.GlobalState.save>`: a sharded one into per-shard files).
"""

from __future__ import annotations

import logging

from ..checkpoint import CheckpointError, CheckpointStore, PeerState, capture_rng, restore_rng
from ..errors import RunError
from ..metrics.events import Event
from .context import PeerContext, PeerStats

log = logging.getLogger("p2p_diloco.peer")


def optimizer_format(cfg, cluster) -> str:
    """How the inner optimizer state is saved: FSDP's full state (keyed by parameter name) or torch's plain one."""
    return "fsdp" if cluster is not None and cfg.train.parallelism == "fsdp" else "plain"


def check_checkpoint_dir(cfg) -> None:
    """``checkpoint.dir`` is a directory this peer can write (created if missing), checked before it joins a swarm.

    Raises:
        CheckpointError: (one line) it is a file, or cannot be created or written.
    """
    if cfg.checkpoint.dir:
        CheckpointStore(cfg.checkpoint.dir, cfg.checkpoint.keep).check_usable()


def load_resumed(cfg, cluster) -> PeerState | None:
    """The checkpoint to resume from (``checkpoint.resume``), verified before anything joins the swarm.

    Raises:
        CheckpointError: it is missing, corrupt, of another config, or its inner optimizer state cannot be loaded
            by this peer.
    """
    if not (cfg.checkpoint.dir and cfg.checkpoint.resume):
        return None
    state = CheckpointStore(cfg.checkpoint.dir, cfg.checkpoint.keep).load(fingerprint=cfg.fingerprint())
    saved, ours = state.extra.get("optimizer_format", "plain"), optimizer_format(cfg, cluster)
    if saved != ours:
        raise CheckpointError(f"the checkpoint's inner optimizer state is in {saved!r} format and this peer needs "
                              f"{ours!r}: resume with the train.parallelism it was saved with (fsdp under torchrun "
                              f"with several ranks, or ddp / one process)")
    return state


class Checkpointer:
    """Saves and restores the peer at round boundaries (rank 0 only in a cluster).

    Args:
        ctx: the peer's shared context (its global state is saved).
        training: the local model, inner optimizer and data stream.
        stats: the peer's counters (saved with it).
        cluster: the local ranks, or None (decides the inner optimizer's format).
        feedback: ``topk``'s :class:`~p2p_diloco.outer.error_feedback.ErrorFeedback` (or ``FragmentFeedback``), or
            None.
    """

    def __init__(self, ctx: PeerContext, training, stats: PeerStats, cluster=None, feedback=None):
        cfg = ctx.cfg
        self.ctx, self.training, self.stats, self.cluster = ctx, training, stats, cluster
        self.feedback = feedback  # topk's ErrorFeedback (saved with the state: a resumed peer sends what it owed)
        self.store = CheckpointStore(cfg.checkpoint.dir, cfg.checkpoint.keep) if cfg.checkpoint.dir else None
        self.saved: tuple[int, str] | None = None  # (round, digest) of the last checkpoint written or loaded

    def save(self, force: bool = False) -> None:
        """Save the round-boundary state (atomic, keeps the last k).

        Raises:
            RunError: the checkpoint could not be written (disk full, directory gone or made read-only: the
                directory was checked at start-up). The peer stops rather than train on without the checkpoints it
                was asked to keep: the swarm keeps theta meanwhile, and the peer, resumed from its last checkpoint
                (intact: writes are atomic), catches up from the others.
        """
        cfg, state = self.ctx.cfg, self.ctx.state
        if self.store is None or self.saved == (state.round, state.digest):
            return
        if not force and state.round % cfg.checkpoint.every_rounds:
            return
        extra = {"data_seed": self.training.data_seed, "tokens_trained": self.stats.tokens_trained,
                 "rounds_participated": self.stats.rounds_participated, "bytes_sent": self.stats.bytes_sent,
                 "bytes_received": self.stats.bytes_received, "eval_first": self.stats.eval_first,
                 "peer_id": self.ctx.swarm.peer_id or "", "config": cfg.to_dict(),
                 "optimizer_format": optimizer_format(cfg, self.cluster)}
        if self.feedback is not None:
            extra["error_feedback"] = self.feedback.state()
        with state.lock:
            try:
                theta, momentum, more = state.save(str(self.store.directory), self._kept_rounds())
                peer_state = PeerState(
                    round=state.round, fingerprint=cfg.fingerprint(), global_digest=state.digest, theta=theta,
                    momentum=momentum, model=self.training.model_state(),
                    inner_optimizer=self.training.optimizer_state(), data=self.training.data_state(),
                    rng=capture_rng(), extra={**extra, **more},
                    certificate=None if state.certificate is None else state.certificate.to_json())
                path = self.store.save(peer_state)
            except OSError as e:
                last = f"round {self.saved[0]}" if self.saved else "none yet"
                raise RunError(f"could not write the checkpoint of round {state.round} in {self.store.directory}: "
                               f"{e.strerror or e}; stopped (last checkpoint: {last}, intact; fix the directory, "
                               f"then --resume)") from None
        self.saved = (state.round, state.digest)
        self.ctx.emit(Event.CHECKPOINT_SAVED, state.round, path=str(path), digest=state.digest)

    def _kept_rounds(self) -> list[int]:
        """The rounds of the checkpoints the store keeps once the next one is saved (if that save fails, the
        newest ones stay whole)."""
        rounds = [int(p.name[6:-3]) for p in self.store.paths()]  # round-XXXXXXXX.pt
        return rounds[len(rounds) - self.store.keep + 1:] if self.store.keep > 1 else []

    def restore(self, peer_state: PeerState) -> None:
        """Continue exactly from a checkpoint: outer state, model, inner optimizer, data cursor, RNG, counters."""
        state = self.ctx.state
        state.restore(peer_state, str(self.store.directory))
        self.training.restore(peer_state.model, peer_state.inner_optimizer, peer_state.data)
        restore_rng(peer_state.rng)
        extra = peer_state.extra
        self.stats.tokens_trained = extra.get("tokens_trained", 0)
        self.stats.rounds_participated = extra.get("rounds_participated", 0)
        self.stats.bytes_sent, self.stats.bytes_received = extra.get("bytes_sent", 0), extra.get("bytes_received", 0)
        self.stats.eval_first = extra.get("eval_first")
        if self.feedback is not None:
            try:
                self.feedback.load(extra.get("error_feedback"))
            except ValueError as e:
                raise CheckpointError(f"{self.store.latest()}: {e}") from None
        self.saved = (state.round, state.digest)
        self.ctx.emit(Event.RESUMED, state.round, digest=state.digest, path=str(self.store.latest()))
