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
import os
from concurrent.futures import ThreadPoolExecutor
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
        self.step_on(self.theta, self.momentum_buffers, delta)

    @torch.no_grad()
    def step_on(self, theta: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                delta: Sequence[torch.Tensor]) -> None:
        """:meth:`step` on other tensors than ours (copies of them: the result of a round before it commits),
        with the same arithmetic, so the bits are the same."""
        for t, d, buf in zip(theta, delta, buffers, strict=True):
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
        """Inverse of :meth:`state_tensors`. Every count and shape is checked before anything is overwritten:
        ValueError leaves the state as it was."""
        problem = shape_problem(self.state_tensors(), tensors)
        if problem:
            raise ValueError(problem)
        for dst, src in zip(self.theta + self.momentum_buffers, tensors):
            dst.copy_(src.to(torch.float32))


def shape_problem(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor]) -> str | None:
    """Why ``theirs`` cannot replace ``ours`` tensor by tensor (count or a shape), or None."""
    if len(theirs) != len(ours):
        return f"expected {len(ours)} outer-state tensors, got {len(theirs)}"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            return f"outer-state tensor {i}: {got} where {tuple(a.shape)} is needed"
    return None


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the SHA-256 of each tensor (its shape and raw bytes), in order: equal digests mean
    bit-identical tensors. The tensors are hashed in parallel threads (hashlib releases the GIL), so theta and its
    momentum together take about as long as theta alone did on two cores."""
    return digest_of_hashes(tensor_hashes(tensors))


def tensor_hashes(tensors: Iterable[torch.Tensor]) -> list[str]:
    """The per-tensor hashes :func:`digest` combines, in order."""
    parts = [t.detach().to("cpu").contiguous() for t in tensors]
    if sum(t.numel() * t.element_size() for t in parts) < PARALLEL_BYTES:
        return [tensor_hash(t) for t in parts]
    return list(_hash_pool().map(tensor_hash, parts))


def digest_of_hashes(hashes: Sequence[str]) -> str:
    """:func:`digest` from the per-tensor hashes (:func:`tensor_hashes`)."""
    return hashlib.sha256(("tree:" + ",".join(hashes)).encode()).hexdigest()


PARALLEL_BYTES = 1 << 20  # below this, threads cost more than they save
_POOL: list[ThreadPoolExecutor] = []


def _hash_pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="digest"))
    return _POOL[0]


def tensor_hash(t: torch.Tensor) -> str:
    """The SHA-256 of one tensor's shape and raw bytes (CPU, contiguous)."""
    h = hashlib.sha256(str(tuple(t.shape)).encode())
    h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # no copy of the bytes
    return h.hexdigest()


def legacy_digest(tensors: Iterable[torch.Tensor]) -> str:
    """The digest of checkpoint format 1 (one SHA-256 over every tensor in order): only to read those files."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
