"""Metrics behind a small interface: machine-readable events, a human log, and a terminal status line.

Event names and fields are an interface other tools rely on (``p2p-diloco swarm``, tests, benchmarks):
``round_start``, ``allreduce_start``, ``allreduce_done`` (group_size, bytes_sent, bytes_received, seconds),
``allreduce_failed`` (reason), ``outer_step`` (digest), ``eval`` (loss), ``state_loaded`` (from_peer, round).
Every line of ``events.jsonl`` has at least ``t`` (unix time), ``event`` and ``round``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("p2p_diloco")


class Metrics:
    """Null sink: accepts every event and writes nothing. Subclasses write somewhere."""

    def event(self, name: str, round: int, **fields: Any) -> None:
        """Record one event of round ``round``."""

    def status(self, text: str) -> None:
        """Show a transient progress line (inner steps, sync phase)."""

    def close(self) -> None:
        """Flush and release files."""


class EventLog(Metrics):
    """Writes ``events.jsonl`` (one JSON object per line) and ``peer.log`` into ``log_dir``.

    Args:
        log_dir: the peer's own folder, or None for no files.
        stream: where status lines go (stderr by default); a TTY gets an in-place line, anything else gets
            throttled plain lines so that logs stay readable.
    """

    def __init__(self, log_dir: str | Path | None, stream: TextIO | None = None, status_every: float = 5.0):
        self._lock = threading.Lock()
        self._events: TextIO | None = None
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._status_every, self._last_status = status_every, 0.0
        if log_dir is not None:
            self.set_dir(log_dir)

    def set_dir(self, log_dir: str | Path, events: bool = True) -> None:
        """Start writing ``events.jsonl`` (unless ``events`` is False) and ``peer.log`` into ``log_dir``."""
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        if events:
            with self._lock:
                self._events = open(path / "events.jsonl", "a", buffering=1)
        handler = logging.FileHandler(path / "peer.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)

    def event(self, name: str, round: int, **fields: Any) -> None:
        record = {"t": time.time(), "event": name, "round": round, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            if self._events is not None:
                self._events.write(line + "\n")
        log.info("%s round=%d %s", name, round, " ".join(f"{k}={v}" for k, v in fields.items()))

    def status(self, text: str) -> None:
        now = time.monotonic()
        with self._lock:
            if self._tty:
                self._stream.write("\r\033[K" + text)
                self._stream.flush()
            elif now - self._last_status >= self._status_every:
                self._last_status = now
                self._stream.write(text + "\n")
                self._stream.flush()

    def close(self) -> None:
        with self._lock:
            if self._tty:
                self._stream.write("\n")
            if self._events is not None:
                self._events.close()
                self._events = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Parse an ``events.jsonl`` file, skipping a torn last line (the writer may still be running)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out
