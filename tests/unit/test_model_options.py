"""``train.activation_checkpointing`` and ``train.compile`` (training/part.py: prepare_model): the same model, the
same gradients, the same names."""

from __future__ import annotations

import copy

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.errors import ConfigError
from p2p_diloco.training.inner import InnerTrainer
from p2p_diloco.training.model import build_model
from p2p_diloco.training.part import prepare_model

pytestmark = pytest.mark.unit
MICRO = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
         "model.intermediate_size=64", "train.warmup_steps=1"]


def _train(sets: list[str], steps: int = 2, calls: list | None = None) -> tuple[list[float], dict]:
    cfg = load_config(None, MICRO + sets)
    model = build_model(cfg.model, 257, 0)
    prepare_model(model, cfg.train)
    if calls is not None:  # counts the forward passes of the first layer's MLP
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # (a recomputation may
        # stop inside the layer once every tensor it needs is back: a post-hook would miss it)
    batches = iter([torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(steps)])
    trainer = InnerTrainer(model, cfg.train, lambda: next(batches), 0, torch.device("cpu"))
    losses = [trainer.step(i)[0] for i in range(steps)]
    return losses, copy.deepcopy(model.state_dict())


def test_activation_checkpointing_recomputes_the_same_gradients():
    plain_calls, calls = [], []
    plain, plain_state = _train([], calls=plain_calls)
    checkpointed, state = _train(["train.activation_checkpointing=true"], calls=calls)
    assert len(plain_calls) == 2 and len(calls) == 4  # the backward ran the layer's forward again
    assert checkpointed == plain
    assert state.keys() == plain_state.keys()
    assert all(torch.equal(state[k], plain_state[k]) for k in state)


def test_activation_checkpointing_refuses_a_model_without_it():
    cfg = load_config(None, ["train.activation_checkpointing=true"])
    with pytest.raises(ConfigError, match="does not support it"):
        prepare_model(torch.nn.Linear(2, 2), cfg.train)


def test_compile_keeps_the_module_and_its_names_and_trains_alike():
    plain, plain_state = _train([], steps=1)
    compiled, state = _train(["train.compile=true"], steps=1)
    assert state.keys() == plain_state.keys()  # checkpoints and theta see the same names
    assert compiled == pytest.approx(plain, rel=1e-4)
