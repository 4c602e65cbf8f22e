"""Parameter fragments of Streaming DiLoCo (Douillard et al. 2025, https://arxiv.org/abs/2501.18512).

With ``outer.fragments = F`` the parameters are cut into F fragments and a sync carries one fragment, not the whole
model: fragment p is synced every F syncs, at staggered points, so the peak bandwidth is 1/F of blocking DiLoCo's
for the same bytes per parameter per inner step. Pure functions, no torch state: every peer computes the same
partition from the same tensor shapes.
"""

from __future__ import annotations

from typing import Sequence

import torch


def partition(tensors: Sequence[torch.Tensor], fragments: int) -> list[list[int]]:
    """Cut the tensor list into ``fragments`` contiguous runs of tensor indices with about equal element counts.

    Contiguous (in the model's parameter order, so a transformer block stays together where the sizes allow) and
    balanced by elements (bytes on the wire): a tensor goes to the run its midpoint falls in when the total element
    count is cut into F equal spans. Every run holds at least one tensor.

    Raises:
        ValueError: fewer tensors than fragments, or ``fragments < 1``.
    """
    if fragments < 1:
        raise ValueError(f"outer.fragments must be >= 1, got {fragments}")
    if len(tensors) < fragments:
        raise ValueError(f"outer.fragments = {fragments} but the model has only {len(tensors)} parameter tensors")
    sizes = [t.numel() for t in tensors]
    total = sum(sizes)
    runs: list[list[int]] = [[] for _ in range(fragments)]
    seen = 0
    for i, n in enumerate(sizes):
        k = min(fragments - 1, (2 * seen + n) * fragments // (2 * total)) if total else 0  # by its midpoint
        # leave one tensor for every run still to come, and never skip a run
        k = max(k, fragments - (len(sizes) - i))
        k = min(k, next((j for j, run in enumerate(runs) if not run), fragments - 1))
        runs[k].append(i)
        seen += n
    return runs


def fragment_of_round(round_: int, fragments: int) -> int:
    """The fragment that the round from theta(``round_``) syncs: ``round_ mod F``, so a run's first F rounds
    touch every fragment once."""
    return round_ % fragments


def landing(local_round: int | None, round_: int, fragments: int) -> list[int] | None:
    """The fragments to merge into the local weights when theta moves to theta(``round_``) and the local weights
    were last in step with theta(``local_round``): the fragments of the rounds in between (each round changes only
    its own fragment), ``[]`` if none; None when theta must be loaded whole instead: the local weights' round is
    unknown (a fresh start, a repair), later than ``round_`` (we went back), or F or more rounds old (every
    fragment changed, and the local weights are too stale to keep)."""
    if local_round is None or round_ < local_round or round_ - local_round >= fragments:
        return None
    return [fragment_of_round(r, fragments) for r in range(local_round, round_)]


@torch.no_grad()
def mix_into(local: Sequence[torch.Tensor], theta: Sequence[torch.Tensor], alpha: float) -> None:
    """``local = alpha * local + (1 - alpha) * theta``, in place on the local weights (any device or dtype):
    Streaming DiLoCo's merge of a fragment's new global weights into the weights that kept training during its
    sync. ``alpha = 0`` replaces the local weights with theta (plain DiLoCo)."""
    for p, t in zip(local, theta, strict=True):
        t = t.to(device=p.device, dtype=p.dtype)
        if alpha == 0.0:
            p.copy_(t)
        else:
            p.mul_(alpha).add_(t, alpha=1.0 - alpha)
