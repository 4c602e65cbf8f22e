"""hivemind ``CompressionBase`` adapters for the codecs of :mod:`p2p_diloco.outer.codecs`.

hivemind picks a deserializer by the ``compression`` enum of each message, from a fixed protobuf enum. Our int8,
int4, bf16 and topk take the ``BLOCKWISE_8BIT``, ``UNIFORM_8BIT``, ``MEANSTD_16BIT`` and ``QUANTILE_8BIT`` slots
(the stock 8-bit codecs need bitsandbytes or crash on numpy >= 2.4, field notes item 8; hivemind's own bfloat16
path sends fp32 unless ``USE_LEGACY_BFLOAT16`` is off). fp16 and none are hivemind's.
:func:`install` registers them; it runs when this module is imported, in the host process, before the averager
process forks, so both hold the same table. Each message also names its codec in ``dtype``, and decoding checks
it: a peer with another codec table fails loudly instead of misreading bytes.
"""

from __future__ import annotations

import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import serialization
from hivemind.proto import runtime_pb2

from ..outer.codecs import Codec, TopKCodec, get_codec


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


class ChunkedCompression(CodecCompression):
    """``topk`` as a hivemind compression: its libp2p parts hold whole chunks.

    hivemind cuts each tensor into parts of ``int(part_size_bytes / (element_size * estimate_compression_ratio))``
    values from the tensor's start; the estimate returned here makes that a whole number of the codec's chunks
    (about ``part_size_bytes`` encoded), so that a part re-encodes its members' sparse tensors without loss.
    """

    def __init__(self, codec: TopKCodec, part_size_bytes: int):
        super().__init__(codec, runtime_pb2.CompressionType.QUANTILE_8BIT)
        self.tag = f"p2p_diloco:topk:{codec.density}:{codec.bits}"  # a peer with other settings fails loudly
        chunks = max(1, round(part_size_bytes / codec.payload_bytes(codec.align)))
        # + 0.5: hivemind's int() of the quotient then lands on the whole number, whatever the float rounding
        self.ratio = part_size_bytes / (4 * (chunks * codec.align + 0.5))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.ratio


def compression_for(codec: Codec | str, part_size_bytes: int = 2**20) -> CompressionBase:
    """The hivemind compression for the run's codec (:func:`~p2p_diloco.outer.codecs.codec_for`, or a codec name
    with its default settings). ``topk``'s slot is set to the run's own density and bits here, in the host process
    before its averagers fork; ``part_size_bytes``: the averager's (``swarm.part_size_bytes``)."""
    install()
    codec = get_codec(codec) if isinstance(codec, str) else codec
    if isinstance(codec, TopKCodec):
        topk = ChunkedCompression(codec, part_size_bytes)
        serialization._BASE_COMPRESSION_TYPES["QUANTILE_8BIT"] = topk
        return topk
    table = {"none": NoCompression(), "fp16": Float16Compression(), "bf16": _BF16,
             "int8": _INT8, "int4": _INT4}
    if codec.name not in table:
        raise ValueError(f"unknown outer.compression {codec.name!r}")
    return table[codec.name]


install()
