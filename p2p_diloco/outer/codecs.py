"""Lossy codecs for pseudo-gradients on the wire (pure torch, no network): ``none``, ``fp16``, ``bf16``, ``int8``,
``int4``.

Every codec maps a flat fp32 tensor to bytes and back. Decoding is a pure function of the bytes, so every peer
that decodes the same bytes gets the same bits; that, plus the reducer decoding its own encoded average instead
of keeping the exact one (see :mod:`p2p_diloco.swarm.exact_averager`), keeps the global weights bit-identical with
every codec. Reduction itself always happens in fp32.

``int8`` and ``int4`` are blockwise absmax quantizers: each block of ``block`` values is scaled by its largest
magnitude (stored as fp32), then rounded to the nearest of 255 (int8) or 15 (int4) symmetric levels. A block's
error is at most half a level of *its own* scale, so a few large values only cost precision in their own block.
Streaming DiLoCo (arXiv 2501.18512) trains with 4-bit outer gradients; INTELLECT-1 (arXiv 2412.01152) with int8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CODECS = ("none", "fp16", "bf16", "int8", "int4")


@dataclass(frozen=True)
class Codec:
    """One wire format. ``encode(flat fp32) -> uint8 tensor``; ``decode(uint8, numel) -> flat fp32``."""

    name: str

    @property
    def lossless_fp32(self) -> bool:
        """True iff the encoding is the fp32 bytes themselves (receivers may then decode in place)."""
        return False

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


def get_codec(name: str) -> Codec:
    """The codec for ``outer.compression``."""
    codecs = {
        "none": CastCodec("none", torch.float32),
        "fp16": CastCodec("fp16", torch.float16),
        "bf16": CastCodec("bf16", torch.bfloat16),
        "int8": BlockwiseCodec("int8", bits=8, block=128),
        "int4": BlockwiseCodec("int4", bits=4, block=64),
    }
    if name not in codecs:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})")
    return codecs[name]
