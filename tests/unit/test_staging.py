"""The staged copies of the outer state (training/staging.py): piece by piece through two bounded buffers, the plain
functions' bits. On this CPU the staged path is forced on (unpinned buffers, synchronous copies); the pinned buffers
and CUDA events need a GPU."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.outer import optimizer as outer
from p2p_diloco.training.staging import HostStaging

pytestmark = pytest.mark.unit


def _weights(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters of several shapes (one smaller than a piece, some spanning several) and a theta next to them."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (64, 9), (1,), (33, 2), (), (6, 4)]
    theta = [torch.randn(s, generator=g) for s in shapes]
    params = [torch.nn.Parameter((t + 1e-3 * torch.randn(s, generator=g)).to(dtype)) for t, s in zip(theta, shapes)]
    # a weight stored transposed (not contiguous: no flat view of it; copied tensor by tensor instead)
    params[-1] = torch.nn.Parameter(params[-1].detach().t().contiguous().t())
    assert not params[-1].is_contiguous()
    return params, theta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 8, 36, 1000, 2**20])
def test_staged_pseudo_gradient_has_the_plain_bits(dtype, chunk_bytes):
    params, theta = _weights(dtype)
    plain = [torch.empty_like(t) for t in theta]
    outer.pseudo_gradient(theta, params, plain)
    staging = HostStaging(torch.device("cpu"), chunk_bytes=chunk_bytes, staged=True)
    for _ in range(2):  # the buffers are reused from the second call on
        staged = [torch.full_like(t, float("nan")) for t in theta]
        staging.pseudo_gradient(theta, params, staged)
        for a, b in zip(plain, staged):
            assert torch.equal(a, b)
    assert all(len(buf) <= max(chunk_bytes, 4) for buf in staging.buffers)  # bounded (one element at least)


def test_mismatched_lists_are_refused():
    params, theta = _weights(torch.float32)
    staging = HostStaging(torch.device("cpu"), staged=True)
    with pytest.raises(ValueError, match="theta"):
        staging.pseudo_gradient(theta[:-1], params, [torch.empty_like(t) for t in theta])
    with pytest.raises(ValueError, match="theta"):
        staging.load(params, theta[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [8, 36, 2**20])
def test_staged_load_has_the_plain_bits(dtype, chunk_bytes):
    params, theta = _weights(dtype)
    plain = [p.detach().clone() for p in params]
    outer.load_into(plain, theta)
    HostStaging(torch.device("cpu"), chunk_bytes=chunk_bytes, staged=True).load(params, theta)
    for a, b in zip(plain, params):
        assert b.dtype == dtype and torch.equal(a, b)


def test_buffers_are_as_small_as_the_largest_tensor_needs():
    params, theta = _weights(torch.float32)
    staging = HostStaging(torch.device("cpu"), staged=True)
    staging.load(params, theta)
    assert [len(b) for b in staging.buffers] == [64 * 9 * 4] * 2


def test_not_staged_on_the_cpu_by_default():
    """A CPU peer reads its weights where they are: no buffers, no copies."""
    params, theta = _weights(torch.float32)
    staging = HostStaging(torch.device("cpu"))
    out = [torch.empty_like(t) for t in theta]
    staging.pseudo_gradient(theta, params, out)
    staging.load(params, theta)
    assert not staging.staged and staging.buffers == []
