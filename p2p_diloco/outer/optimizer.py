"""The DiLoCo outer step: pure torch, no network.

DiLoCo (Douillard et al. 2023, https://arxiv.org/abs/2311.08105), Algorithm 1:

    for each round t:
        every peer i starts from the global weights theta(t-1) and runs H inner AdamW steps -> theta_i(t)
        pseudo_gradient_i = theta(t-1) - theta_i(t)
        delta(t) = sum_i w_i * pseudo_gradient_i / sum_i w_i          (averaged over the swarm)
        theta(t) = OuterOpt(theta(t-1), delta(t))                      (SGD with Nesterov momentum)

The global weights theta and the outer momentum live here, in fp32 on CPU, next to the model. Every peer applies
the same averaged pseudo-gradient with the same arithmetic, so as long as every peer receives bit-identical
averages (the swarm layer guarantees that), every peer's theta and momentum stay bit-identical.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import torch


@torch.no_grad()
def snapshot(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 CPU copies of ``params``: the initial global weights theta."""
    return [p.detach().to(device="cpu", dtype=torch.float32).clone() for p in params]


@torch.no_grad()
def pseudo_gradient(theta: Sequence[torch.Tensor], local: Iterable[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
    """Write ``theta - local`` into ``out``.

    The sign matters: with this convention the pseudo-gradient points *uphill* like an ordinary gradient, so the
    outer optimiser *subtracts* it, and outer lr 1.0 without momentum lands exactly on the averaged local weights
    (FedAvg).
    """
    for t, p, o in zip(theta, local, out, strict=True):
        torch.sub(t, p.detach().to(device="cpu", dtype=torch.float32), out=o)


@torch.no_grad()
def load_into(model_params: Iterable[torch.Tensor], theta: Sequence[torch.Tensor]) -> None:
    """Copy theta into the model's parameters (start of the next round)."""
    for p, t in zip(model_params, theta, strict=True):
        p.copy_(t.to(device=p.device, dtype=p.dtype))


class OuterOptimizer:
    """SGD with (Nesterov) momentum on the averaged pseudo-gradient, in the torch.optim.SGD convention.

    ``buf = momentum * buf + delta``; the update is ``delta + momentum * buf`` with Nesterov, else ``buf``;
    ``theta -= lr * update``. lr 1.0 and momentum 0 is FedAvg.

    The arithmetic is written out op by op (no fused/foreach kernels) so that two peers with the same inputs
    produce bit-identical outputs regardless of tensor layout or thread count.

    Args:
        theta: the global weights (fp32, CPU), updated in place.
        lr: outer learning rate (paper: 0.7).
        momentum: outer momentum (paper: 0.9).
        nesterov: Nesterov momentum (paper: true).
    """

    def __init__(self, theta: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool = True):
        self.theta = list(theta)
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.momentum_buffers = [torch.zeros_like(t) for t in self.theta]

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor]) -> None:
        """Apply one outer step with the averaged pseudo-gradient ``delta``."""
        for t, d, buf in zip(self.theta, delta, self.momentum_buffers, strict=True):
            if self.momentum:
                buf.mul_(self.momentum).add_(d)
            t.sub_(self._update(d, buf) * self.lr)

    def _update(self, d: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """The step direction, given the pseudo-gradient and the already-updated momentum buffer."""
        if not self.momentum:
            return d
        return d + buf * self.momentum if self.nesterov else buf

    @torch.no_grad()
    def lookahead(self, delta: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """``out`` = the theta that :meth:`step` would give if the average pseudo-gradient were ``delta``, with
        theta and momentum left untouched. With ``outer.overlap`` a peer starts its next round from here, its own
        pseudo-gradient standing in for the average that is still being computed (the "eager" update of Kale et
        al. 2025, https://arxiv.org/abs/2502.12996)."""
        for t, d, buf, o in zip(self.theta, delta, self.momentum_buffers, out, strict=True):
            b = buf * self.momentum + d if self.momentum else buf
            o.copy_(t - self._update(d, b) * self.lr)

    def state_tensors(self) -> list[torch.Tensor]:
        """theta followed by the momentum buffers: the outer state a joining peer downloads."""
        return self.theta + self.momentum_buffers

    @torch.no_grad()
    def load_state_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Inverse of :meth:`state_tensors` (shapes must match)."""
        n = len(self.theta)
        if len(tensors) != 2 * n:
            raise ValueError(f"expected {2 * n} outer-state tensors, got {len(tensors)}")
        for dst, src in zip(self.theta + self.momentum_buffers, tensors):
            if dst.shape != src.shape:
                raise ValueError(f"outer-state shape mismatch: {tuple(src.shape)} vs {tuple(dst.shape)}")
            dst.copy_(src.to(torch.float32))


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of ``tensors`` (in order): equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
