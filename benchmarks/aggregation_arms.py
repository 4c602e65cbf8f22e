"""One insider in a group of n against one reducer's slice: what each aggregation method gives (issue 18, point 3).

    python -m benchmarks.aggregation_arms [--sizes 3 4 8]

Method: n - 1 honest pseudo-gradients of 4096 values that share a direction (a common Gaussian plus half as much
noise of their own, as one round's peers do), weight 1 each, and one insider, through the reducer's own
:func:`~p2p_diloco.outer.aggregation.aggregate` with the default policy of each method (the reducer is honest
member 0). Arms, both within the rules (nothing is excluded):

* ``inverse``: the negated honest direction at 9.9x the smallest honest RMS (just under ``outer.norm_bound``),
  claiming 10x the honest weight (the most the mean's weight cap lets count);
* ``alie`` ("A Little Is Enough", Baruch et al. 2019, https://arxiv.org/abs/1902.06156): the honest mean minus
  one standard deviation in every coordinate, weight 1.

Figures: the result's RMS over the honest mean's, and its cosine with the honest mean. No training: the training
benchmark of attacks is ``benchmarks.attacks``. The last line is ``worst_cos_robust=<c>``: the smallest cosine of
``trimmed_mean`` and ``centered_clip`` over every arm and size (below 0: an insider reversed a robust method).
"""

from __future__ import annotations

import argparse

import torch

from p2p_diloco.outer.aggregation import METHODS, Contribution, Policy, aggregate, rms

NUMEL = 4096


def _group(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=g)
    return [base + 0.5 * torch.randn(NUMEL, generator=g) for _ in range(n - 1)]


def _arm(name: str, honest: list[torch.Tensor]) -> Contribution:
    n, stack = len(honest) + 1, torch.stack(honest)
    mean = stack.mean(0)
    if name == "inverse":
        return Contribution(n - 1, -mean / rms(mean) * 9.9 * min(rms(h) for h in honest), 10.0)
    return Contribution(n - 1, mean - stack.std(0), 1.0)


def measure(n: int, arm: str, method: str) -> tuple[float, float, int]:
    """``(result RMS / honest mean RMS, cosine with the honest mean, exclusions)``."""
    honest = _group(n, seed=n)
    mean = torch.stack(honest).mean(0)
    cs = [Contribution(i, h, 1.0) for i, h in enumerate(honest)] + [_arm(arm, honest)]
    out, excluded = aggregate(cs, Policy(method=method), NUMEL, own=0)
    cos = float(torch.nn.functional.cosine_similarity(out.double(), mean.double(), dim=0))
    return rms(out) / rms(mean), cos, len(excluded)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[3, 4, 8])
    args = ap.parse_args(argv)
    print("| arm | n | " + " | ".join(METHODS) + " |")
    print("|---|---|" + "---|" * len(METHODS))
    worst = 1.0
    for arm in ("inverse", "alie"):
        for n in args.sizes:
            cells = []
            for method in METHODS:
                ratio, cos, excluded = measure(n, arm, method)
                cells.append(f"{ratio:.2f}, {cos:+.2f}" + (f" ({excluded} excluded)" if excluded else ""))
                if method != "mean":
                    worst = min(worst, cos)
            print(f"| {arm} | {n} | " + " | ".join(cells) + " |")
    print(f"worst_cos_robust={worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
