"""The simulator's transformed top-k (benchmarks/transforms.py): its sweeps compare bases, so each transform must be
orthonormal and invertible, and keeping the top-k of the coefficients must mean what it says."""

import math

import pytest
import torch

from benchmarks.transforms import TransformedTopK, dct_matrix, hadamard_matrix, transformed
from p2p_diloco.outer.codecs import CHUNK, TopKCodec

pytestmark = pytest.mark.unit

SHAPES = ((40, 24), (24,), (17, 33))


@pytest.mark.parametrize("make", [lambda: dct_matrix(16), lambda: hadamard_matrix(16), lambda: dct_matrix(7)])
def test_the_bases_are_orthonormal(make):
    m = make()
    assert torch.allclose(m @ m.T, torch.eye(m.shape[0]), atol=1e-5)


@pytest.mark.parametrize("spec", ["dct:64", "dct:5", "hadamard:8", "dct2:8", "dct2:0"])
def test_each_transform_is_inverted_exactly_up_to_float_noise(spec):
    codec = transformed(TopKCodec("topk"), spec, SHAPES)
    x = torch.randn(sum(math.prod(s) for s in SHAPES), generator=torch.Generator().manual_seed(0))
    y = codec.apply(x)
    assert not torch.allclose(y, x)  # it transforms something
    assert torch.allclose(codec.apply(y, inverse=True), x, atol=1e-5)
    assert torch.linalg.vector_norm(y).item() == pytest.approx(torch.linalg.vector_norm(x).item(), rel=1e-5)


def test_a_signal_sparse_in_the_basis_survives_its_top_k():
    # one DCT coefficient per run of 64: dense in the parameters, 1/64 sparse in the coefficients, so a top-k at 1/64
    # with 8-bit values returns it (up to the 8-bit grid), where the same top-k in the parameters' basis cannot
    codec = transformed(TopKCodec("topk", density=1 / 64, bits=8), "dct:64", ())
    coeffs = torch.zeros(CHUNK, 64)
    coeffs[:, 3] = 1.0
    x = (coeffs @ dct_matrix(64)).reshape(-1)
    assert torch.allclose(codec.round_trip(x), x, atol=1e-5)
    plain = TopKCodec("topk", density=1 / 64, bits=8).round_trip(x)
    assert torch.linalg.vector_norm(plain - x) > 0.5 * torch.linalg.vector_norm(x)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        transformed(TopKCodec("topk"), "hadamard:12", ())
    with pytest.raises(ValueError, match="unknown transform"):
        transformed(TopKCodec("topk"), "fft:8", ())
    with pytest.raises(ValueError, match="shapes"):
        TransformedTopK("x", transform="dct2", size=8)
