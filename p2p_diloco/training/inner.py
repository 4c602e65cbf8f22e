"""Inner training: AdamW steps on the peer's own data, and evaluation.

Nothing here knows about the swarm. The inner optimizer state is local and never synchronised (DiLoCo found that
syncing it costs 3x the traffic for no gain). The learning-rate schedule is a function of the *schedule step*, the
swarm's position in it (``(round - 1) * H + inner step``; docs/glossary.md), so a peer that joins at round 40 uses
the swarm's current lr instead of re-warming.

Under torchrun the same trainer runs on every local rank with a DDP or FSDP2 model (``cluster.ClusterTrainer``), and
:class:`Replica` is what the round protocol touches of the model (``cluster.ClusterReplica`` does it through the
ranks).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch

from ..config import Config, TrainConfig
from .staging import HostStaging


def schedule_horizon(cfg: Config) -> int:
    """The inner lr schedule's cosine horizon in schedule steps: ``train.total_steps`` (0 = constant lr after warmup).

    Swarm-wide by construction: it is part of the config fingerprint and never depends on this peer's
    ``--max-rounds``, so every peer trains a round with the same lr, and a run stopped after round r and resumed
    with a larger ``--max-rounds`` continues exactly as an uninterrupted run would.
    """
    return cfg.train.total_steps


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * min_lr_ratio`` at ``total_steps``.

    With ``total_steps <= 0`` the lr stays constant after warmup.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is available")
    return torch.device(name)


def autocast_context(mode: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast where the device supports it ("auto"), always ("bf16"), or never ("off")."""
    use_bf16 = mode == "bf16" or (
        mode == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    if not use_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation: the fused kernel, on CUDA (one launch for all parameters instead of several per
    tensor) and on CPU, where it measured 2.1-2.8x faster than torch's default per-tensor loop (optimizer step 2.5
    -> 1.2 ms on the tiny model, 9.1 -> 3.3 ms at 3.3M parameters; foreach: no gain; docs/gpu.md). Only this peer's
    local weights depend on it: theta's bits come from the swarm's average, the same on every member whatever each
    one's kernel."""
    return {"fused": device.type in ("cuda", "cpu")}


class InnerTrainer:
    """Runs inner steps (AdamW, warmup + cosine, clipping, accumulation, autocast) on a causal LM.

    Args:
        model: a transformers causal LM (already on ``device``).
        cfg: the ``[train]`` section.
        next_batch: returns the next ``[batch, seq]`` LongTensor of token ids from this peer's data.
        total_steps: cosine horizon in schedule steps (0 = constant lr after warmup).
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, next_batch: Callable[[], torch.Tensor],
                 total_steps: int, device: torch.device):
        self.model, self.cfg, self.next_batch = model, cfg, next_batch
        self.total_steps, self.device = total_steps, device
        self.autocast = autocast_context(cfg.autocast, device)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **adamw_kernel(device),
        )

    def step(self, schedule_step: int) -> tuple[float, int]:
        """One optimizer step (``grad_accum`` micro-batches). Returns (mean loss, tokens trained)."""
        lr = lr_at(schedule_step, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        # the loss stays on the device until the step is done: one host sync per step, not one per micro-batch
        total_loss, tokens = torch.zeros((), device=self.device), 0
        for _ in range(self.cfg.grad_accum):
            batch = self.next_batch().to(self.device, non_blocking=True)
            with self.autocast():
                loss = self.model(input_ids=batch, labels=batch).loss
            (loss / self.cfg.grad_accum).backward()
            total_loss += loss.detach().float()
            tokens += batch.numel()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total_loss) / self.cfg.grad_accum, tokens


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[torch.Tensor], device: torch.device,
             autocast: str = "off") -> float:
    """Mean next-token cross-entropy of ``model`` over ``batches`` (the shared held-out split)."""
    was_training = model.training
    model.eval()
    ctx = autocast_context(autocast, device)
    losses = []
    for batch in batches:
        batch = batch.to(device)
        with ctx():
            losses.append(model(input_ids=batch, labels=batch).loss.float().item())
    model.train(was_training)
    return sum(losses) / len(losses)


class Replica:
    """This peer's local copy of the model as the round protocol sees it: the weights it trained, where theta is
    loaded, what is evaluated and checkpointed. One process here; a cluster peer's rank 0 uses
    :class:`p2p_diloco.local.cluster.ClusterReplica`, which does the same through its local ranks.

    Args:
        model: the (unwrapped) model; ``trainer`` trains it.
        trainer: its :class:`InnerTrainer`.
        autocast: ``train.autocast`` (used for evaluation).
    """

    def __init__(self, model: torch.nn.Module, trainer: InnerTrainer, autocast: str):
        self.model, self.trainer, self.autocast = model, trainer, autocast
        self.params = list(model.parameters())
        self.staging = HostStaging(trainer.device)  # pinned, streamed copies on CUDA; none on the CPU

    def pseudo_gradient(self, theta: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """``out = theta - local weights`` (see :func:`p2p_diloco.outer.optimizer.pseudo_gradient`)."""
        self.staging.pseudo_gradient(theta, self.params, out)

    def load(self, theta: Sequence[torch.Tensor]) -> None:
        """Start the next round from theta."""
        self.staging.load(self.params, theta)

    def evaluate(self, batches: Sequence[torch.Tensor]) -> float:
        return evaluate(self.model, batches, self.trainer.device, self.autocast)

    def model_state(self) -> dict:
        return self.model.state_dict()

    def optimizer_state(self) -> dict:
        return self.trainer.optimizer.state_dict()

    def restore(self, model_state: dict, optimizer_state: dict, data) -> None:
        """Continue from a checkpoint's model and inner optimizer (``data``: the stream, already restored)."""
        self.model.load_state_dict(model_state)
        self.trainer.optimizer.load_state_dict(optimizer_state)
