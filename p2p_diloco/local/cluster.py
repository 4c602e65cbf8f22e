"""A peer that is a cluster: K local ranks under ``torchrun`` train one replica (DDP or FSDP2); rank 0 is the peer.

Inside a peer we use torch.distributed (an existing engine); between peers, hivemind (only rank 0 imports it).
Launch: ``torchrun --standalone --nproc-per-node K -m p2p_diloco join ...`` (``peers/8xh100.sh``).

Division of labour (``outer.sharding = "rank0"``):

* **Rank 0 leads.** It runs the whole :class:`~p2p_diloco.peer.peer.Peer`: the swarm, the round protocol, the outer
  step, evaluation, checkpoints, ``--summary-json`` and the join line. Before every inner step it broadcasts a
  command, so that the decisions it takes (how many inner steps this round, the lr step, a stop) are taken once.
* **Ranks 1..K-1 follow** (:func:`follow`): they build the same model and data stream, then obey commands:
  ``STEP`` (one inner step, in lockstep), ``PARAMS`` (load the global weights theta after an outer step or a
  state download), ``STATE`` (the inner optimizer, data cursor and weights after a resume), ``GATHER`` /
  ``OPTIM`` / ``EVAL`` (FSDP: the collectives that give rank 0 the full weights or optimizer state, or evaluate),
  ``STOP``. Rank 0 reaches the model only through :class:`ClusterReplica`, which sends them.

``train.parallelism``:

* ``"ddp"``: every rank holds the full model and the gradients are averaged across ranks inside every step, so
  the pseudo-gradient rank 0 computes at the end of a round *is* the cluster's: nothing to gather. After the
  outer step rank 0 broadcasts theta.
* ``"fsdp"`` (FSDP2 ``fully_shard``, one unit per decoder layer): each rank holds 1/K of the weights, gradients
  and AdamW state. At the end of a round the full weights are gathered to rank 0's CPU (``GATHER``), and theta
  goes back out with ``broadcast_from_rank0`` (``PARAMS``). Evaluation runs on every rank (``EVAL``).

With ``outer.sharding = "rank0"`` both keep the outer state (theta, momentum) whole on rank 0's CPU. With
``"sharded"`` each rank keeps its logical shards of it and averages them with its own hivemind averagers
(:mod:`p2p_diloco.local.sharded_ranks`; the commands whose names start with ``S``).

Follower ranks ignore SIGINT/SIGTERM (torchrun sends them to every rank): rank 0 stops at a safe point and then
sends ``STOP``; a follower that left first would break rank 0's next collective and could cost it its last
checkpoint. If rank 0 dies, torchrun stops the other ranks.

Data: every rank reads the *same* stream (the peer's data order) and trains on its own contiguous rows of each
batch (``data.batch_size`` must divide by K). A K-rank peer therefore computes the same gradients as a 1-rank
peer with the same batch, up to the order of float sums (tested: tests/swarm/test_cluster.py). Each rank
tokenizes the whole stream, K times the tokenizer work of one rank, which is small next to a model's step.

"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..outer import optimizer as outer
from ..training.inner import InnerTrainer, Replica, evaluate
from .commands import EVAL, GATHER, OPTIM, PARAMS, STATE, STEP, STOP

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    """This process's place in the peer's cluster (``torchrun``'s environment) and the leader/follower protocol."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    parallelism: str = "ddp"

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
        return cls(rank, world, local_rank, device, cfg.train.parallelism)

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
        """DDP or FSDP2 over the local ranks (gradients averaged inside every inner step)."""
        if self.parallelism == "fsdp":
            from torch.distributed.fsdp import fully_shard

            layers = set(getattr(model, "_no_split_modules", None) or ())  # transformers: the decoder layer class
            for module in model.modules():
                if type(module).__name__ in layers:
                    fully_shard(module)
            return fully_shard(model)
        # The gradients are views into DDP's communication buckets: no second copy (4 bytes per parameter).
        ids = [self.local_rank] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False,
                                                         gradient_as_bucket_view=True)

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a peer batch."""
        rows = batch.shape[0] // self.world
        return batch[self.rank * rows:(self.rank + 1) * rows]

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t[0]) / self.world

    def stop_followers(self) -> None:
        """Rank 0: the run is over (or failed); the followers leave their command loop."""
        try:
            self.send(STOP)
        except Exception as e:  # a follower already gone (torchrun then stops the rest); nothing left to tell
            log.warning("could not tell the other local ranks to stop: %s", e)

    def close(self) -> None:
        """Destroy the process group while the interpreter is fully alive.

        ``destroy_process_group`` only drops torch's own reference: an FSDP model's device mesh (or anything else
        still holding the group) keeps it, and its gloo worker threads, alive until the objects are collected. If
        that happens during interpreter finalization, a thread is destroyed unjoined ("terminate called without an
        active exception", SIGABRT): seen once in about 20 FSDP follower exits under load. So whatever is
        unreachable is collected first (the callers drop their models before this), and again after.
        """
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def check(cfg: Config, world: int) -> None:
    """Settings that cannot work with ``world`` local ranks, as one-line errors."""
    if cfg.data.batch_size % world:
        raise ConfigError(f"data.batch_size ({cfg.data.batch_size}) must be a multiple of the number of local "
                          f"ranks ({world})")
    if cfg.outer.sharding == "sharded" and cfg.outer.shards < world:
        raise ConfigError(f"outer.shards ({cfg.outer.shards}) must be at least the number of local ranks ({world})")
    if cfg.train.compile:  # compiling each rank's wrapped model is not built (nor measured) yet
        raise ConfigError("train.compile does not work under torchrun with several ranks yet")
    if cfg.outer.fragments > 1:  # every rank would have to merge the synced fragment into its part of the model
        raise ConfigError("outer.fragments > 1 does not work under torchrun with several ranks yet: run the peer as "
                          "one process")
    if cfg.outer.sharding == "sharded" and cfg.swarm.allowed_peers:
        # every rank of a sharded peer averages under its own per-run identity, which no allowlist can name yet
        raise ConfigError("swarm.allowed_peers does not work with outer.sharding = sharded on several ranks yet")


class ClusterTrainer(InnerTrainer):
    """:class:`InnerTrainer` on every rank of a cluster: a DDP/FSDP model, this rank's rows of each batch; rank 0
    first tells the followers to take the same step. Returns the cluster's mean loss and total tokens."""

    def __init__(self, cluster: Cluster, model: torch.nn.Module, cfg, next_batch: Callable[[], torch.Tensor],
                 total_steps: int):
        super().__init__(cluster.wrap(model), cfg, lambda: cluster.shard(next_batch()), total_steps, cluster.device)
        self.cluster = cluster

    def step(self, schedule_step: int) -> tuple[float, int]:
        if self.cluster.rank == 0:
            self.cluster.send(STEP, schedule_step)
        loss, tokens = super().step(schedule_step)
        return self.cluster.mean(loss), tokens * self.cluster.world


class FsdpFullState:
    """FSDP2's full-state collectives, called on every rank at once (rank 0 gets the result, on CPU)."""

    def __init__(self, model: torch.nn.Module, trainer: InnerTrainer):
        from torch.distributed.checkpoint import state_dict as dcp

        self.dcp, self.model, self.trainer = dcp, model, trainer
        self.names = [n for n, _ in model.named_parameters()]  # the order of theta (built before sharding)
        self.full = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        self.scatter = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def gather(self) -> dict:
        return self.dcp.get_model_state_dict(self.model, options=self.full)

    def evaluate(self, batches, device: torch.device, autocast: str) -> float:
        """Evaluate (every rank), then reshard: a forward pass without a backward leaves the root module's
        parameters unsharded, and loading a state into it then fails (outer.overlap loads the look-ahead right
        after the boundary's evaluation)."""
        loss = evaluate(self.model, batches, device, autocast)
        self.model.reshard()
        return loss

    def gather_optimizer(self) -> dict:
        """The full inner optimizer state, or {} before the first step. Never ask torch for an empty one: it
        would create it by a step with zero gradients and lr 0, which leaves AdamW's step count at 1 and so
        changes every later step's bias correction (measured: theta 4e-3 away from the 1-rank run after 3
        rounds, instead of 2e-8). The test is the same on every rank, so they skip the collective together."""
        if not self.trainer.optimizer.state:
            return {}
        return self.dcp.get_optimizer_state_dict(self.model, self.trainer.optimizer, options=self.full)

    def load(self, model_state: dict) -> None:
        self.dcp.set_model_state_dict(self.model, model_state, options=self.scatter)

    def load_optimizer(self, optimizer_state: dict) -> None:
        """(rank 0: the full state; the others: {}.) Called only when rank 0's state is not empty."""
        self.dcp.set_optimizer_state_dict(self.model, self.trainer.optimizer, optimizer_state, options=self.scatter)


class ClusterReplica(Replica):
    """Rank 0's :class:`~p2p_diloco.training.inner.Replica`: each operation on the model goes through the local
    ranks."""

    def __init__(self, cluster: Cluster, model: torch.nn.Module, trainer: ClusterTrainer, autocast: str):
        super().__init__(model, trainer, autocast)
        self.cluster = cluster
        self.fsdp = FsdpFullState(model, trainer) if cluster.parallelism == "fsdp" else None

    def pseudo_gradient(self, theta, out) -> None:
        if not self.fsdp:  # DDP: rank 0 holds the cluster's weights
            return super().pseudo_gradient(theta, out)
        self.cluster.send(GATHER)
        full = self.fsdp.gather()
        outer.pseudo_gradient(theta, [full[n] for n in self.fsdp.names], out)

    def load(self, theta) -> None:
        self.cluster.send(PARAMS)
        if self.fsdp:
            self.fsdp.load(dict(zip(self.fsdp.names, theta, strict=True)))
        else:
            super().load(theta)
            self.cluster.broadcast_params(self.params)

    def evaluate(self, batches) -> float:
        if not self.fsdp:
            return super().evaluate(batches)
        self.cluster.send(EVAL)
        return self.fsdp.evaluate(batches, self.trainer.device, self.autocast)

    def model_state(self) -> dict:
        if not self.fsdp:
            return super().model_state()
        self.cluster.send(GATHER)
        return self.fsdp.gather()

    def optimizer_state(self) -> dict:
        if not self.fsdp:
            return super().optimizer_state()
        self.cluster.send(OPTIM)
        return self.fsdp.gather_optimizer()

    def restore(self, model_state: dict, optimizer_state: dict, data) -> None:
        """Every rank continues from the checkpoint: weights, inner optimizer and data cursor."""
        self.cluster.send(STATE)
        self.cluster.broadcast_objects([data.state_dict(), bool(optimizer_state)])
        if self.fsdp:
            self.fsdp.load(model_state)
            if optimizer_state:  # {} = saved before the first inner step (see FsdpFullState.gather_optimizer)
                self.fsdp.load_optimizer(optimizer_state)
            return
        super().restore(model_state, optimizer_state, data)
        self.cluster.broadcast_objects([optimizer_state])
        self.cluster.broadcast_params(self.params)
