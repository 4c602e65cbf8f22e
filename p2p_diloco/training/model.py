"""The causal LM every peer trains: a preset, a transformers config JSON, or a pretrained checkpoint.

DiLoCo averages *changes* to the weights, so every peer must start from the same theta(0). Random
initial weights therefore come from the run seed alone, drawn from a private copy of torch's CPU RNG:
two processes that build the same config with the same seed hold bit-identical parameters.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from p2p_diloco.config import ConfigError, ModelConfig
from p2p_diloco.training.hub import load_named, short_reason

PRESETS = ("tiny-llama",)


def _preset_config(cfg: ModelConfig, vocab_size: int) -> LlamaConfig:
    """The ``tiny-llama`` preset: a Llama whose shape comes from the ``[model]`` fields."""
    if cfg.preset not in PRESETS:
        raise ConfigError(f"unknown model.preset {cfg.preset!r} (known: {', '.join(PRESETS)})")
    if cfg.num_heads <= 0 or cfg.num_kv_heads <= 0 or cfg.hidden_size <= 0 or cfg.intermediate_size <= 0:
        raise ConfigError("model.hidden_size, intermediate_size, num_heads and num_kv_heads must be > 0")
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"model.hidden_size ({cfg.hidden_size}) must be divisible by num_heads ({cfg.num_heads})")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"model.num_heads ({cfg.num_heads}) must be divisible by num_kv_heads ({cfg.num_kv_heads})")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False,
    )


def _json_config(path: str) -> PretrainedConfig:
    """A transformers ``config.json`` (it must name its ``model_type``); its own shape is kept as is."""
    if not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(f"cannot load model config {path}: no such file")
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(path))
    except Exception as e:  # bad JSON, unknown model_type, ...
        raise ConfigError(f"cannot load model config {path}: {short_reason(e)}") from None


def _from_config(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """Randomly initialise ``config`` from ``seed`` without disturbing the caller's RNG stream."""
    # fork_rng restores the global CPU RNG afterwards; seeding only the CPU generator (not torch.manual_seed)
    # keeps the CUDA generators untouched, since the model is built on the CPU anyway.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        try:
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError as e:  # e.g. a config type that has no causal-LM head
            raise ConfigError(f"cannot build a causal LM from {type(config).__name__}: {short_reason(e)}") from None


def _from_pretrained(name: str) -> PreTrainedModel:
    def load(path: str, **kwargs) -> PreTrainedModel:
        # transformers 5 loads in the checkpoint's dtype by default; training wants float32 master weights.
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)

    return load_named("model", name, load)


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """Build the causal LM described by ``cfg``: float32, on the CPU, in train mode.

    Args:
        cfg: ``name_or_path`` (pretrained weights) wins over ``config_json`` (random init of that
            architecture), which wins over ``preset`` (a Llama shaped by the ``[model]`` fields).
        vocab_size: the tokenizer's vocabulary size; the embeddings are resized to it if they differ.
        seed: random initial weights depend only on this (bit-identical across processes).

    Returns:
        The model, ready for training.

    Raises:
        ConfigError: bad shape, unknown preset, or a config/checkpoint that cannot be loaded.
    """
    if vocab_size <= 0:
        raise ConfigError(f"vocab_size must be > 0, got {vocab_size}")
    if cfg.name_or_path:
        model = _from_pretrained(cfg.name_or_path)
    elif cfg.config_json:
        model = _from_config(_json_config(cfg.config_json), seed)
    else:
        model = _from_config(_preset_config(cfg, vocab_size), seed)

    if model.get_input_embeddings().weight.shape[0] != vocab_size:
        # New rows are random, so they too must come from the seed. Mean resizing (new rows drawn
        # around the old embeddings) only makes sense for trained embeddings.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            model.resize_token_embeddings(vocab_size, mean_resizing=bool(cfg.name_or_path))
    return model.to(device="cpu", dtype=torch.float32).train()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights are counted once)."""
    return sum(p.numel() for p in model.parameters())
