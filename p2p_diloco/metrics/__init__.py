"""Metrics behind a small interface: machine-readable events, a human log, and a status line (shown by the CLI's
live view, :mod:`p2p_diloco.cli.live`).

Event names and fields are an interface other tools rely on (``p2p-diloco swarm``, tests, benchmarks):
``round_start``, ``allreduce_start``, ``allreduce_done`` (group_size, bytes_sent, bytes_received, seconds),
``allreduce_failed`` (reason), ``outer_step`` (digest), ``eval`` (loss), ``state_loaded`` (from_peer, round).
Every line of ``events.jsonl`` has at least ``t`` (unix time), ``event`` and ``round``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("p2p_diloco")

SHORT_ID = 10  # characters of a peer id that people read (the ids differ in their last characters: 'Qm...' is common)
PEER_FIELDS = ("peer", "from_peer", "peers", "members")  # event fields that name peers: shortened in the human log
# Fields that hold a SHA-256 digest or a certificate id: their first 12 hex characters in the human log (as in the
# swarm's table); 64 characters made every round's lines wrap on a terminal.
DIGEST_FIELDS = ("digest", "ours", "theirs", "majority", "certificate")
SHORT_DIGEST = 12


def short_id(peer_id: str | None) -> str:
    """The abbreviation of a peer id that every human-readable output uses (``join``'s log, ``swarm``'s rows and
    table, ``status``): its last :data:`SHORT_ID` characters. Files and JSON keep whole ids.

    Args:
        peer_id: a libp2p peer id (base58), or None when it is not known yet.

    Returns:
        The abbreviation, or ``"?"`` for None.
    """
    return peer_id[-SHORT_ID:] if peer_id else "?"


def _human(key: str, value: Any) -> Any:
    if key in DIGEST_FIELDS and isinstance(value, str):
        return value[:SHORT_DIGEST]
    if key not in PEER_FIELDS:
        return value
    if isinstance(value, str):
        return short_id(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(short_id(v) if isinstance(v, str) else str(v) for v in value) + "]"
    return value


class Metrics:
    """Null sink: accepts every event and writes nothing. Subclasses write somewhere."""

    def event(self, name: str, round: int, **fields: Any) -> None:
        """Record one event of round ``round``."""

    def status(self, text: str) -> None:
        """Show a transient progress line (inner steps, sync phase)."""

    def close(self) -> None:
        """Flush and release files."""


class EventLog(Metrics):
    """Writes ``events.jsonl`` (one JSON object per line) and ``peer.log`` into ``log_dir``, and logs every event as
    one INFO line (peer ids shortened by :func:`short_id`, digests to 12 characters; ``events.jsonl`` keeps
    them whole).

    Args:
        log_dir: the peer's own folder, or None for no files (yet: see :meth:`set_dir`).
    """

    def __init__(self, log_dir: str | Path | None = None):
        self._lock = threading.Lock()
        self._events: TextIO | None = None
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
        log.info("%s round=%d %s", name, round, " ".join(f"{k}={_human(k, v)}" for k, v in fields.items()))

    def close(self) -> None:
        with self._lock:
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
