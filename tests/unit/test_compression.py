"""Our codecs as hivemind compressions (p2p_diloco/swarm/compression.py), through hivemind's own serialization, in
one process: what goes on the libp2p wire decodes to exactly what the codec decodes, for every codec. (The
all-reduce over real libp2p streams: tests/swarm/test_averager.py.)"""

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

from p2p_diloco.outer.codecs import CODECS, get_codec
from p2p_diloco.swarm.compression import compression_for

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_survives_hiveminds_wire_format_bit_for_bit(codec):
    tensor = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    message = serialize_torch_tensor(tensor, compression_for(codec).compression_type)
    received = deserialize_torch_tensor(message)
    assert received.shape == tensor.shape and received.dtype == torch.float32
    assert torch.equal(received.reshape(-1), get_codec(codec).round_trip(tensor.reshape(-1)))
    payload = len(message.buffer)
    assert payload == get_codec(codec).payload_bytes(tensor.numel()) or codec in ("none", "fp16")


def test_a_message_of_another_codec_is_refused():
    message = serialize_torch_tensor(torch.ones(10), compression_for("int8").compression_type)
    message.dtype = "p2p_diloco:int4"
    with pytest.raises(ValueError, match="expected a p2p_diloco:int8 tensor"):
        deserialize_torch_tensor(message)
