"""Metric sinks (p2p_diloco/metrics/sinks.py): TensorBoard and W&B offline write what the peer logs; no network."""

import builtins

import pytest

from p2p_diloco.errors import UsageError
from p2p_diloco.metrics.sinks import FanOut, TensorBoardSink, WandbSink, check_sinks
from p2p_diloco.metrics import EventLog

pytestmark = pytest.mark.unit


def test_tensorboard_sink_writes_scalars_readable_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.event("eval", 3, loss=2.5, perplexity=12.2, tag="not a number")
    sink.event("inner_progress", 1, inner_step=10, loss=4.0, global_step=10)
    sink.event("allreduce_done", 1, group_size=3, lone=True)  # a bool is not a scalar
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/loss", "eval/perplexity", "inner_progress/loss", "inner_progress/inner_step",
            "allreduce_done/group_size"} == tags
    (loss,) = acc.Scalars("eval/loss")
    assert loss.step == 3 and loss.value == pytest.approx(2.5)
    assert acc.Scalars("inner_progress/loss")[0].step == 10


def test_wandb_sink_runs_offline_without_an_account(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(tmp_path, "run-x", "QmPeerIdPeerId", {"train": {"lr": 0.001}})
    sink.event("eval", 1, loss=3.0)
    sink.event("eval", 2, loss=2.0)
    sink.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())  # the run's records, for `wandb sync`


def test_missing_optional_package_is_one_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(UsageError, match=r"pip install 'p2p-diloco\[wandb\]'"):
        WandbSink("/tmp", "r", "p", {})


def test_sink_names_and_log_dir_are_checked_up_front():
    check_sinks(["jsonl"], None)
    check_sinks(["jsonl", "tensorboard", "wandb"], "/tmp/logs")
    with pytest.raises(UsageError, match="--metrics takes jsonl, tensorboard, wandb"):
        check_sinks(["prometheus"], "/tmp/logs")
    with pytest.raises(UsageError, match="--metrics tensorboard writes under --log-dir"):
        check_sinks(["tensorboard"], None)


def test_a_sink_whose_package_is_missing_is_refused_up_front(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UsageError, match=r"--metrics wandb needs the wandb package: pip install 'p2p-diloco\[wandb\]'"):
        check_sinks(["jsonl", "wandb"], "/tmp/logs")


def test_fan_out_sends_events_everywhere_and_status_to_the_terminal_sink():
    class Recorder(EventLog):
        def __init__(self):
            super().__init__(None)
            self.seen, self.statuses, self.closed = [], [], False

        def event(self, name, round, **fields):
            self.seen.append((name, round, fields))

        def status(self, text):
            self.statuses.append(text)

        def close(self):
            self.closed = True

    a, b = Recorder(), Recorder()
    fan = FanOut([a])
    fan.add(b)
    fan.event("eval", 2, loss=1.0)
    fan.status("round 2")
    fan.close()
    assert a.seen == b.seen == [("eval", 2, {"loss": 1.0})]
    assert a.statuses == ["round 2"] and b.statuses == []
    assert a.closed and b.closed
