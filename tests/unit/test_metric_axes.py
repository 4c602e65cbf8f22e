"""The x axes of the metric sinks (p2p_diloco/metrics/sinks.py) go on where they were after a ``--resume``: TensorBoard
plots the inner steps against ``global_step`` and the rest against the round; a W&B run (a new one per process)
declares the same axes instead of its own ``_step``, which restarts at 0."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from p2p_diloco.metrics.sinks import TensorBoardSink, WandbSink

pytestmark = pytest.mark.unit


def test_tensorboard_curves_of_a_resumed_peer_continue(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    before = TensorBoardSink(tmp_path)  # rounds 1-2, then the process stops
    before.event("inner_progress", 2, inner_step=20, loss=4.0, global_step=40, tokens_per_s=1.0)
    before.event("eval", 2, loss=3.5)
    before.close()
    after = TensorBoardSink(tmp_path)  # --resume: round 3 (its own counters start at 0; global_step does not)
    after.event("inner_progress", 3, inner_step=20, loss=3.0, global_step=60, tokens_per_s=1.0)
    after.event("eval", 3, loss=3.1)
    after.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [s.step for s in acc.Scalars("inner_progress/loss")] == [40, 60]
    assert [s.step for s in acc.Scalars("eval/loss")] == [2, 3]


def test_wandb_plots_against_global_step_and_round(tmp_path, monkeypatch):
    class Run:
        def __init__(self):
            self.defined, self.logged = {}, []

        def define_metric(self, name, step_metric=None):
            self.defined[name] = step_metric

        def log(self, data):
            self.logged.append(data)

    run = Run()
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: run))
    sink = WandbSink(tmp_path, "r", "QmPeerIdPeerId", {})
    sink.event("inner_progress", 3, inner_step=10, loss=3.0, global_step=50, tokens_per_s=2.0)
    sink.event("eval", 3, loss=3.1)
    assert run.defined == {"global_step": None, "round": None, "inner_progress/*": "global_step", "*": "round"}
    assert run.logged == [
        {"inner_progress/inner_step": 10.0, "inner_progress/loss": 3.0, "inner_progress/tokens_per_s": 2.0,
         "round": 3, "global_step": 50},
        {"eval/loss": 3.1, "round": 3}]
