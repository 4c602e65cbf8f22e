"""The peer's local model and what trains it, as one part: tokenizer, model, held-out eval batches and training
documents (built and checked first, before the peer joins the swarm: theta(0) comes from the model), then, once the
peer id is known, the data stream (whose order derives from it), the inner trainer and the replica (the local ranks
of a cluster peer)."""

from __future__ import annotations

import torch

from ..config import Config, ConfigError
from ..local.cluster import ClusterReplica, ClusterTrainer
from ..local.commands import INIT
from .data import PackedStream, eval_batches, train_documents
from .inner import InnerTrainer, Replica, resolve_device, schedule_horizon
from .model import build_model
from .prefetch import Prefetcher
from .throughput import flops_per_token, mfu, peak_flops
from .tokenizer import build_tokenizer, vocab_size


def prepare_model(model: torch.nn.Module, cfg) -> None:
    """``train.activation_checkpointing`` and ``train.compile``, in place (the module, its parameters and its state
    dict keys stay the same objects and names: checkpoints, theta and the cluster's wrapping see the same model).

    Activation checkpointing is transformers' (non-reentrant: it works with DDP and FSDP2); compile is
    ``nn.Module.compile`` (the forward is compiled on its first call; on CPU inductor needs a C++ compiler)."""
    if cfg.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"train.activation_checkpointing: {type(model).__name__} does not support it")
        if hasattr(model, "activation_checkpointing_enable"):  # transformers' name since 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        model.compile()


class Training:
    """A peer's local model and its inner training.

    Args:
        cfg: the run config.
        cluster: the local ranks of a torchrun peer (:class:`~p2p_diloco.local.cluster.Cluster`), or None.
    """

    def __init__(self, cfg: Config, cluster=None):
        self.cfg, self.cluster = cfg, cluster
        self.device = cluster.device if cluster else resolve_device(cfg.train.device)
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        # The data first: a missing file or an unreachable hub fails in seconds, before a large model is built.
        self.eval_set = eval_batches(self.tokenizer, cfg.data, cfg.eval.batches)
        self.train_docs = train_documents(cfg.data)  # loaded (and checked) now, before the peer joins the swarm
        self.model: torch.nn.Module | None = build_model(cfg.model, vocab_size(self.tokenizer),
                                                         cfg.run.seed).to(self.device)
        prepare_model(self.model, cfg.train)
        self.params = list(self.model.parameters())
        self.flops_per_token = flops_per_token(self.model, cfg.data.seq_len)  # for MFU (throughput.py)
        self.peak_flops = peak_flops(self.device, cfg.train.peak_tflops)  # None: unknown, no MFU
        self.data_seed: int | None = None
        self.data: PackedStream | Prefetcher | None = None
        self.trainer: InnerTrainer | None = None
        self.replica: Replica | None = None

    def start(self, data_seed: int) -> None:
        """Build the data stream (in ``data_seed``'s order), the trainer and the replica."""
        cfg = self.cfg
        self.data_seed = data_seed
        self.data = PackedStream(self.tokenizer, cfg.data, data_seed, self.train_docs)
        if self.device.type == "cuda":  # made ahead in a thread, pinned for the trainer's non_blocking copy
            # (not on a CPU peer: a batch takes ~150 us there, 0.65 % of a tiny model's step, and the step's own
            # threads use every core: a worker could only take time from them; prefetch.py)
            self.data = Prefetcher(self.data, pin=True)
        horizon = schedule_horizon(cfg)
        if self.cluster:
            self.cluster.send(INIT, data_seed)  # the other ranks build the same data stream, then wrap the model
            self.trainer = ClusterTrainer(self.cluster, self.model, cfg.train, self.data.next_batch, horizon)
            self.replica = ClusterReplica(self.cluster, self.model, self.trainer, cfg.train.autocast)
        else:
            self.trainer = InnerTrainer(self.model, cfg.train, self.data.next_batch, horizon, self.device)
            self.replica = Replica(self.model, self.trainer, cfg.train.autocast)

    @property
    def tokens_per_step(self) -> int:
        return self.data.tokens_per_batch * self.cfg.train.grad_accum

    def mfu(self, tokens_per_s: float) -> float | None:
        """This peer's model FLOPs utilisation at ``tokens_per_s`` (0..1), or None when its peak is unknown. A
        cluster peer's tokens are all its ranks', and its peak is one device's times the ranks."""
        ranks = self.cluster.world if self.cluster else 1
        return mfu(tokens_per_s / ranks, self.flops_per_token, self.peak_flops)

    def step(self, schedule_step: int) -> tuple[float, int]:
        """One inner step at position ``schedule_step`` of the lr schedule: (loss, tokens)."""
        return self.trainer.step(schedule_step)

    def evaluate(self) -> float:
        return self.replica.evaluate(self.eval_set)

    def model_state(self) -> dict:
        return self.replica.model_state()

    def optimizer_state(self) -> dict:
        return self.replica.optimizer_state()

    def data_state(self) -> dict:
        return self.data.state_dict()

    def restore(self, model_state: dict, optimizer_state: dict, data_state: dict) -> None:
        """Continue from a checkpoint's model, inner optimizer and data cursor."""
        self.data.load_state_dict(data_state)
        self.replica.restore(model_state, optimizer_state, self.data)

    def close(self) -> None:
        """Close the data stream and let go of the model and its trainer (a cluster peer's process group must not
        outlive the interpreter in an FSDP model's device mesh: :meth:`Cluster.close`)."""
        if self.data is not None:
            self.data.close()
        self.trainer = self.replica = self.model = None
        self.params = []
