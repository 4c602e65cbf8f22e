"""Lossy codecs for pseudo-gradients on the wire (pure torch, no network): ``none``, ``fp16``, ``bf16``, ``int8``,
``int4``, and the sparse ``topk`` (:class:`TopKCodec`).

Every codec maps a flat fp32 tensor to bytes and back. Decoding is a pure function of the bytes, so every peer
that decodes the same bytes gets the same bits; that, plus the reducer decoding its own encoded average instead
of keeping the exact one (see :mod:`p2p_diloco.swarm.exact_averager`), keeps the global weights bit-identical with
every codec. Reduction itself always happens in fp32.

``int8`` and ``int4`` are blockwise absmax quantizers: each block of ``block`` values is scaled by its largest
magnitude (stored as fp32), then rounded to the nearest of 255 (int8) or 15 (int4) symmetric levels. A block's
error is at most half a level of *its own* scale, so a few large values only cost precision in their own block.
Streaming DiLoCo (arXiv 2501.18512) trains with 4-bit outer gradients; INTELLECT-1 (arXiv 2412.01152) with int8.

``topk`` keeps, per chunk of :data:`CHUNK` values, the top ``k`` by magnitude with 2-, 4- or 8-bit values; what it
leaves out is sent in later rounds by each peer's error feedback (:mod:`p2p_diloco.outer.error_feedback`). SparseLoCo
(arXiv 2508.15706; the Covenant-72B run) sends 1-3 % of every chunk of 4,096 at 2 bits, about 146x less than fp32,
with no loss against dense DiLoCo; DeMo (arXiv 2411.19870) chunks the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CODECS = ("none", "fp16", "bf16", "int8", "int4", "topk")


@dataclass(frozen=True)
class Codec:
    """One wire format. ``encode(flat fp32) -> uint8 tensor``; ``decode(uint8, numel) -> flat fp32``."""

    name: str

    @property
    def lossless_fp32(self) -> bool:
        """True iff the encoding is the fp32 bytes themselves (receivers may then decode in place)."""
        return False

    @property
    def align(self) -> int:
        """The data plane's slices start at multiples of this many values (1: anywhere)."""
        return 1

    def payload_bytes(self, numel: int) -> int:
        """Exact encoded size of ``numel`` values."""
        raise NotImplementedError

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def round_trip(self, flat: torch.Tensor) -> torch.Tensor:
        """What a receiver of ``flat`` gets."""
        return self.decode(self.encode(flat), flat.numel())


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _check(data: torch.Tensor, expected: int, name: str) -> None:
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"{name}: expected {expected} bytes, got {data.numel()} ({data.dtype})")


@dataclass(frozen=True)
class CastCodec(Codec):
    """Store in a floating dtype (fp32 = lossless, fp16, bf16); round-to-nearest-even."""

    dtype: torch.dtype = torch.float32

    @property
    def lossless_fp32(self) -> bool:
        return self.dtype == torch.float32

    def payload_bytes(self, numel: int) -> int:
        return numel * torch.finfo(self.dtype).bits // 8

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.reshape(-1).to(torch.float32)
        if self.dtype == torch.float16:  # fp16 overflows at 65504: saturate instead of sending inf
            flat = flat.clamp(-65504.0, 65504.0)
        return _as_bytes(flat.to(self.dtype))

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        _check(data, self.payload_bytes(numel), self.name)
        return data.contiguous().view(self.dtype).to(torch.float32)


@dataclass(frozen=True)
class BlockwiseCodec(Codec):
    """Blockwise absmax quantization to ``bits`` (8 or 4) signed symmetric levels, fp32 scale per block."""

    bits: int = 8
    block: int = 128

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1  # 127 or 7

    def _blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def payload_bytes(self, numel: int) -> int:
        values = numel if self.bits == 8 else (numel + 1) // 2
        return 4 * self._blocks(numel) + values

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.reshape(-1).to(torch.float32)
        n, nb = flat.numel(), self._blocks(flat.numel())
        padded = torch.zeros(nb * self.block, dtype=torch.float32)
        padded[:n] = flat
        blocks = padded.view(nb, self.block)
        scale = blocks.abs().amax(dim=1) / self.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-self.levels, self.levels).to(torch.int8).view(-1)[:n]
        if self.bits == 4:  # two values per byte: offset to 1..15, low nibble first
            u = (q + 8).to(torch.uint8)
            if n % 2:
                u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
            packed = u[0::2] | (u[1::2] << 4)
        else:
            packed = q.view(torch.uint8)
        return torch.cat([_as_bytes(scale), packed])

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        _check(data, self.payload_bytes(numel), self.name)
        nb = self._blocks(numel)
        scale = data[: 4 * nb].contiguous().view(torch.float32)
        body = data[4 * nb:]
        if self.bits == 4:
            q = torch.stack([(body & 0x0F), (body >> 4)], dim=1).view(-1)[:numel].to(torch.int16) - 8
        else:
            q = body.contiguous().view(torch.int8)
        values = torch.zeros(nb * self.block, dtype=torch.float32)
        values[:numel] = q.to(torch.float32)
        return (values.view(nb, self.block) * scale[:, None]).view(-1)[:numel]


CHUNK = 4096  # values per chunk of ``topk``: offsets fit 12 bits


def _pack12(offsets: torch.Tensor) -> torch.Tensor:
    """12-bit values (int64, even count) -> bytes, two values per 3 bytes."""
    a, b = offsets[0::2], offsets[1::2]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0x0F) << 4), b >> 4], dim=1).reshape(-1).to(torch.uint8)


def _unpack12(data: torch.Tensor) -> torch.Tensor:
    t = data.view(-1, 3).to(torch.int64)
    a = t[:, 0] | ((t[:, 1] & 0x0F) << 8)
    b = (t[:, 1] >> 4) | (t[:, 2] << 4)
    return torch.stack([a, b], dim=1).reshape(-1)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit codes (int64, count a multiple of 8 // bits) -> bytes, lowest bits first."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return (codes.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return ((data.to(torch.int64)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)


@dataclass(frozen=True)
class TopKCodec(Codec):
    """The top ``k`` values by magnitude of every chunk of :data:`CHUNK`, ``bits`` bits each.

    Format of ``n`` values, in chunks of :data:`CHUNK` (the last one zero-padded): per chunk ``lo`` and ``hi`` (fp32:
    the smallest and the largest magnitude kept), then the ``k`` kept positions of every chunk as 12-bit offsets
    (two per 3 bytes), then their values as ``bits``-bit codes (one sign bit, ``bits - 1`` bits of magnitude on the
    grid ``lerp(lo, hi, q / (2**(bits-1) - 1))``).

    The format is closed under its own decoding (tested): encoding a decoded chunk gives back the same bits, because
    the grid's ends decode exactly (``torch.lerp`` at weight 0 and 1) and are then the smallest and the largest
    magnitude again. That lets the error feedback happen before the all-reduce: a peer sends the decoded top-k of
    (pseudo-gradient + error), and the data plane, whose slices start on chunk boundaries (:attr:`align`),
    re-encodes it without loss. A reducer re-encodes the average of its slice the same way: the union of the
    members' positions is cut back to ``k`` per chunk, so the bytes are the same in both directions.

    Args:
        name: ``"topk"``.
        density: the fraction of every chunk kept (``k = round(density * CHUNK)``, at least 1).
        bits: bits per kept value, 2, 4 or 8 (one of them the sign).
    """

    density: float = 1 / 64
    bits: int = 2

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"topk: value bits must be 2, 4 or 8, not {self.bits}")
        if not 0.0 < self.density <= 0.5:
            raise ValueError(f"topk: density must be in (0, 0.5], not {self.density}")

    @property
    def k(self) -> int:
        return max(1, round(self.density * CHUNK))

    @property
    def align(self) -> int:
        """Slices of the data plane start at multiples of this (see the class docstring)."""
        return CHUNK

    @property
    def levels(self) -> int:
        return 1 << (self.bits - 1)  # magnitudes per sign

    def _sizes(self, numel: int) -> tuple[int, int, int]:
        """Chunks, bytes of offsets, bytes of values."""
        chunks = math.ceil(numel / CHUNK)
        kept = chunks * self.k
        return chunks, 3 * math.ceil(kept / 2), math.ceil(kept * self.bits / 8)

    def payload_bytes(self, numel: int) -> int:
        chunks, offsets, values = self._sizes(numel)
        return 8 * chunks + offsets + values

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.reshape(-1).to(torch.float32)
        n = flat.numel()
        chunks, _, _ = self._sizes(n)
        padded = torch.zeros(chunks * CHUNK, dtype=torch.float32)
        padded[:n] = flat
        blocks = padded.view(chunks, CHUNK)
        magnitude, offset = blocks.abs().topk(self.k, dim=1, sorted=False)
        value = blocks.gather(1, offset)
        lo, hi = magnitude.amin(dim=1), magnitude.amax(dim=1)
        span = hi - lo
        grid = torch.where(span > 0, span, torch.ones_like(span))[:, None]
        q = torch.round((magnitude - lo[:, None]) / grid * (self.levels - 1)).clamp_(0, self.levels - 1)
        q = torch.where(span[:, None] > 0, q, torch.zeros_like(q)).to(torch.int64)
        codes = ((q << 1) | (value < 0).to(torch.int64)) & ((1 << self.bits) - 1)  # NaN input: garbage, but in bounds
        return torch.cat([_as_bytes(torch.stack([lo, hi], dim=1)), _pack12(self._even(offset.reshape(-1))),
                          _pack_bits(self._whole_bytes(codes.reshape(-1)), self.bits)])

    def _even(self, offsets: torch.Tensor) -> torch.Tensor:
        return offsets if offsets.numel() % 2 == 0 else torch.cat([offsets, offsets.new_zeros(1)])

    def _whole_bytes(self, codes: torch.Tensor) -> torch.Tensor:
        extra = -codes.numel() % (8 // self.bits)
        return codes if extra == 0 else torch.cat([codes, codes.new_zeros(extra)])

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        _check(data, self.payload_bytes(numel), self.name)
        chunks, offset_bytes, _ = self._sizes(numel)
        kept = chunks * self.k
        scales = data[: 8 * chunks].contiguous().view(torch.float32).view(chunks, 2)
        offset = _unpack12(data[8 * chunks: 8 * chunks + offset_bytes])[:kept].view(chunks, self.k)
        ordered = offset.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):  # never from encode (top-k positions are distinct);
            # forged bytes are refused alike by every peer that decodes them, rather than scattered in some order
            raise ValueError(f"{self.name}: a position sent twice in one chunk")
        codes = _unpack_bits(data[8 * chunks + offset_bytes:], self.bits)[:kept].view(chunks, self.k)
        weight = (codes >> 1).to(torch.float32) / max(self.levels - 1, 1)
        lo, hi = scales[:, :1].expand(-1, self.k), scales[:, 1:].expand(-1, self.k)
        magnitude = torch.lerp(lo, hi, weight)  # exact at weight 0 and 1: the grid's ends decode to lo and hi
        value = torch.where((codes & 1) == 1, -magnitude, magnitude)
        out = torch.zeros(chunks, CHUNK, dtype=torch.float32)
        out.scatter_(1, offset, value)
        return out.view(-1)[:numel]


def get_codec(name: str, density: float = 1 / 64, bits: int = 2) -> Codec:
    """The codec for ``outer.compression`` (``density`` and ``bits``: ``topk``'s ``outer.topk_density`` and
    ``outer.topk_bits``)."""
    codecs = {
        "none": lambda: CastCodec("none", torch.float32),
        "fp16": lambda: CastCodec("fp16", torch.float16),
        "bf16": lambda: CastCodec("bf16", torch.bfloat16),
        "int8": lambda: BlockwiseCodec("int8", bits=8, block=128),
        "int4": lambda: BlockwiseCodec("int4", bits=4, block=64),
        "topk": lambda: TopKCodec("topk", density=density, bits=bits),
    }
    if name not in codecs:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})")
    return codecs[name]()


def codec_for(outer) -> Codec:
    """The codec an :class:`~p2p_diloco.config.schema.OuterConfig` asks for."""
    return get_codec(outer.compression, outer.topk_density, outer.topk_bits)
