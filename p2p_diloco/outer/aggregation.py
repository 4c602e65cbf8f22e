"""Robust aggregation and validation of pseudo-gradient contributions (pure torch, no network).

Why: in the butterfly all-reduce every peer is the reducer of one slice ("part") of the flat pseudo-gradient, and
it averages what the group's peers sent for that part. A single bad peer (a bug, a diverged run, bad hardware or
malice) that sends NaN, Inf or an absurdly large contribution would, with a plain mean, poison the global weights
of the whole swarm in one outer step. So the reducer first *validates* each contribution (shape, dtype, weight,
finiteness, a norm bound relative to the group's median RMS) and leaves the bad ones out instead of averaging them
in, then *combines* the rest with the configured rule: a weighted ``mean``, a coordinate-wise ``trimmed_mean``
(Yin et al. 2018, https://arxiv.org/abs/1803.01498) or ``centered_clip`` (Karimireddy, He, Jaggi 2021,
https://arxiv.org/abs/2012.10333).

Each reducer applies this to its own slice only, so the butterfly layout keeps the work local (n x part memory,
no extra round trip). The result does not need to be reproducible across machines: only the reducer computes it,
and every peer decodes the reducer's bytes, so the global weights stay bit-identical across peers. It is
deterministic for the same inputs (no random ops). :func:`corrupt_` is a test-only hook that turns a peer into a
malicious one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

METHODS = ("mean", "trimmed_mean", "centered_clip")
RANDOM_RMS = 5.0
_CORRUPTION_FORMS = "'nan', 'scale:<k>' (finite k), 'inverse:<k>' (finite k > 0) or 'random'"


class AggregationError(RuntimeError):
    """No contribution is left to aggregate (all of them were excluded, or there were none)."""


@dataclass(frozen=True)
class Policy:
    """How a reducer validates and combines the contributions to its part.

    Attributes:
        method: One of :data:`METHODS`.
        norm_bound: A contribution whose RMS exceeds ``norm_bound`` x the reference RMS is excluded, and each weight
            is capped at the median weight; 0 turns both off.
        trim: ``trimmed_mean``: fraction of the contributions cut at each end of every coordinate.
        clip_iters: ``centered_clip``: number of clipping iterations.
    """

    method: str = "trimmed_mean"
    norm_bound: float = 10.0
    trim: float = 0.25
    clip_iters: int = 3


@dataclass
class Contribution:
    """What one peer sent for this part: ``sender`` (its index in the group), ``tensor`` (1-D fp32) and
    ``weight`` (tokens trained)."""

    sender: int
    tensor: torch.Tensor
    weight: float


def rms(t: torch.Tensor) -> float:
    """Root mean square of ``t``, accumulated in float64 (no float64 copy of ``t``); 0.0 for an empty tensor."""
    if t.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) / math.sqrt(t.numel())


def _lower_median(values: Sequence[float]) -> float:
    """Element ``(n - 1) // 2`` of the sorted values (an actual value, never an average of two)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _basic_check(c: Contribution, numel: int) -> str | None:
    """Reason why ``c`` is malformed (rules 1-2 of :func:`validate`), or None if it is well-formed."""
    t = c.tensor
    if not isinstance(t, torch.Tensor):
        return f"not a tensor ({type(t).__name__})"
    if t.dim() != 1 or t.numel() != numel:
        return f"shape {tuple(t.shape)} != {(numel,)}"
    if t.dtype != torch.float32:
        return f"dtype {t.dtype}"
    try:
        weight = float(c.weight)
    except (TypeError, ValueError):
        return f"weight {c.weight!r}"
    if not math.isfinite(weight) or weight <= 0:
        return f"weight {weight}"
    return None


def validate(contributions: Sequence[Contribution], policy: Policy, numel: int, own: int | None = None,
             known_rms: Mapping[int, float] | None = None) -> tuple[list[Contribution], dict[int, str]]:
    """Split the contributions into the kept ones and the excluded ones.

    Rules, in order (the first failing one is the reason): the tensor is 1-D with ``numel`` float32 values; the
    weight is finite and > 0; every value is finite; if ``policy.norm_bound > 0``, its RMS is at most
    ``norm_bound`` x the reference. The reference is the lower median RMS of the contributions that passed the
    first rules, with 3 or more of them: no minority can raise it (the lower median of n values moves only if half
    of them do). With fewer than 3 the median says nothing about which one is wrong (of two, the smaller would
    always be "the median", and a peer sending a tiny contribution would get an honest partner excluded), so the
    reference is the RMS of the reducer's own contribution (``own``), if it sent one: a fact it observed itself.
    (The reference used to be raised by the median RMS of the swarm's last averaged outputs, which a contribution
    just under the bound raised every round: a ratchet, issue 18.)

    Args:
        contributions: One contribution per sender.
        policy: The aggregation policy.
        numel: The number of values of this part.
        own: The ``sender`` of the reducer's own contribution (None: the reducer sent none, or is not known).
        known_rms: ``{sender: rms(tensor)}`` computed ahead (the data plane does it as each contribution arrives,
            off the sync's critical path); the others are computed here.

    Returns:
        The kept contributions in input order, and ``{sender: reason}`` for the excluded ones.
    """
    excluded: dict[int, str] = {}
    passed: list[Contribution] = []
    for c in contributions:
        reason = _basic_check(c, numel)
        if reason is None:
            passed.append(c)
        else:
            excluded[c.sender] = reason
    # Rule 3 from the RMS, accumulated in float64: it is finite exactly when every value is (a float32 squared
    # cannot overflow a double), and one pass of it costs a quarter of torch.isfinite(t).all() (the sync's hot
    # path: issue 18, point 6).
    known_rms = known_rms or {}
    norms = [known_rms[c.sender] if c.sender in known_rms else rms(c.tensor) for c in passed]
    for c, r in zip(passed, norms):
        if not math.isfinite(r):
            excluded[c.sender] = "non-finite values"
    passed, norms = ([c for c, r in zip(passed, norms) if math.isfinite(r)],
                     [r for r in norms if math.isfinite(r)])
    if policy.norm_bound <= 0 or not passed:
        return passed, excluded
    ours = [r for c, r in zip(passed, norms) if own is not None and c.sender == own]
    reference = _lower_median(norms) if len(norms) >= 3 else (ours[0] if ours else 0.0)
    kept = []
    for c, r in zip(passed, norms):
        if reference > 0 and r > policy.norm_bound * reference:
            excluded[c.sender] = f"rms {r:.2g} > {policy.norm_bound:g} x {reference:.2g}"
        else:
            kept.append(c)
    return kept, excluded


def _capped_weights(kept: Sequence[Contribution], policy: Policy) -> torch.Tensor:
    """Float64 weights, each capped at the lower median weight (if ``norm_bound > 0``).

    The weights are self-reported token counts: a cap any higher lets one peer buy a majority share of a pair
    (a cap of f x the other's weight gives it f / (f + 1)) or, above 2 x, of a group of three. So a weight counts
    only downwards: a peer that trained fewer tokens than the median weighs less, none weighs more."""
    weights = [float(c.weight) for c in kept]
    if policy.norm_bound > 0:
        cap = _lower_median(weights)
        weights = [min(w, cap) for w in weights]
    return torch.tensor(weights, dtype=torch.float64, device=kept[0].tensor.device)


def _trimmed_mean(tensors: Sequence[torch.Tensor], trim: float) -> torch.Tensor:
    """Coordinate-wise trimmed mean (Yin et al. 2018, https://arxiv.org/abs/1803.01498), as float32.

    Unweighted on purpose: with n >= 3 a weighted trim has no clean definition, and the weights are exactly what an
    attacker controls. With n <= 2 nothing is trimmed (plain unweighted mean).

    On the sync's hot path (it is the default), so without a float64 stack or a sort where it can. Groups of 3
    and 4 (one value cut at each end) take a sorting network of coordinate-wise min and max, which is exact: the
    median of 3, and the float64 mean of the middle two of 4; larger groups take the float64 sum minus the k
    largest and k smallest values of every coordinate. The networks give the correctly rounded float32 of the
    sorted definition's float64 mean; the general path equals it but where its float64 sum rounds (values of one
    coordinate whose magnitudes differ by more than 2^29).
    """
    n = len(tensors)
    k = min(max(1, int(trim * n)), (n - 1) // 2) if n >= 3 else 0
    if k == 0:
        out = tensors[0].to(torch.float64, copy=True)
        for t in tensors[1:]:
            out.add_(t)
        return out.div_(n).to(torch.float32)
    if k == 1 and n == 3:
        a, b, c = tensors
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    if k == 1 and n == 4:
        a, b, c, d = tensors
        second = torch.maximum(torch.minimum(a, b), torch.minimum(c, d))  # the two middle values of every coordinate
        third = torch.minimum(torch.maximum(a, b), torch.maximum(c, d))
        return second.to(torch.float64).add_(third).mul_(0.5).to(torch.float32)
    # The general path: the float64 sum minus the k largest and the k smallest values of every coordinate, found
    # by insertion with min/max (exact; 4k elementwise ops a contribution, where a sort of the stack cost 10x as
    # much at n = 8, k = 2 and made it the sync's largest cost).
    total = tensors[0].to(torch.float64, copy=True)
    for t in tensors[1:]:
        total.add_(t)
    for extreme in (*_running_extremes(tensors, k, torch.maximum, torch.minimum),
                    *_running_extremes(tensors, k, torch.minimum, torch.maximum)):
        total.sub_(extreme)
    return total.div_(n - 2 * k).to(torch.float32)


def _running_extremes(tensors: Sequence[torch.Tensor], k: int, better, worse) -> list[torch.Tensor]:
    """The k most extreme values of every coordinate (``better``: torch.maximum for the largest), by insertion."""
    kept: list[torch.Tensor] = []
    for t in tensors:
        x = t
        for j in range(len(kept)):
            kept[j], x = better(kept[j], x), worse(kept[j], x)
        if len(kept) < k:
            kept.append(x)
    return kept


def _centered_clip(stack: torch.Tensor, weights: torch.Tensor, iters: int) -> torch.Tensor:
    """Centered clipping (Karimireddy, He, Jaggi 2021, https://arxiv.org/abs/2012.10333).

    Starts at the coordinate-wise lower median; the clipping radius ``tau`` is the lower median of the distances
    to it, so a minority of far-away contributions moves the result by at most ``tau`` times their weight share.
    """
    n = stack.shape[0]
    v = torch.sort(stack, dim=0).values[(n - 1) // 2]
    tau = _lower_median((stack - v).norm(dim=1).tolist())
    total = weights.sum()
    for _ in range(iters):
        if tau == 0:
            break
        diff = stack - v
        dist = diff.norm(dim=1)
        factor = torch.ones_like(dist)
        far = dist > tau
        factor[far] = tau / dist[far]
        v = v + ((weights * factor)[:, None] * diff).sum(dim=0) / total
    return v


def combine(kept: Sequence[Contribution], policy: Policy) -> torch.Tensor:
    """Combine validated contributions into one new 1-D float32 tensor (inputs are left untouched).

    ``mean`` is a running fp32 sum; ``trimmed_mean`` (the default: on every round's hot path) accumulates in
    float64 without sorting where it can; ``centered_clip`` computes in float64. Weights are capped at the lower
    median weight for ``mean`` and ``centered_clip`` (when ``norm_bound > 0``) so that no peer can claim a huge
    token count to dominate. ``mean`` is not robust to an insider: one contribution just under the norm bound, in
    the negated honest direction, reverses it (docs/security.md, ``benchmarks/attacks.py``).

    Args:
        kept: The contributions to combine (normally the output of :func:`validate`).
        policy: Selects the method: ``mean`` (weighted), ``trimmed_mean`` (coordinate-wise, unweighted) or
            ``centered_clip`` (weighted).

    Raises:
        ValueError: Unknown method.
        AggregationError: ``kept`` is empty.
    """
    if policy.method not in METHODS:
        raise ValueError(f"unknown aggregation method {policy.method!r}; expected one of {METHODS}")
    if not kept:
        raise AggregationError("no contribution to combine")
    if len(kept) == 1:
        return kept[0].tensor.detach().to(torch.float32).clone()
    if policy.method == "mean":  # a running fp32 sum, as hivemind's reducer does
        weights = _capped_weights(kept, policy).tolist()
        out = torch.zeros_like(kept[0].tensor, dtype=torch.float32)
        for c, w in zip(kept, weights):
            out.add_(c.tensor.detach(), alpha=w)
        return out.div_(sum(weights))
    if policy.method == "trimmed_mean":
        return _trimmed_mean([c.tensor.detach().to(torch.float32) for c in kept], policy.trim)
    # No weight above the median one: the weights are self-reported, and with norm_bound x the median an insider
    # sending the negated honest direction just under the norm bound reversed the result in groups of 3 and 4
    # (tests/unit/test_aggregation.py, the "inverse" arm); capped at the median it cannot.
    stack = torch.stack([c.tensor.detach().double() for c in kept])
    return _centered_clip(stack, _capped_weights(kept, policy), policy.clip_iters).to(torch.float32)


def aggregate(contributions: Sequence[Contribution], policy: Policy, numel: int,
              own: int | None = None) -> tuple[torch.Tensor, dict[int, str]]:
    """Validate, then combine, the contributions to one part: returns (aggregate, ``{sender: reason}``).

    Raises:
        AggregationError: Every contribution was excluded (the message lists why).
    """
    kept, excluded = validate(contributions, policy, numel, own)
    if not kept:
        why = "; ".join(f"{sender}: {reason}" for sender, reason in excluded.items()) or "none received"
        raise AggregationError(f"no contribution left to aggregate ({why})")
    return combine(kept, policy), excluded


def parse_corruption(mode: str) -> tuple[str, float]:
    """Parse a corruption mode: ``"nan"``, ``"scale:<k>"``, ``"inverse:<k>"`` or ``"random"`` into ``(kind, k)``.

    Raises:
        ValueError: Any other form, or a non-finite / unparsable ``k``.
    """
    if mode in ("nan", "random"):
        return mode, 0.0
    for kind in ("scale", "inverse"):
        if isinstance(mode, str) and mode.startswith(kind + ":"):
            try:
                k = float(mode[len(kind) + 1:])
            except ValueError:
                k = math.nan
            if math.isfinite(k) and (kind == "scale" or k > 0):
                return kind, k
    raise ValueError(f"bad corruption mode {mode!r}: expected {_CORRUPTION_FORMS}")


def corrupt_(tensors: Sequence[torch.Tensor], mode: str, generator: torch.Generator) -> None:
    """Test-only hook that makes a malicious peer: corrupt every tensor in place.

    Args:
        tensors: The tensors to corrupt (floating point).
        mode: ``"nan"`` fills with NaN; ``"scale:<k>"`` multiplies by k; ``"inverse:<k>"`` multiplies by -k (an
            insider's best guess of the honest direction is its own pseudo-gradient: it sends the opposite, k x
            as large, just under the norm bound for k < ``outer.norm_bound``); ``"random"`` replaces with Gaussian
            noise whose RMS is :data:`RANDOM_RMS` x the tensor's own RMS (1e-3 if that is 0).
        generator: Source of the noise for ``"random"``.
    """
    kind, k = parse_corruption(mode)
    with torch.no_grad():
        for t in tensors:
            if kind == "nan":
                t.fill_(math.nan)
            elif kind == "scale":
                t.mul_(k)
            elif kind == "inverse":
                t.mul_(-k)
            elif t.numel() > 0:
                target = RANDOM_RMS * (rms(t) or 1e-3)
                noise = torch.randn(t.shape, generator=generator, dtype=torch.float32, device=t.device)
                noise_rms = rms(noise)
                t.copy_(noise * (target / noise_rms) if noise_rms > 0 else noise)
