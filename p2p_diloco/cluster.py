"""A peer that is a cluster: K local ranks under ``torchrun`` train one replica with DDP; rank 0 alone is the peer.

Inside a peer we use torch.distributed (an existing engine); between peers, hivemind (only rank 0 imports it).
Launch: ``torchrun --standalone --nproc-per-node K -m p2p_diloco join ...`` (``peers/8xh100.sh``).

Division of labour (``outer.sharding = "rank0"``):

* **Rank 0 leads.** It runs the whole :class:`~p2p_diloco.peer.Peer`: the swarm, the round protocol, the outer
  step, evaluation, checkpoints, ``--summary-json`` and the join line. Before every inner step it broadcasts a
  command, so that the decisions it takes (how many inner steps this round, the lr step, a stop) are taken once.
* **Ranks 1..K-1 follow** (:func:`follow`): they build the same model and data stream, then obey commands:
  ``STEP`` (one inner step, in lockstep through DDP), ``PARAMS`` (receive the global weights theta after an outer
  step or a state download), ``STATE`` (receive the inner optimizer, data cursor and weights after a resume),
  ``STOP``.

With DDP every rank holds the full model, and the gradients are averaged across ranks inside every step, so the
pseudo-gradient rank 0 computes at the end of a round *is* the cluster's: there is nothing to gather. After the
outer step rank 0 broadcasts theta. Follower ranks ignore SIGINT/SIGTERM (torchrun sends them to every rank):
rank 0 stops at a safe point and then sends ``STOP``; a follower that left first would break rank 0's next
collective and could cost it its last checkpoint.

Data: every rank reads the *same* stream (the peer's data order) and trains on its own contiguous rows of each
batch (``data.batch_size`` must divide by K). A K-rank peer therefore computes the same gradients as a 1-rank
peer with the same batch, up to the order of float sums (tested: tests/swarm/test_cluster.py). Each rank
tokenizes the whole stream, K times the tokenizer work of one rank, which is small next to a model's step.

Not here yet: ``train.parallelism = "fsdp"`` and ``outer.sharding = "sharded"`` (see docs/scale.md).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .config import Config, ConfigError
from .inner import InnerTrainer

log = logging.getLogger(__name__)
STEP, PARAMS, STATE, STOP, INIT = 1, 2, 3, 4, 5
NAMES = {STEP: "STEP", PARAMS: "PARAMS", STATE: "STATE", STOP: "STOP", INIT: "INIT"}


@dataclass
class Cluster:
    """This process's place in the peer's cluster (``torchrun``'s environment) and the leader/follower protocol."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @classmethod
    def from_env(cls, cfg: Config) -> "Cluster | None":
        """Join the cluster when launched by torchrun with more than one rank; None otherwise (a 1-process peer).

        Raises:
            ConfigError: a setting that cannot work with this many ranks.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        check(cfg, world)
        if cfg.train.device in ("cuda", "auto") and torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device, backend = torch.device("cuda", local_rank), "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        # Followers block in a broadcast while rank 0 syncs with the swarm (matchmaking, stragglers, a state
        # download), so the collective timeout must outlast the longest wait of a round.
        timeout = datetime.timedelta(seconds=max(1800.0, 3 * cfg.swarm.round_timeout))
        dist.init_process_group(backend, timeout=timeout)
        return cls(rank, world, local_rank, device)

    # ----------------------------------------------------------------------------------------- protocol
    def send(self, op: int, arg: int = 0) -> None:
        """Rank 0: tell the followers what to do next."""
        dist.broadcast(torch.tensor([op, arg], dtype=torch.int64, device=self.device), src=0)

    def receive(self) -> tuple[int, int]:
        """A follower: the next command from rank 0."""
        cmd = torch.zeros(2, dtype=torch.int64, device=self.device)
        dist.broadcast(cmd, src=0)
        return int(cmd[0]), int(cmd[1])

    @torch.no_grad()
    def broadcast_params(self, params: list[torch.Tensor]) -> None:
        """Rank 0's values of ``params`` on every rank (after a ``PARAMS`` or ``STATE`` command)."""
        for p in params:
            dist.broadcast(p.data, src=0)

    def broadcast_objects(self, objects: list) -> list:
        """Rank 0's ``objects`` (picklable) on every rank."""
        box = list(objects)
        dist.broadcast_object_list(box, src=0)
        return box

    # ------------------------------------------------------------------------------------ training help
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP over the local ranks (gradients averaged inside every inner step)."""
        ids = [self.local_rank] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a peer batch."""
        rows = batch.shape[0] // self.world
        return batch[self.rank * rows:(self.rank + 1) * rows]

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t[0]) / self.world

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def check(cfg: Config, world: int) -> None:
    """Settings that cannot work with ``world`` local ranks, as one-line errors."""
    if cfg.data.batch_size % world:
        raise ConfigError(f"data.batch_size ({cfg.data.batch_size}) must be a multiple of the number of local "
                          f"ranks ({world})")
    if cfg.outer.overlap:
        raise ConfigError("outer.overlap does not work with several local ranks yet")


class ClusterTrainer(InnerTrainer):
    """:class:`InnerTrainer` on every rank of a cluster: a DDP model, this rank's rows of each batch; rank 0
    first tells the followers to take the same step. Returns the cluster's mean loss and total tokens."""

    def __init__(self, cluster: Cluster, model: torch.nn.Module, cfg, next_batch: Callable[[], torch.Tensor],
                 total_steps: int):
        super().__init__(cluster.wrap(model), cfg, lambda: cluster.shard(next_batch()), total_steps, cluster.device)
        self.cluster = cluster

    def step(self, global_step: int) -> tuple[float, int]:
        if self.cluster.rank == 0:
            self.cluster.send(STEP, global_step)
        loss, tokens = super().step(global_step)
        return self.cluster.mean(loss), tokens * self.cluster.world


class Leader:
    """Rank 0's side of the protocol, called by :class:`~p2p_diloco.peer.Peer` at the few points that matter."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def start(self, data_seed: int) -> None:
        """Before the trainer is built: the followers build the same data stream."""
        self.cluster.send(INIT, data_seed)

    def params(self, params: list[torch.Tensor]) -> None:
        """theta was loaded into the model (outer step, state download, repair)."""
        self.cluster.send(PARAMS)
        self.cluster.broadcast_params(params)

    def state(self, trainer: InnerTrainer, data, params: list[torch.Tensor]) -> None:
        """After a resume: inner optimizer, data cursor and weights, so that every rank continues identically."""
        self.cluster.send(STATE)
        self.cluster.broadcast_objects([trainer.optimizer.state_dict(), data.state_dict()])
        self.cluster.broadcast_params(params)

    def stop(self) -> None:
        try:
            self.cluster.send(STOP)
        except Exception as e:  # a follower already gone (torchrun then stops the rest); nothing left to tell
            log.warning("could not tell the other local ranks to stop: %s", e)


def follow(cfg: Config, cluster: Cluster) -> None:
    """A follower rank's whole life: build the model and data as rank 0 does, then obey its commands."""
    from .data import PackedStream
    from .model import build_model
    from .tokenizer import build_tokenizer, vocab_size

    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop (see the module docstring)
        signal.signal(sig, lambda *_: log.info("rank %d: stop requested; rank 0 will send STOP", cluster.rank))
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, vocab_size(tokenizer), cfg.run.seed).to(cluster.device)
    params = list(model.parameters())
    op, seed = cluster.receive()
    if op == STOP:
        return
    assert op == INIT, NAMES.get(op, op)
    data = PackedStream(tokenizer, cfg.data, seed)
    horizon = cfg.train.total_steps or cfg.run.max_rounds * cfg.train.inner_steps
    trainer = ClusterTrainer(cluster, model, cfg.train, data.next_batch, horizon)
    try:
        while True:
            op, arg = cluster.receive()
            if op == STEP:
                trainer.step(arg)
            elif op == PARAMS:
                cluster.broadcast_params(params)
            elif op == STATE:
                optimizer_state, data_state = cluster.broadcast_objects([None, None])
                trainer.optimizer.load_state_dict(optimizer_state)
                data.load_state_dict(data_state)
                cluster.broadcast_params(params)
            elif op == STOP:
                return
            else:
                raise RuntimeError(f"rank {cluster.rank}: unknown command {op} from rank 0")
    finally:
        data.close()
