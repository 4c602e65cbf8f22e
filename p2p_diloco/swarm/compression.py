"""hivemind ``CompressionBase`` adapters for the codecs of :mod:`p2p_diloco.outer.codecs`.

hivemind picks a deserializer by the ``compression`` enum of each message, from a fixed protobuf enum. Our int8,
int4 and bf16 take the ``BLOCKWISE_8BIT``, ``UNIFORM_8BIT`` and ``MEANSTD_16BIT`` slots (the stock 8-bit codecs
need bitsandbytes or crash on numpy >= 2.4, field notes item 8; hivemind's own bfloat16 path sends fp32 unless
``USE_LEGACY_BFLOAT16`` is off). fp16 and none are hivemind's.
:func:`install` registers them; it runs when this module is imported, in the host process, before the averager
process forks, so both hold the same table. Each message also names its codec in ``dtype``, and decoding checks
it: a peer with another codec table fails loudly instead of misreading bytes.
"""

from __future__ import annotations

import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import serialization
from hivemind.proto import runtime_pb2

from ..outer.codecs import Codec, get_codec


class CodecCompression(CompressionBase):
    """Wraps a :class:`~p2p_diloco.outer.codecs.Codec` (bf16/int8/int4) as a hivemind compression."""

    def __init__(self, codec: Codec, compression_type: int):
        self.codec, self.compression_type = codec, compression_type
        self.tag = f"p2p_diloco:{codec.name}"

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        data = self.codec.encode(tensor.detach().reshape(-1))
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=data.numpy().tobytes(),
                                  size=tensor.shape, dtype=self.tag, requires_grad=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized_tensor.dtype != self.tag:
            raise ValueError(f"expected a {self.tag} tensor, got dtype {serialized_tensor.dtype!r}")
        shape = torch.Size(serialized_tensor.size)
        data = torch.frombuffer(bytearray(serialized_tensor.buffer), dtype=torch.uint8)
        return self.codec.decode(data, shape.numel()).view(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        numel = max(1, info.descriptor.numel())
        return self.codec.payload_bytes(numel) / (4 * numel)


_INT8 = CodecCompression(get_codec("int8"), runtime_pb2.CompressionType.BLOCKWISE_8BIT)
_INT4 = CodecCompression(get_codec("int4"), runtime_pb2.CompressionType.UNIFORM_8BIT)
_BF16 = CodecCompression(get_codec("bf16"), runtime_pb2.CompressionType.MEANSTD_16BIT)


def install() -> None:
    """Register our int8/int4 deserializers in hivemind's table (idempotent)."""
    serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = _INT8
    serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = _INT4
    serialization._BASE_COMPRESSION_TYPES["MEANSTD_16BIT"] = _BF16


def compression_for(name: str) -> CompressionBase:
    """The hivemind compression for ``outer.compression``."""
    install()
    table = {"none": NoCompression(), "fp16": Float16Compression(), "bf16": _BF16,
             "int8": _INT8, "int4": _INT4}
    if name not in table:
        raise ValueError(f"unknown outer.compression {name!r}")
    return table[name]


install()
