"""Top-k in a transformed basis, for ``outer_sweep.py --transform``: the question DeMo (arXiv 2411.19870) raises,
whether a pseudo-gradient is sparser in a DCT basis than in the parameters' own.

:class:`TransformedTopK` wraps :class:`~p2p_diloco.outer.codecs.TopKCodec`: it applies an orthonormal transform,
keeps the top-k of the coefficients (the same chunks, density and value bits), and transforms the kept part back.
It is an instrument for the simulator only (``round_trip``; no wire format): the product's codecs must decode to the
same bits on every peer, which a matrix product does not promise across BLAS builds, so a transform would need an
exact inverse before it could become one. The transforms:

- ``dct``: DCT-II of every run of ``size`` values of the flat pseudo-gradient (the 1-D chunks of DeMo; the values
  after the last whole run stay as they are);
- ``dct2``: a 2-D DCT of every ``size`` x ``size`` block of each weight matrix (DeMo's blocks; the rows and
  columns left over at the edges, and the 1-D tensors, stay as they are); ``size`` 0: of each whole matrix;
- ``hadamard``: the Walsh-Hadamard transform of every run of ``size`` values (a power of two), as ``dct``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from p2p_diloco.outer.codecs import Codec, TopKCodec

TRANSFORMS = ("dct", "dct2", "hadamard")


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix (rows are the basis vectors): ``y = D @ x``, ``x = D.T @ y``."""
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi / n * (i[None, :] + 0.5) * i[:, None]) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of order ``n`` (a power of two); symmetric, its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: the size must be a power of two, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@dataclass(frozen=True)
class TransformedTopK(Codec):
    """Top-k of the coefficients of ``transform`` (module docstring).

    Args:
        name: a label.
        inner: the top-k codec applied to the coefficients.
        transform: ``dct``, ``dct2`` or ``hadamard``.
        size: the run or block length (``dct2``: 0 = each whole matrix).
        shapes: the tensors' shapes, in the order the flat vector concatenates them (``dct2`` needs them).
    """

    inner: TopKCodec = field(default_factory=lambda: TopKCodec("topk"))
    transform: str = "dct"
    size: int = 64
    shapes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r} (known: {', '.join(TRANSFORMS)})")
        if self.transform == "dct2" and not self.shapes:
            raise ValueError("dct2 needs the tensors' shapes")
        if self.transform == "hadamard":
            hadamard_matrix(self.size)

    @property
    def align(self) -> int:
        return self.inner.align

    def apply(self, flat: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """The coefficients of ``flat`` (``inverse``: the values of coefficients ``flat``)."""
        if self.transform == "dct2":
            return self._blocks_2d(flat, inverse)
        m = dct_matrix(self.size) if self.transform == "dct" else hadamard_matrix(self.size)
        whole = flat.numel() - flat.numel() % self.size  # the values after the last whole run stay as they are
        runs = flat[:whole].view(-1, self.size)
        return torch.cat([(runs @ m if inverse else runs @ m.T).reshape(-1), flat[whole:]])

    def _blocks_2d(self, flat: torch.Tensor, inverse: bool) -> torch.Tensor:
        out, start = [], 0
        for shape in self.shapes:
            t = flat[start:start + math.prod(shape)].view(shape).clone()
            start += t.numel()
            if t.dim() == 2:
                b = self.size
                if b == 0:  # the whole matrix
                    da, db = dct_matrix(shape[0]), dct_matrix(shape[1])
                    t = da.T @ t @ db if inverse else da @ t @ db.T
                else:
                    rows, cols = shape[0] - shape[0] % b, shape[1] - shape[1] % b
                    d = dct_matrix(b)
                    blocks = t[:rows, :cols].reshape(rows // b, b, cols // b, b).permute(0, 2, 1, 3)
                    blocks = d.T @ blocks @ d if inverse else d @ blocks @ d.T
                    t[:rows, :cols] = blocks.permute(0, 2, 1, 3).reshape(rows, cols)
            out.append(t.reshape(-1))
        return torch.cat(out)

    def round_trip(self, flat: torch.Tensor) -> torch.Tensor:
        """What a receiver would get: the kept coefficients, transformed back."""
        return self.apply(self.inner.round_trip(self.apply(flat.reshape(-1).to(torch.float32))), inverse=True)


def transformed(inner: TopKCodec, spec: str, shapes: Sequence[tuple[int, ...]]) -> TransformedTopK:
    """``spec`` = ``NAME:SIZE`` (``outer_sweep.py --transform``)."""
    name, _, size = spec.partition(":")
    return TransformedTopK(f"topk-{spec}", inner=inner, transform=name, size=int(size or 0),
                           shapes=tuple(tuple(s) for s in shapes))
