"""Robust aggregation: a bad peer's contribution is left out (with the right sender and a reason), robust rules
resist an outlier, and everything is deterministic and leaves its inputs alone."""

import math

import pytest
import torch

from p2p_diloco.outer.aggregation import (RANDOM_RMS, AggregationError, Contribution, Policy, aggregate, combine,
                                    corrupt_, parse_corruption, rms, validate)

pytestmark = pytest.mark.unit
NUMEL = 64


def _honest(n, seed=0, numel=NUMEL):
    g = torch.Generator().manual_seed(seed)
    return [Contribution(i, torch.randn(numel, generator=g), float(i + 1)) for i in range(n)]


MEAN = Policy(method="mean")


def _weighted_mean(cs):
    """The token-weighted mean, each weight capped at the lower median weight (as the robust default's peers)."""
    cap = sorted(c.weight for c in cs)[(len(cs) - 1) // 2]
    weights = [min(c.weight, cap) for c in cs]
    return sum(c.tensor.double() * w for c, w in zip(cs, weights)) / sum(weights)


def test_rms():
    assert rms(torch.tensor([3.0, -4.0])) == pytest.approx(math.sqrt(12.5))
    assert rms(torch.empty(0)) == 0.0


def test_the_default_is_the_trimmed_mean():
    assert Policy().method == "trimmed_mean"


def test_mean_is_weighted_mean():
    cs = _honest(4)  # weights 1, 2, 3, 4: 3 and 4 count as 2
    out, excluded = aggregate(cs, MEAN, NUMEL)
    assert excluded == {}
    assert out.dtype == torch.float32 and out.shape == (NUMEL,)
    torch.testing.assert_close(out.double(), _weighted_mean(cs), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad, reason", [
    (lambda c: Contribution(c.sender, torch.full((NUMEL,), math.nan), c.weight), "non-finite"),
    (lambda c: Contribution(c.sender, c.tensor.clone().index_fill_(0, torch.tensor([5]), math.inf), c.weight),
     "non-finite"),
    (lambda c: Contribution(c.sender, c.tensor[:-1].clone(), c.weight), "shape (63,) != (64,)"),
    (lambda c: Contribution(c.sender, c.tensor.view(8, 8).clone(), c.weight), "shape (8, 8)"),
    (lambda c: Contribution(c.sender, c.tensor.half(), c.weight), "dtype torch.float16"),
    (lambda c: Contribution(c.sender, c.tensor.clone(), 0.0), "weight 0"),
    (lambda c: Contribution(c.sender, c.tensor.clone(), -3.0), "weight -3"),
    (lambda c: Contribution(c.sender, c.tensor.clone(), math.nan), "weight nan"),
])
def test_malformed_contribution_is_excluded(bad, reason):
    cs = _honest(4)
    cs[2] = bad(cs[2])
    kept, excluded = validate(cs, Policy(), NUMEL)
    assert [c.sender for c in kept] == [0, 1, 3]
    assert list(excluded) == [2] and reason in excluded[2]
    out, _ = aggregate(cs, MEAN, NUMEL)
    torch.testing.assert_close(out.double(), _weighted_mean(kept), rtol=0, atol=1e-6)


def test_first_failing_reason_wins():
    cs = _honest(3)
    cs[1] = Contribution(1, torch.full((NUMEL,), math.nan, dtype=torch.float16), math.nan)
    _, excluded = validate(cs, Policy(), NUMEL)
    assert excluded == {1: "dtype torch.float16"}


def test_scaled_contribution_is_excluded_by_norm_bound():
    cs = _honest(4)
    cs[3] = Contribution(3, cs[3].tensor * 1000, cs[3].weight)
    kept, excluded = validate(cs, Policy(), NUMEL)
    assert [c.sender for c in kept] == [0, 1, 2]
    assert list(excluded) == [3] and excluded[3].startswith("rms ") and "> 10 x" in excluded[3]


def test_norm_bound_zero_disables_it():
    cs = _honest(4)
    cs[3] = Contribution(3, cs[3].tensor * 1000, cs[3].weight)
    kept, excluded = validate(cs, Policy(norm_bound=0.0), NUMEL)
    assert excluded == {} and [c.sender for c in kept] == [0, 1, 2, 3]


def test_with_three_or_more_the_median_is_the_reference_even_for_our_own():
    """A peer whose own pseudo-gradient is bad (a bug, bad hardware) must not let it through its own slice."""
    cs = _honest(4)
    cs[3] = Contribution(3, cs[3].tensor * 5, cs[3].weight)  # ~5x the median RMS: passes a bound of 10
    assert validate(cs, Policy(), NUMEL, own=0)[1] == {}
    cs[3] = Contribution(3, cs[3].tensor * 20, cs[3].weight)  # ~100x: excluded, even by its own reducer
    assert list(validate(cs, Policy(), NUMEL, own=3)[1]) == [3]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_claimed_weight_never_buys_more_than_the_median_share(n):
    """Issue 18, point 3: weights are self-reported token counts. Capped at norm_bound x the median, a peer in a
    pair claiming 10x got 10/11 of the mean; capped at the median weight, it gets an equal share at most."""
    cs = _honest(n)
    for c in cs:
        c.weight = 1.0
    cs[0].weight = 1e9
    out = combine(cs, Policy(method="mean", norm_bound=10.0))
    equal = sum(c.tensor for c in cs) / n
    torch.testing.assert_close(out, equal, rtol=0, atol=1e-6)
    cs[1].weight = 0.5  # a peer that trained fewer tokens still weighs less
    torch.testing.assert_close(combine(cs, MEAN).double(), _weighted_mean(cs), rtol=0, atol=1e-6)
    uncapped = combine(cs, Policy(method="mean", norm_bound=0.0))  # the cap is tied to norm_bound
    torch.testing.assert_close(uncapped, cs[0].tensor, rtol=0, atol=1e-6)


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    # Per coordinate the extremes come from different senders, so only a coordinate-wise trim removes them.
    xs = torch.tensor([[100.0, 1.0], [1.0, -100.0], [2.0, 2.0], [3.0, 3.0], [-50.0, 50.0]])
    cs = [Contribution(i, x, 1.0 + 100 * i) for i, x in enumerate(xs)]
    out = combine(cs, Policy(method="trimmed_mean", trim=0.25))  # k = max(1, int(1.25)) = 1
    torch.testing.assert_close(out, torch.tensor([2.0, 2.0]))


@pytest.mark.parametrize("n", range(1, 10))
def test_trimmed_mean_equals_the_sorted_definition(n):
    """The fast paths (no cut; one cut at each end as sum - max - min) against a float64 sort, with ties and
    values of very different sizes."""
    g = torch.Generator().manual_seed(n)
    xs = torch.randn(n, 5000, generator=g) * torch.logspace(-3, 3, n)[:, None]
    xs[:, :100] = 1.5  # ties
    cs = [Contribution(i, x.clone(), 1.0) for i, x in enumerate(xs)]
    for trim in (0.0, 0.25, 0.4):
        k = min(max(1, int(trim * n)), (n - 1) // 2) if n >= 3 else 0
        expected = torch.sort(xs.double(), dim=0).values[k:n - k].mean(dim=0).float()
        got = combine(cs, Policy(method="trimmed_mean", trim=trim))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        assert n not in (3, 4) or torch.equal(got, expected)  # the sorting networks are exact


def test_trimmed_mean_with_two_is_the_unweighted_mean():
    cs = _honest(2)
    cs[1].weight = 7.0
    out = combine(cs, Policy(method="trimmed_mean"))
    torch.testing.assert_close(out, (cs[0].tensor + cs[1].tensor) / 2)


def test_centered_clip_resists_an_outlier():
    g = torch.Generator().manual_seed(1)
    center = torch.randn(NUMEL, generator=g)
    cs = [Contribution(i, center + 0.1 * torch.randn(NUMEL, generator=g), 1.0) for i in range(3)]
    cs.append(Contribution(3, center + 5.0, 1.0))  # large but below the norm bound: validation keeps it
    honest = torch.stack([c.tensor for c in cs[:3]]).mean(0)
    out, excluded = aggregate(cs, Policy(method="centered_clip"), NUMEL)
    mean, _ = aggregate(cs, Policy(method="mean"), NUMEL)
    assert excluded == {}
    assert (out - honest).norm() < 0.2 * (mean - honest).norm()
    assert (out - honest).norm() < 0.5 * 0.1 * math.sqrt(NUMEL)


def test_centered_clip_of_identical_inputs_is_that_input():
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    cs = [Contribution(i, x.clone(), float(i + 1)) for i in range(4)]
    assert torch.equal(combine(cs, Policy(method="centered_clip")), x)


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "centered_clip"])
def test_single_contribution_is_copied(method):
    cs = _honest(1)
    out = combine(cs, Policy(method=method))
    assert torch.equal(out, cs[0].tensor) and out.data_ptr() != cs[0].tensor.data_ptr()


def test_unknown_method():
    with pytest.raises(ValueError, match="median"):
        combine(_honest(3), Policy(method="median"))


def test_everything_excluded_raises():
    cs = [Contribution(i, torch.full((NUMEL,), math.nan), 1.0) for i in range(3)]
    with pytest.raises(AggregationError):
        aggregate(cs, Policy(), NUMEL)
    with pytest.raises(AggregationError):
        aggregate([], Policy(), NUMEL)


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "centered_clip"])
def test_deterministic_and_inputs_untouched(method):
    cs = _honest(5, numel=10_000)
    cs[4] = Contribution(4, cs[4].tensor * 3, cs[4].weight)
    before = [(c.tensor.clone(), c.weight) for c in cs]
    first, _ = aggregate(cs, Policy(method=method), 10_000)
    second, _ = aggregate(cs, Policy(method=method), 10_000)
    assert torch.equal(first, second)
    assert all(torch.equal(c.tensor, t) and c.weight == w for c, (t, w) in zip(cs, before))


def test_parse_corruption():
    assert parse_corruption("nan") == ("nan", 0.0)
    assert parse_corruption("random") == ("random", 0.0)
    assert parse_corruption("scale:1000") == ("scale", 1000.0)
    assert parse_corruption("scale:-0.5") == ("scale", -0.5)
    assert parse_corruption("inverse:9.9") == ("inverse", 9.9)
    for bad in ("scale:abc", "scale:inf", "scale:nan", "scale:", "foo", "", "inverse:0", "inverse:-1", "inverse:"):
        with pytest.raises(ValueError, match="scale:<k>"):
            parse_corruption(bad)


def test_corrupt_nan_and_scale():
    a, b = torch.ones(4), torch.arange(3.0)
    corrupt_([a, b], "nan", torch.Generator())
    assert a.isnan().all() and b.isnan().all()
    a, b = torch.ones(4), torch.arange(3.0)
    corrupt_([a, b], "scale:-2", torch.Generator())
    assert torch.equal(a, torch.full((4,), -2.0)) and torch.equal(b, torch.tensor([0.0, -2.0, -4.0]))
    a = torch.ones(4)
    corrupt_([a], "inverse:9.9", torch.Generator())
    assert torch.equal(a, torch.full((4,), -9.9))


def test_corrupt_random():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3)) * 0.01
    a, b, z = x.clone(), x.clone(), torch.zeros(1000)
    corrupt_([a, z], "random", torch.Generator().manual_seed(7))
    corrupt_([b], "random", torch.Generator().manual_seed(7))
    assert rms(a) == pytest.approx(RANDOM_RMS * rms(x), rel=0.05)
    assert rms(z) == pytest.approx(RANDOM_RMS * 1e-3, rel=0.05)
    assert torch.equal(a, b) and not torch.allclose(a, x)
    # A contribution made this way is kept by validation (5x < 10x) but is no longer the honest one.
    assert validate([Contribution(0, x, 1.0), Contribution(1, a, 1.0), Contribution(2, x, 1.0)], Policy(),
                    10_000)[1] == {}


def test_two_contributions_use_only_our_own_as_the_reference():
    # of two, the smaller is always the lower median: a peer sending a tiny contribution must not get its honest
    # partner excluded, so with fewer than 3 only the reducer's own contribution (if it sent one) bounds the norm
    honest, tiny = torch.ones(8), torch.full((8,), 1e-4)
    kept, excluded = validate([Contribution(0, honest, 1.0), Contribution(1, tiny, 1.0)], Policy(), 8, own=0)
    assert excluded == {} and len(kept) == 2
    huge = torch.full((8,), 1e3)
    pair = [Contribution(0, honest, 1.0), Contribution(1, huge, 1.0)]
    assert validate(pair, Policy(), 8)[1] == {}  # nothing to compare with
    kept, excluded = validate(pair, Policy(), 8, own=0)
    assert list(excluded) == [1] and [c.sender for c in kept] == [0]


# ---------------------------------------------------------------------------------------------- insider attacks
# One insider in a group of n (issue 18, point 3): what it can do to a reducer's slice within the rules.

ROBUST = ("trimmed_mean", "centered_clip")


def _group(n, seed, numel=4096):
    """n - 1 honest pseudo-gradients sharing a direction (what peers of one round send), and their mean."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g)
    honest = [base + 0.5 * torch.randn(numel, generator=g) for _ in range(n - 1)]
    return honest, torch.stack(honest).mean(0)


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


@pytest.mark.parametrize("method", ROBUST)
@pytest.mark.parametrize("n", [3, 4, 8])
def test_inverse_arm_cannot_reverse_a_robust_method(n, method):
    """``inverse``: the negated honest direction at 9.9x the smallest honest RMS (just under the norm bound) with
    10x the honest weight (the most the weight cap allowed). centered_clip was reversed by it in groups of 3
    and 4 (cos -0.85 and -0.64) while it weighted contributions up to 10x the median; the mean is reversed at
    every size (docs/security.md)."""
    honest, mean = _group(n, seed=n)
    bad = -mean / rms(mean) * 9.9 * min(rms(h) for h in honest)
    cs = [Contribution(i, h, 1.0) for i, h in enumerate(honest)] + [Contribution(n - 1, bad, 10.0)]
    out, excluded = aggregate(cs, Policy(method=method), mean.numel(), own=0)
    assert excluded == {}  # within the rules
    assert _cos(out, mean) > 0.9 and 0.5 < rms(out) / rms(mean) < 1.5, (_cos(out, mean), rms(out) / rms(mean))


@pytest.mark.parametrize("method", ROBUST + ("mean",))
@pytest.mark.parametrize("n", [4, 8])
def test_alie_arm_moves_the_result_by_less_than_the_honest_spread(n, method):
    """``alie`` (A Little Is Enough, Baruch et al. 2019, https://arxiv.org/abs/1902.06156): the honest mean minus
    one standard deviation in every coordinate: nothing looks out of place. One insider moves the result by at
    most the honest spread (the std's RMS) at these sizes."""
    honest, mean = _group(n, seed=10 + n)
    stack = torch.stack(honest)
    spread = rms(stack.std(0))
    bad = stack.mean(0) - stack.std(0)
    cs = [Contribution(i, h, 1.0) for i, h in enumerate(honest)] + [Contribution(n - 1, bad, 1.0)]
    out, excluded = aggregate(cs, Policy(method=method), mean.numel(), own=0)
    assert excluded == {}
    assert rms(out - mean) < spread and _cos(out, mean) > 0.9


@pytest.mark.parametrize("method", ROBUST + ("mean",))
def test_ratchet_arm_cannot_grow_the_result_round_after_round(method):
    """``ratchet``: for 10 rounds, the insider sends the honest direction at just under the norm bound of the
    largest reference it could have raised (9.9x last round's result). When the reference included the median
    RMS of the swarm's recent results, every round raised the next one's bound: in a 4-peer simulation the
    result's RMS grew from 0.014 to 353 in 10 rounds with no exclusion. Now the reference is this round's own
    contributions, and the result stays within the bound of the honest ones."""
    n, previous, sizes = 4, None, []
    for round_ in range(10):
        honest, mean = _group(n, seed=100 + round_)
        scale = 9.9 * (rms(previous) if previous is not None else rms(mean))
        bad = mean / rms(mean) * scale
        cs = [Contribution(i, h, 1.0) for i, h in enumerate(honest)] + [Contribution(n - 1, bad, 1.0)]
        previous, _ = aggregate(cs, Policy(method=method), mean.numel(), own=0)
        sizes.append(rms(previous) / rms(mean))
    assert max(sizes) < 4.0, sizes  # mean: at most (3 + 9.9 x median) / 4 of the honest RMS; robust: about 1
