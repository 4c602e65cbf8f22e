"""ValidatingPartReducer (libp2p transport): a bad contribution is left out of each part, not summed in."""

import asyncio

import pytest
import torch

from p2p_diloco.outer.aggregation import Policy
from p2p_diloco.swarm.reducer import ValidatingPartReducer

pytestmark = pytest.mark.unit


def _reduce(parts_by_sender, weights, policy=Policy()):
    """Feed every sender's parts concurrently (as the streams do); return each sender's averaged parts."""
    shapes = [p.shape for p in parts_by_sender[0]]

    async def main():
        reducer = ValidatingPartReducer(shapes, len(parts_by_sender), policy)

        async def sender(i):
            return [await reducer.accumulate_part(i, k, part, weights[i]) for k, part in enumerate(parts_by_sender[i])]

        # senders in reverse order: the result must not depend on who arrives first
        results = await asyncio.gather(*[sender(i) for i in reversed(range(len(parts_by_sender)))])
        return list(reversed(results)), reducer

    return asyncio.run(main())


def test_bad_contributions_are_left_out_per_part():
    honest = [[torch.full((4,), 1.0), torch.full((3,), 2.0)], [torch.full((4,), 3.0), torch.full((3,), 4.0)]]
    bad = [torch.tensor([0.0, float("nan"), 0.0, 0.0]), torch.full((3,), 3000.0)]
    results, reducer = _reduce([*honest, bad], [1.0, 3.0, 1.0])
    for got in results:  # every sender receives the same averages (the default trimmed_mean of two: unweighted)
        assert torch.equal(got[0], torch.full((4,), 2.0)) and torch.equal(got[1], torch.full((3,), 3.0))
    assert set(reducer.excluded) == {2} and reducer.excluded[2] == "non-finite values"
    assert reducer.failed_parts == set()


def test_honest_parts_give_the_weighted_mean():
    parts = [[torch.arange(5.0)], [torch.arange(5.0) * 3]]
    results, reducer = _reduce(parts, [1.0, 1.0])
    assert torch.equal(results[0][0], torch.arange(5.0) * 2) and reducer.excluded == {}


def test_a_part_with_no_valid_contribution_fails():
    nan = torch.full((2,), float("nan"))
    results, reducer = _reduce([[nan, torch.ones(2)], [nan, torch.ones(2)]], [1.0, 1.0])
    assert reducer.failed_parts == {0}  # the runner refuses the round (all or nothing)
    assert torch.equal(results[0][1], torch.ones(2))
