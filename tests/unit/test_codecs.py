"""Wire codecs: exact sizes, bounded error, and decoding that is a pure function of the bytes."""

import pytest
import torch

from p2p_diloco.outer.codecs import CHUNK, CODECS, get_codec

pytestmark = pytest.mark.unit
# Relative L2 error on Gaussian data (measured: fp16 2.1e-4, bf16 1.7e-3, int8 6.5e-3, int4 1.1e-1).
MAX_REL_ERROR = {"none": 0.0, "fp16": 5e-4, "bf16": 4e-3, "int8": 1e-2, "int4": 0.15,
                 "topk": 0.97}  # topk sends 1/64 of each chunk: the rest is the error feedback's (test_error_feedback)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 100_003])
def test_size_and_error(name, numel):
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.payload_bytes(numel)
    y = codec.decode(data, numel)
    assert y.dtype == torch.float32 and y.shape == (numel,)
    if numel >= 1000:
        assert _rel(y, x) <= MAX_REL_ERROR[name], _rel(y, x)
    if name == "none":
        assert torch.equal(y, x)


@pytest.mark.parametrize("name", CODECS)
def test_decoding_is_deterministic_and_idempotent(name):
    """Every peer decoding the same bytes gets the same bits; re-encoding a decoded tensor changes nothing, so a
    reducer that keeps the decoded average holds exactly what it sent."""
    codec = get_codec(name)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 1e-3
    data = codec.encode(x)
    a, b = codec.decode(data.clone(), x.numel()), codec.decode(data.clone(), x.numel())
    assert torch.equal(a, b)
    assert torch.equal(codec.round_trip(a), a)


def test_blockwise_scale_is_per_block():
    """One huge value only costs precision in its own block."""
    codec = get_codec("int8")
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[0] = 100.0
    y = codec.round_trip(x)
    assert _rel(y[128:], x[128:]) < 1e-2  # other blocks untouched by the outlier
    assert y[0] == 100.0  # the absmax itself is exact


def test_zero_and_fp16_overflow():
    for name in CODECS:
        assert torch.equal(get_codec(name).round_trip(torch.zeros(300)), torch.zeros(300))
    big = torch.tensor([1e6, -1e6, 1.0])
    assert torch.isfinite(get_codec("fp16").round_trip(big)).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        get_codec("int3")
    with pytest.raises(ValueError):
        get_codec("int8").decode(torch.zeros(10, dtype=torch.uint8), 100)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel", [1, 100, 4096, 3 * 4096 + 17])
def test_topk_keeps_the_k_largest_of_every_chunk_and_is_closed_under_its_decoding(bits, numel):
    """The k largest magnitudes of each chunk, with their signs; the smallest and largest kept magnitudes exact; and
    a decoded tensor encodes to the same bits again (what lets error feedback run before the all-reduce)."""
    codec = get_codec("topk", density=1 / 64, bits=bits)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + bits))
    y = codec.round_trip(x)
    assert torch.equal(codec.round_trip(y), y)
    for start in range(0, numel, CHUNK):
        xs, ys = x[start:start + CHUNK], y[start:start + CHUNK]
        kept = ys != 0
        k = min(codec.k, xs.numel())
        assert int(kept.sum()) <= k
        top = xs.abs().topk(k).indices
        assert set(kept.nonzero().view(-1).tolist()) <= set(top.tolist())
        assert torch.equal(torch.sign(ys[kept]), torch.sign(xs[kept]))
        assert ys.abs().max() == xs.abs()[top].max()  # hi is exact
        if bits == 8:  # 127 levels: close to every kept value
            assert ((ys[kept] - xs[kept]).abs() <= (xs.abs()[top].max() - xs.abs()[top].min()) / 126 + 1e-7).all()


def test_topk_slices_on_chunk_boundaries_lose_nothing_more():
    """The data plane cuts slices at multiples of ``align``: each slice of an encoded vector re-encodes to itself.
    A slice cut elsewhere mixes two chunks' kept values and scales, and does not."""
    codec = get_codec("topk")
    y = codec.round_trip(torch.randn(5 * CHUNK + 300, generator=torch.Generator().manual_seed(1)))
    cuts = [0, 2 * CHUNK, 3 * CHUNK, y.numel()]
    assert all(c % codec.align == 0 for c in cuts[:-1])
    for a, b in zip(cuts, cuts[1:]):
        assert torch.equal(codec.round_trip(y[a:b]), y[a:b])
    assert not torch.equal(codec.round_trip(y[CHUNK // 2:]), y[CHUNK // 2:])


def test_topk_size_and_settings():
    codec = get_codec("topk")  # 64 of 4096 at 2 bits: 8 bytes of scales, 96 of offsets, 16 of values per chunk
    assert codec.k == 64 and codec.payload_bytes(10 * CHUNK) == 10 * 120
    assert 4 * CHUNK / codec.payload_bytes(CHUNK) > 136
    assert get_codec("topk", density=0.03, bits=4).k == 123
    with pytest.raises(ValueError, match="bits"):
        get_codec("topk", bits=3)
    with pytest.raises(ValueError, match="density"):
        get_codec("topk", density=0.0)


def test_topk_refuses_a_position_sent_twice():
    """Forged bytes that name one position twice in a chunk would be scattered in an unspecified order: every peer
    refuses them alike instead."""
    codec = get_codec("topk")
    data = codec.encode(torch.randn(CHUNK, generator=torch.Generator().manual_seed(2))).clone()
    data[8:11] = torch.tensor([5, 0x50, 0], dtype=torch.uint8)  # offsets 0 and 1 become 5 and 5
    with pytest.raises(ValueError, match="twice"):
        codec.decode(data, CHUNK)
