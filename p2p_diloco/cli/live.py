"""What a person watches: ``join``'s status line and ``swarm``'s row per peer, kept in place on a terminal (``rich``'s
Live display, with log lines printed above it) and written as plain, throttled lines when the output is a pipe or a
file (no escape codes, no carriage returns).

``swarm``'s rows come from the peers' ``events.jsonl`` files (:mod:`p2p_diloco.metrics.events`), read as they grow.
Round numbers mean what they mean everywhere a user reads them: "round k" is the k-th round, the one that produces
θ(k) (the ``round`` of ``events.jsonl``).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from rich.console import Console
from rich.file_proxy import FileProxy
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..metrics import Metrics, short_id
from ..metrics.events import Event

PLAIN_EVERY = 5.0  # seconds between two plain lines of one status (a pipe or a file: readable, not a flood)
SWARM_REFRESH = 1.0  # seconds between two looks at the peers' events.jsonl

# The phase a peer's last event says it is in.
PHASES = {
    Event.ROUND_START: "train", Event.INNER_PROGRESS: "train", Event.INNER_DONE: "sync",
    Event.ALLREDUCE_START: "sync", Event.ALLREDUCE_RUNNING: "sync", Event.ALLREDUCE_FAILED: "sync",
    Event.STRAGGLERS_DROPPED: "sync", Event.CONTRIBUTION_EXCLUDED: "sync", Event.DIGEST_MISMATCH: "sync",
    Event.COMMIT_FAILED: "sync", Event.ALLREDUCE_DONE: "commit", Event.OUTER_STEP: "outer step", Event.EVAL: "eval",
    Event.STATE_DOWNLOAD_START: "download", Event.STATE_DOWNLOAD_FAILED: "download", Event.STATE_LOADED: "join",
    Event.DESYNC_DETECTED: "repair", Event.CHECKPOINT_SAVED: "checkpoint", Event.RESUMED: "resume",
}


def _swap_log_streams(old: TextIO, new: TextIO) -> list[logging.StreamHandler]:
    """Point every logging handler that writes to ``old`` at ``new`` (ours and hivemind's: the log lines must go
    through the live display, or they would be glued onto its line); the handlers changed."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    swapped = []
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and handler.stream is old:
                handler.setStream(new)
                swapped.append(handler)
    return swapped


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class StatusLine(Metrics):
    """``join``'s status line (the peer's :meth:`Metrics.status` texts).

    On a terminal: one line at the bottom, updated in place; log lines (and anything printed) appear above it, and
    the line goes once the peer stops. Otherwise: the text as a plain line, at most every ``plain_every`` seconds.

    Args:
        stream: where the line goes (default: stderr, where the log lines go too).
        plain_every: seconds between two plain lines.
        clock: ``time.monotonic`` (tests pass their own).
    """

    def __init__(self, stream: TextIO | None = None, plain_every: float = PLAIN_EVERY,
                 clock: Callable[[], float] = time.monotonic):
        self._stream = stream if stream is not None else sys.stderr
        self._console = Console(file=self._stream, soft_wrap=True)
        self._tty = self._console.is_terminal
        self._plain_every, self._clock, self._last = plain_every, clock, None
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._swapped: list[logging.StreamHandler] = []

    def status(self, text: str) -> None:
        with self._lock:
            if not self._tty:
                now = self._clock()
                if self._last is None or now - self._last >= self._plain_every:
                    self._last = now
                    self._stream.write(text + "\n")
                    self._stream.flush()
                return
            line = Text(text, no_wrap=True, overflow="ellipsis")
            if self._live is None:  # started at the first status: the join line is printed by then
                # stray writes to stdout and stderr print above the line too, unless they go elsewhere (a file)
                self._swapped = _swap_log_streams(self._stream, FileProxy(self._console, self._stream))
                self._live = Live(line, console=self._console, auto_refresh=True, refresh_per_second=4,
                                  transient=True,  # a progress line: at the end the log says what happened
                                  redirect_stdout=_is_tty(sys.stdout), redirect_stderr=self._stream is sys.stderr)
                self._live.start(refresh=True)
            else:
                self._live.update(line)

    def close(self) -> None:
        """Stop the live display (its line is cleared) and give the log handlers their stream back."""
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None
            for handler in self._swapped:  # (through the proxy until now: no line is printed directly meanwhile)
                handler.setStream(self._stream)
            self._swapped = []


@dataclass
class PeerRow:
    """What ``swarm`` shows of one peer, folded from its events (:meth:`apply`)."""

    round: int | None = None
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    phase: str = "starting"
    bytes_sent: int = 0
    eval_loss: float | None = None

    def apply(self, event: dict[str, Any]) -> None:
        """Take one event of ``events.jsonl`` into account."""
        name, r = event.get("event"), event.get("round")
        if name not in PHASES:
            return
        if isinstance(r, int) and r != self.round:
            self.round, self.step = r, None
        self.phase = PHASES[name]
        if name == Event.ROUND_START:
            self.step = 0
        elif name == Event.INNER_PROGRESS:
            self.step, self.loss = event.get("inner_step"), event.get("loss")
            self.tokens_per_s = event.get("tokens_per_s", self.tokens_per_s)
        elif name == Event.ALLREDUCE_DONE:
            self.bytes_sent += int(event.get("bytes_sent") or 0)
        elif name == Event.EVAL:
            self.eval_loss = event.get("loss")


COLUMNS = ("peer", "round", "step", "loss", "tok/s", "phase", "MB sent", "eval loss")
WIDTHS = (16, 5, 5, 6, 7, 10, 7, 9)  # the live table's narrowest columns: rows keep their place as values change


def row_cells(name: str, peer_id: str | None, row: PeerRow, exit_code: int | None) -> list[str]:
    """The cells of one peer's row, in :data:`COLUMNS` order (``-`` where nothing is known yet)."""
    def f(value, spec):
        return "-" if value is None else format(value, spec)

    phase = row.phase if exit_code is None else ("done" if exit_code == 0 else f"exited {exit_code}")
    return [f"{name} {short_id(peer_id)}", f(row.round, "d"), f(row.step, "d"), f(row.loss, ".3f"),
            f(row.tokens_per_s, ",.0f"), phase, f"{row.bytes_sent / 1e6:.1f}", f(row.eval_loss, ".3f")]


def plain_line(cells: Sequence[str]) -> str:
    """One peer's row as a line of a log: ``peer0 WJnVCVS1iP  round 1  step 10  loss 4.646  1,308 tok/s  train
    0.0 MB sent  eval loss 5.655``."""
    peer, r, step, loss, rate, phase, sent, ev = cells
    return f"{peer}  round {r}  step {step}  loss {loss}  {rate} tok/s  {phase}  {sent} MB sent  eval loss {ev}"


class _Tail:
    """The events of one ``events.jsonl``, read as the file grows (complete lines only)."""

    def __init__(self, path: Path):
        self.path, self._offset, self._partial = path, 0, b""

    def new_events(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:  # not written yet
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


class SwarmView:
    """``swarm``'s progress: a row per peer (round, inner step, loss, tok/s, phase, MB sent, eval loss).

    On a terminal the rows are a table updated in place; otherwise a peer's row is printed as a plain line when it
    changed, at most every ``plain_every`` seconds (and at once when the peer exits). Use as a context manager and
    call :meth:`update` every :data:`SWARM_REFRESH` seconds.

    Args:
        peers: the peer processes (:class:`~p2p_diloco.runtime.peer_process.PeerProcess`), in their order.
        log_dir: the swarm's log dir (each peer writes ``<log_dir>/<peer id>/events.jsonl``).
        stream: where the view goes (default: stdout).
        plain_every: seconds between two plain lines of one peer.
        clock: ``time.monotonic`` (tests pass their own).
    """

    def __init__(self, peers: Sequence, log_dir: Path, stream: TextIO | None = None,
                 plain_every: float = PLAIN_EVERY, clock: Callable[[], float] = time.monotonic):
        self._peers, self._log_dir = peers, Path(log_dir)
        self._stream = stream if stream is not None else sys.stdout
        self._console = Console(file=self._stream, soft_wrap=True)
        self._tty = self._console.is_terminal
        self._plain_every, self._clock = plain_every, clock
        self._rows: list[PeerRow] = []
        self._tails: dict[int, _Tail] = {}
        self._shown: dict[int, tuple[str, float]] = {}  # plain mode: (line, when) last printed per peer
        self._live: Live | None = None

    def __enter__(self) -> SwarmView:
        if self._tty:
            self._live = Live(self._table(), console=self._console, auto_refresh=False,
                              redirect_stdout=self._stream is sys.stdout, redirect_stderr=_is_tty(sys.stderr))
            self._live.start(refresh=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self.update()
            self._live.stop()
            self._live = None

    def cells(self) -> list[list[str]]:
        """Every peer's row, read from the events written since the last call."""
        for index, peer in enumerate(self._peers):
            if index == len(self._rows):
                self._rows.append(PeerRow())
            if index not in self._tails and peer.peer_id:
                self._tails[index] = _Tail(self._log_dir / peer.peer_id / "events.jsonl")
            for event in self._tails[index].new_events() if index in self._tails else []:
                self._rows[index].apply(event)
        return [row_cells(f"peer{i}", p.peer_id, self._rows[i], p.poll()) for i, p in enumerate(self._peers)]

    def update(self) -> None:
        """Read the new events and show what changed."""
        cells = self.cells()
        if self._live is not None:
            self._live.update(self._table(cells), refresh=True)
            return
        now = self._clock()
        for index, row in enumerate(cells):
            line = plain_line(row)
            last = self._shown.get(index)
            exited = self._peers[index].poll() is not None  # its last line: at once
            if last is None or (line != last[0] and (exited or now - last[1] >= self._plain_every)):
                self._shown[index] = (line, now)
                self._stream.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        self._stream.flush()

    def _table(self, cells: list[list[str]] | None = None) -> Table:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for name, width in zip(COLUMNS, WIDTHS):
            table.add_column(name, justify="left" if name in ("peer", "phase") else "right", no_wrap=True,
                             min_width=width)
        for row in cells if cells is not None else []:
            table.add_row(*row)
        return table
