"""Optional metric sinks behind the :class:`~p2p_diloco.metrics.Metrics` interface (``--metrics``).

``jsonl`` (``events.jsonl``, always available) is :class:`~p2p_diloco.metrics.EventLog`; ``tensorboard`` and
``wandb`` are optional extras (``pip install 'p2p-diloco[tensorboard]'`` / ``'[wandb]'``), imported only when
asked for. Each sink turns every numeric field of an event into one scalar named ``<event>/<field>``.
W&B runs offline unless ``WANDB_MODE`` says otherwise: a peer never needs a W&B account or the network to train
(``wandb sync <dir>`` uploads an offline run later).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Sequence

from ..errors import UsageError
from . import Metrics, short_id

SINKS = ("jsonl", "tensorboard", "wandb")


def _scalars(name: str, fields: dict[str, Any]) -> dict[str, float]:
    return {f"{name}/{k}": float(v) for k, v in fields.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "global_step"}


class TensorBoardSink(Metrics):
    """Scalars into a TensorBoard event file under ``log_dir`` (step: ``global_step`` if given, else the round; both
    go on where they were after a ``--resume``, so the curves of a resumed peer continue)."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("--metrics tensorboard needs the tensorboard package: "
                             "pip install 'p2p-diloco[tensorboard]'") from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def event(self, name: str, round: int, **fields: Any) -> None:
        step = int(fields.get("global_step", round))
        for tag, value in _scalars(name, fields).items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink(Metrics):
    """One W&B run per peer (``group`` = run id, ``name`` = run id and peer id), offline by default."""

    def __init__(self, log_dir: str | Path, run_id: str, peer_id: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UsageError("--metrics wandb needs the wandb package: pip install 'p2p-diloco[wandb]'") from None
        self._wandb = wandb
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "p2p-diloco"), group=run_id,
                               name=f"{run_id}-{short_id(peer_id)}", dir=str(log_dir), config=config,
                               mode=os.environ.get("WANDB_MODE", "offline"), reinit="finish_previous")
        # x axes that go on where they were after a --resume (a resumed peer is a new W&B run; its own _step
        # restarts at 0): the inner steps' metrics against global_step, the others against the round
        self._run.define_metric("global_step")
        self._run.define_metric("round")
        self._run.define_metric("inner_progress/*", step_metric="global_step")
        self._run.define_metric("*", step_metric="round")

    def event(self, name: str, round: int, **fields: Any) -> None:
        scalars = _scalars(name, fields)
        if scalars:
            step = {"global_step": int(fields["global_step"])} if "global_step" in fields else {}
            self._run.log({**scalars, "round": round, **step})

    def close(self) -> None:
        self._run.finish()


class FanOut(Metrics):
    """Sends every event to each sink; status lines go to the first (the terminal's)."""

    def __init__(self, sinks: Sequence[Metrics]):
        self.sinks = list(sinks)

    def add(self, sink: Metrics) -> None:
        self.sinks.append(sink)

    def event(self, name: str, round: int, **fields: Any) -> None:
        for sink in self.sinks:
            sink.event(name, round, **fields)

    def status(self, text: str) -> None:
        if self.sinks:
            self.sinks[0].status(text)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def check_sinks(names: Sequence[str], log_dir: str | None) -> None:
    """A clear error before anything starts: unknown sinks, file sinks without ``--log-dir``, or an optional
    package that is not installed."""
    for name in names:
        if name not in SINKS:
            raise UsageError(f"--metrics takes {', '.join(SINKS)}, got {name!r}")
        if name != "jsonl" and not log_dir:
            raise UsageError(f"--metrics {name} writes under --log-dir: give one")
        if name != "jsonl" and importlib.util.find_spec(name) is None:
            raise UsageError(f"--metrics {name} needs the {name} package: pip install 'p2p-diloco[{name}]'")
