"""Throughput you can see (training/throughput.py): FLOPs per token, the device's peak, MFU, and where they show
(``inner_done``, ``inner_progress``, the status line)."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.config import Config, load_config
from p2p_diloco.errors import ConfigError
from p2p_diloco.metrics.events import Event
from p2p_diloco.peer.context import PeerContext, PeerStats
from p2p_diloco.peer.inner_loop import InnerLoop
from p2p_diloco.testing.recorder import EventRecorder
from p2p_diloco.training.inner import InnerTrainer
from p2p_diloco.training.model import build_model
from p2p_diloco.training.throughput import flops_per_token, mfu, peak_flops
from tests.unit.test_global_step import Clock

pytestmark = pytest.mark.unit


def test_flops_per_token_is_6n_without_the_embedding_plus_attention():
    cfg = load_config(None, [])
    model = build_model(cfg.model, 257, 0)
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    layers, width = cfg.model.num_layers, cfg.model.hidden_size
    assert flops_per_token(model, 128) == 6 * n + 12 * layers * width * 128
    assert flops_per_token(model, 256) - flops_per_token(model, 128) == 12 * layers * width * 128


def test_a_tied_output_head_is_counted_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.mid = torch.nn.Linear(4, 4, bias=False)

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    assert flops_per_token(Tied(), 8) == 6 * (40 + 16)  # head 40 + mid 16; no config: no attention term


def test_the_peak_is_the_setting_or_a_known_gpu_or_nothing():
    assert peak_flops(torch.device("cpu"), 2.5) == 2.5e12
    assert peak_flops(torch.device("cpu")) is None  # a CPU's peak is not guessed
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert mfu(1000.0, 1e9, None) is None and mfu(0.0, 1e9, 1e13) is None
    with pytest.raises(ConfigError, match="train.peak_tflops must be >= 0"):
        load_config(None, ["train.peak_tflops=-1"])


class Training:
    tokens_per_step = 1000

    def step(self, schedule_step: int) -> tuple[float, int]:
        return 3.0, self.tokens_per_step

    def mfu(self, tokens_per_s: float) -> float | None:
        return tokens_per_s / 1e5  # a peak of 1e5 tokens/s


def test_inner_done_and_progress_carry_tokens_per_s_and_mfu():
    cfg = Config()
    cfg.train.inner_steps = 10
    clock, shown = Clock(), []
    events = EventRecorder("p", clock, [])  # checks every event against the catalogue
    ctx = PeerContext(cfg=cfg, clock=clock, stop=threading.Event(), metrics=events,
                      swarm=SimpleNamespace(update=lambda **fields: None), state=None, rng=random.Random(0))
    ctx.status = shown.append
    InnerLoop(ctx, Training(), PeerStats()).train(0)
    done = [e for e in events.events if e["event"] == Event.INNER_DONE][0]
    assert done["tokens_per_s"] == pytest.approx(10 * 1000 / done["seconds"], rel=1e-3)
    assert done["mfu"] == pytest.approx(done["tokens_per_s"] / 1e5, abs=1e-4)
    progress = [e for e in events.events if e["event"] == Event.INNER_PROGRESS]
    assert progress and all("mfu" in e for e in progress)
    assert "MFU" in shown[-1] and "tok/s" in shown[-1]


def test_the_reported_loss_is_the_mean_of_the_micro_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, input_ids, labels):
            logits = self.net(input_ids)
            return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.view(-1, 16), labels.view(-1)))

    batches = [torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    lm = LM()
    with torch.no_grad():
        expected = sum(float(lm(b, b).loss) for b in batches) / 2
    cfg = Config().train
    cfg.grad_accum, cfg.autocast = 2, "off"
    it = iter(batches)
    loss, tokens = InnerTrainer(lm, cfg, lambda: next(it), 0, torch.device("cpu")).step(0)
    assert loss == pytest.approx(expected, rel=1e-6) and tokens == 20
