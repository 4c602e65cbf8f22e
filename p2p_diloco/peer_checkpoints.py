"""A peer's round-boundary checkpoints: what is saved, and how a resumed peer continues exactly.

A mixin of :class:`~p2p_diloco.peer.Peer` (it uses the peer's outer state, model, trainer, data stream, swarm and
metrics); the file format and its atomic writes are in :mod:`p2p_diloco.checkpoint`.
"""

from __future__ import annotations

import logging

from .checkpoint import CheckpointError, PeerState, capture_rng, restore_rng

log = logging.getLogger(__name__)


def optimizer_format(cfg, cluster) -> str:
    """How the inner optimizer state is saved: FSDP's full state (keyed by parameter name) or torch's plain one."""
    return "fsdp" if cluster is not None and cfg.train.parallelism == "fsdp" else "plain"


def check_resumable(state: PeerState, cfg, cluster) -> None:
    """Refuse, before anything starts, a checkpoint whose inner optimizer state this peer cannot load."""
    saved, ours = state.extra.get("optimizer_format", "plain"), optimizer_format(cfg, cluster)
    if saved != ours:
        raise CheckpointError(f"the checkpoint's inner optimizer state is in {saved!r} format and this peer needs "
                              f"{ours!r}: resume with the train.parallelism it was saved with (fsdp under torchrun "
                              f"with several ranks, or ddp / one process)")


class PeerCheckpoints:
    """Save and restore of a :class:`~p2p_diloco.peer.Peer` at round boundaries (rank 0 only in a cluster)."""

    def _save_checkpoint(self, force: bool = False) -> None:
        """Save the round-boundary state (atomic, keeps the last k); a failure is logged, never fatal."""
        if self.store is None or getattr(self, "_saved", None) == (self.round, self.digest):
            return
        if not force and self.round % self.cfg.checkpoint.every_rounds:
            return
        extra = {"data_seed": self.data_seed, "tokens_trained": self.tokens_trained,
                 "rounds_participated": self.rounds_participated, "bytes_sent": self.bytes_sent,
                 "bytes_received": self.bytes_received, "eval_first": self.eval_first,
                 "peer_id": getattr(self.swarm, "peer_id", ""), "config": self.cfg.to_dict(),
                 "optimizer_format": optimizer_format(self.cfg, self.cluster)}
        with self._state_lock:
            try:
                theta, momentum, more = self._outer_for_checkpoint()
                state = PeerState(round=self.round, fingerprint=self.cfg.fingerprint(), global_digest=self.digest,
                                  theta=theta, momentum=momentum, model=self.replica.model_state(),
                                  inner_optimizer=self.replica.optimizer_state(), data=self.data.state_dict(),
                                  rng=capture_rng(), extra={**extra, **more})
                path = self.store.save(state)
            except OSError as e:
                log.error("checkpoint of round %d failed (the previous one is intact): %s", self.round, e)
                return
        self._saved = (self.round, self.digest)
        self.metrics.event("checkpoint_saved", self.round, path=str(path), digest=self.digest)

    # What holds the outer state in a checkpoint (a sharded peer, sharded_peer.py, keeps it in per-shard files).
    def _outer_for_checkpoint(self) -> tuple[list, list, dict]:
        """(theta, momentum, more ``extra``) for the checkpoint; OSError if the outer state cannot be saved."""
        return self.theta, self.outer.momentum_buffers, {}

    def _restore_outer(self, state: PeerState) -> None:
        self.outer.load_state_tensors([*state.theta, *state.momentum])

    def _restore(self, state: PeerState) -> None:
        """Continue exactly from a checkpoint: outer state, model, inner optimizer, data cursor, RNG, counters."""
        with self._state_lock:
            self._restore_outer(state)
            self.round, self.digest = state.round, state.global_digest
        self.data.load_state_dict(state.data)
        self.replica.restore(state.model, state.inner_optimizer, self.data)
        restore_rng(state.rng)
        extra = state.extra
        self.tokens_trained = extra.get("tokens_trained", 0)
        self.rounds_participated = extra.get("rounds_participated", 0)
        self.bytes_sent, self.bytes_received = extra.get("bytes_sent", 0), extra.get("bytes_received", 0)
        self.eval_first = extra.get("eval_first")
        self._saved = (self.round, self.digest)
        self.metrics.event("resumed", self.round, digest=self.digest, path=str(self.store.latest()))
