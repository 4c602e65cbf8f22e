"""``p2p-diloco plot``: one PNG of a run from its peers' ``events.jsonl`` files: eval loss per round for every peer,
and the round time, the bytes each peer sent and the group size of each round over the run.

matplotlib is optional (``pip install 'p2p-diloco[plot]'``) and imported only here, when a plot is drawn; no
pyplot (its global state and GUI backends): a :class:`matplotlib.figure.Figure` saved with the Agg renderer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from collections import defaultdict
from pathlib import Path

from ..errors import UsageError
from ..metrics import read_events, short_id
from ..metrics.events import Event

log = logging.getLogger("p2p_diloco")

PNG = "plot.png"  # the default file name, in the log dir
MARKERS = "osD^vP*X"


def available() -> bool:
    """Whether matplotlib is installed (``swarm`` draws its plot only then)."""
    return importlib.util.find_spec("matplotlib") is not None


def load_run(log_dir: str | Path) -> dict[str, list[dict]]:
    """``{peer id: its events}`` of every ``events.jsonl`` under ``log_dir`` (a peer's folder is named by its id), in
    ``swarm``'s order of the peers, else in the order of their first events.

    Raises:
        UsageError: ``log_dir`` is not a directory, or holds no ``events.jsonl``.
    """
    root = Path(log_dir)
    if not root.is_dir():
        raise UsageError(f"--log-dir {log_dir}: no such directory")
    runs = {path.parent.name: read_events(path) for path in sorted(root.rglob("events.jsonl"))}
    runs = {peer: events for peer, events in runs.items() if events}
    if not runs:
        raise UsageError(f"no events.jsonl under {log_dir}: give the --log-dir of a join or swarm run")
    index = swarm_indexes(root)
    return dict(sorted(runs.items(), key=lambda kv: (index.get(kv[0], len(index)), kv[1][0].get("t", 0.0))))


def swarm_indexes(log_dir: Path) -> dict[str, int]:
    """``{peer id: i}`` from the ``peer<i>.summary.json`` files ``swarm`` leaves in its log dir (empty for others):
    the plot then names and orders the peers as ``swarm`` did."""
    out = {}
    for path in log_dir.glob("peer*.summary.json"):
        try:
            out[json.loads(path.read_text())["peer_id"]] = int(path.name[4:].split(".")[0])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def series(events: list[dict]) -> dict[str, dict[int, float]]:
    """One peer's plotted series, each ``{round: value}``: ``eval_loss`` (of θ(round)), ``round_s`` (round_start ->
    outer_step), ``mb_sent`` (all-reduce bytes sent in the round, MB) and ``group_size`` (of its all-reduce)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    started: dict[int, float] = {}
    for e in events:
        name, r = e.get("event"), e.get("round")
        if not isinstance(r, int):
            continue
        if name == Event.EVAL:
            out["eval_loss"][r] = e["loss"]
        elif name == Event.ROUND_START:
            started.setdefault(r, e["t"])
        elif name == Event.OUTER_STEP and r in started:
            out["round_s"][r] = e["t"] - started[r]
        elif name == Event.ALLREDUCE_DONE:
            out["mb_sent"][r] = out["mb_sent"].get(r, 0.0) + e.get("bytes_sent", 0) / 1e6
            out["group_size"][r] = e.get("group_size", 0)
    return out


PANELS = (("eval_loss", "eval loss of θ(round)"), ("round_s", "round time (s): round start -> outer step"),
          ("mb_sent", "MB sent in the round's all-reduce"), ("group_size", "all-reduce group size"))


def plot_run(log_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run under ``log_dir`` into a PNG.

    Args:
        log_dir: a ``--log-dir`` of ``join`` or ``swarm`` (``<peer id>/events.jsonl`` below it).
        out: the PNG to write (default ``<log_dir>/plot.png``).

    Returns:
        The PNG's path.

    Raises:
        UsageError: no events under ``log_dir``, or matplotlib is not installed.
    """
    runs = load_run(log_dir)
    numbers = swarm_indexes(Path(log_dir))
    if not available():
        raise UsageError("plot needs matplotlib: pip install 'p2p-diloco[plot]'")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    axes = list(fig.subplots(2, 2, sharex=True).flat)
    fig.suptitle(f"{Path(log_dir).resolve().name}: {len(runs)} peer(s)")
    for index, (peer, events) in enumerate(runs.items()):
        data = series(events)
        # peers holding the same θ have the same eval loss: markers of their own keep every peer's line visible
        style = dict(color=f"C{index % 10}", marker=MARKERS[index % len(MARKERS)], markersize=7 - index % 4,
                     fillstyle="none", linewidth=1.2,
                     label=f"peer{numbers[peer]} {short_id(peer)}" if peer in numbers else short_id(peer))
        for ax, (key, _) in zip(axes, PANELS):
            points = sorted(data.get(key, {}).items())
            if points:
                ax.plot([r for r, _ in points], [v for _, v in points], **style)
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if key != "eval_loss" and ax.has_data():  # from 0, with room above a flat line
            ax.set_ylim(0, max(ax.dataLim.ymax * 1.15, 1e-9))
        if key == "group_size":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[2:]:
        ax.set_xlabel("round")
    axes[0].legend(fontsize=8, ncols=2 if len(runs) > 6 else 1, title="peer")
    path = Path(out) if out is not None else Path(log_dir) / PNG
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def cmd_plot(args: argparse.Namespace) -> int:
    """``p2p-diloco plot``: write the PNG and print its path.

    Args:
        args: The parsed ``plot`` command line (``log_dir``, ``out``).

    Returns:
        The exit code, 0.
    """
    if args.out is not None and not args.out.lower().endswith(".png"):
        raise UsageError(f"--out must name a .png file, got {args.out!r}")
    print(f"wrote {plot_run(args.log_dir, args.out)}", flush=True)
    return 0


def plot_if_available(log_dir: str | Path) -> Path | None:
    """``swarm``'s plot at the end of a run: the PNG's path, or None when matplotlib is not installed or there is
    nothing to draw (a plot must never turn a finished run into a failed one: a problem is one warning line)."""
    if not available():
        return None
    try:
        return plot_run(log_dir)
    except UsageError:  # no events (no peer got as far as writing one)
        return None
    except Exception as e:  # noqa: BLE001 - matplotlib's errors are many; the run's result stands
        log.warning("could not draw the plot of %s: %s", log_dir, e)
        return None
