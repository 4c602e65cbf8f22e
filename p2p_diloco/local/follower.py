"""A follower rank's whole life (ranks 1..K-1 of a cluster peer): build the model and the data stream as rank 0
does, then obey its commands until ``STOP`` (:mod:`p2p_diloco.local.cluster` says who does what)."""

from __future__ import annotations

import logging
import signal

import torch

from ..config import Config
from ..runtime.processes import keep_freed_memory
from ..training.data import PackedStream, eval_batches
from ..training.inner import schedule_horizon
from ..training.model import build_model
from ..training.tokenizer import build_tokenizer, vocab_size
from .cluster import Cluster, ClusterTrainer, FsdpFullState
from .commands import EVAL, GATHER, INIT, NAMES, OPTIM, PARAMS, STATE, STEP, STOP
from .sharded_ranks import ShardedRank, obey, start_follower_swarm

log = logging.getLogger(__name__)


def follow(cfg: Config, cluster: Cluster) -> None:
    """A follower rank's whole life: build the model and data as rank 0 does, then obey its commands."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop (see the module docstring)
        signal.signal(sig, lambda *_: log.info("rank %d: stop requested; rank 0 will send STOP", cluster.rank))
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    keep_freed_memory()  # the allocator policy of rank 0 (swarm/__init__.py), so that every rank behaves alike
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, vocab_size(tokenizer), cfg.run.seed).to(cluster.device)
    params = list(model.parameters())
    outer_shards = None
    if cfg.outer.sharding == "sharded":  # as rank 0's state does while it is built (a collective)
        outer_shards = ShardedRank(cfg, cluster, params)
    op, seed = cluster.receive()
    if op == STOP:
        return
    assert op == INIT, NAMES.get(op, op)
    data = PackedStream(tokenizer, cfg.data, seed)
    trainer = ClusterTrainer(cluster, model, cfg.train, data.next_batch, schedule_horizon(cfg))
    fsdp = FsdpFullState(model, trainer) if cluster.parallelism == "fsdp" else None
    eval_set = eval_batches(tokenizer, cfg.data, cfg.eval.batches) if fsdp else None
    try:
        if outer_shards:
            params = list(model.parameters())  # FSDP2 replaced them with DTensors
            start_follower_swarm(outer_shards, cluster, cluster.broadcast_objects([None])[0], params)
        while True:
            op, arg = cluster.receive()
            if op == STOP:
                return
            if not (outer_shards and obey(op, outer_shards, params)):
                _obey(op, arg, cluster, trainer, fsdp, params, data, eval_set, cfg)
    finally:
        data.close()
        if outer_shards and outer_shards.swarm is not None:
            outer_shards.swarm.shutdown()


def _obey(op: int, arg: int, cluster: Cluster, trainer: ClusterTrainer, fsdp: FsdpFullState | None, params, data,
          eval_set, cfg: Config) -> None:
    """One command from rank 0, mirrored on a follower (see :class:`ClusterReplica` for rank 0's side)."""
    if op == STEP:
        trainer.step(arg)  # arg: rank 0's schedule_step (the swarm's position in the lr schedule)
    elif op == PARAMS:
        fsdp.load({}) if fsdp else cluster.broadcast_params(params)
    elif op == STATE:
        data_state, has_optimizer_state = cluster.broadcast_objects([None, None])
        data.load_state_dict(data_state)
        if fsdp:
            fsdp.load({})
            if has_optimizer_state:
                fsdp.load_optimizer({})
        else:
            trainer.optimizer.load_state_dict(cluster.broadcast_objects([None])[0])
            cluster.broadcast_params(params)
    elif op == GATHER and fsdp:
        fsdp.gather()
    elif op == OPTIM and fsdp:
        fsdp.gather_optimizer()
    elif op == EVAL and fsdp:
        fsdp.evaluate(eval_set, cluster.device, cfg.train.autocast)
    else:
        raise RuntimeError(f"rank {cluster.rank}: unexpected command {NAMES.get(op, op)} from rank 0")
