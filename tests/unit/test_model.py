import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from p2p_diloco.config import ConfigError, ModelConfig
from p2p_diloco.training.model import build_model, count_parameters

pytestmark = pytest.mark.unit

# Run in fresh interpreters: the digest of every parameter of the default preset built from a seed.
DIGEST = """
import hashlib, sys, torch
torch.set_num_threads(int(sys.argv[2]))
from p2p_diloco.config import ModelConfig
from p2p_diloco.training.model import build_model
h = hashlib.sha256()
for name, p in build_model(ModelConfig(), 257, int(sys.argv[1])).state_dict().items():
    h.update(name.encode()); h.update(p.numpy().tobytes())
print(h.hexdigest())
"""


def _digest(model):
    import hashlib

    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.numpy().tobytes())
    return h.hexdigest()


def _preset_param_count(cfg: ModelConfig, vocab: int) -> int:
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_heads * cfg.num_kv_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q,o + k,v + mlp + two RMSNorms
    return 2 * vocab * h + cfg.num_layers * per_layer + h  # untied embed + lm_head, final norm


def test_preset_shape_dtype_mode():
    cfg = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
    model = build_model(cfg, vocab_size=257, seed=0)
    assert isinstance(model, LlamaForCausalLM)
    assert model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert len(model.model.layers) == 3
    assert model.config.num_key_value_heads == 2 and model.config.max_position_embeddings == cfg.max_seq_len
    assert model.get_input_embeddings().weight.shape == (257, 64)
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()  # untied
    assert count_parameters(model) == _preset_param_count(cfg, 257)


def test_forward_and_backward():
    model = build_model(ModelConfig(), 257, seed=0)
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=x, labels=x).loss
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.5  # random init: near uniform
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_same_seed_same_weights_different_seed_different():
    a, b, c = (build_model(ModelConfig(), 257, seed=s) for s in (7, 7, 8))
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_seeding_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(ModelConfig(), 257, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_bit_identical_across_processes():
    """A fresh single-threaded interpreter builds the same theta(0) as this (multi-threaded) one."""
    out = subprocess.run([sys.executable, "-c", DIGEST, "5", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == _digest(build_model(ModelConfig(), 257, seed=5))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(hidden_size=130, num_heads=4), "divisible by num_heads"),
        (dict(num_heads=4, num_kv_heads=3), "divisible by num_kv_heads"),
        (dict(preset="gpt-9000"), "unknown model.preset 'gpt-9000' \\(known: tiny-llama\\)"),
    ],
)
def test_bad_preset_config(fields, message):
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig(**fields), 257, seed=0)


def _tiny_llama(vocab: int, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )


def test_config_json_keeps_its_shape_and_follows_tokenizer_vocab(tmp_path):
    _tiny_llama(vocab=100, layers=3).save_pretrained(tmp_path)
    cfg = ModelConfig(config_json=str(tmp_path / "config.json"), num_layers=2)
    model = build_model(cfg, vocab_size=257, seed=1)
    assert len(model.model.layers) == 3  # the JSON's layer count, not cfg.num_layers
    assert model.get_input_embeddings().weight.shape == (257, 32)
    assert model.get_output_embeddings().weight.shape == (257, 32)
    assert model.config.vocab_size == 257
    assert model.training
    assert _digest(model) == _digest(build_model(cfg, vocab_size=257, seed=1))  # resized rows seeded too
    assert _digest(model) != _digest(build_model(cfg, vocab_size=257, seed=2))


def test_pretrained_directory_loads_its_weights_as_float32_train(tmp_path):
    torch.manual_seed(0)
    saved = LlamaForCausalLM(_tiny_llama(vocab=257, layers=1)).to(torch.bfloat16)
    saved.save_pretrained(tmp_path)
    model = build_model(ModelConfig(name_or_path=str(tmp_path)), vocab_size=257, seed=99)
    assert model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for name, p in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], p.float()), name


def test_pretrained_is_resized_to_the_tokenizer(tmp_path):
    LlamaForCausalLM(_tiny_llama(vocab=300, layers=1)).save_pretrained(tmp_path)
    model = build_model(ModelConfig(name_or_path=str(tmp_path)), vocab_size=257, seed=0)
    assert model.get_input_embeddings().weight.shape[0] == 257 == model.config.vocab_size


@pytest.mark.parametrize("field", ["name_or_path", "config_json"])
def test_missing_paths_are_one_line_config_errors(tmp_path, field):
    with pytest.raises(ConfigError, match="^cannot load model") as info:
        build_model(ModelConfig(**{field: str(tmp_path / "missing")}), 257, seed=0)
    assert "\n" not in str(info.value)


def test_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')  # no model_type
    with pytest.raises(ConfigError, match="^cannot load model config"):
        build_model(ModelConfig(config_json=str(tmp_path / "config.json")), 257, seed=0)
