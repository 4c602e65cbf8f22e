"""The next batches of a peer's data stream, made in a background thread while the current step runs.

Why: :class:`~p2p_diloco.training.data.PackedStream` tokenizes and packs in the thread that calls it; in the
training thread that work sits between two steps, and on a GPU the device idles meanwhile. Here a worker thread
keeps ``depth`` batches ready (pinned, so that the trainer's ``non_blocking`` copy really overlaps), and the
training thread only takes them. A CUDA peer uses it (training/part.py); a CPU peer does not: there a batch of
8 x 128 takes ~150 us (0.65 % of the tiny model's step, measured 2026-12-06) and the step's own threads already
use every core.

Nothing about the data changes: one producer makes the stream's batches in the stream's order, and the cursor a
checkpoint saves (:meth:`Prefetcher.state_dict`) is the one after the last batch *taken*, not the last made, so a
resumed peer continues exactly where training was (the batches made ahead are made again).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch

log = logging.getLogger("p2p_diloco.training")

PUT_POLL = 0.1  # seconds between the worker's checks of a stop request while the queue is full
HALT_TIMEOUT = 60.0  # seconds a stop request waits for the worker to finish the batch it is making


class Prefetcher:
    """``stream``'s batches, ``depth`` ahead (the stream's interface: ``next_batch``, ``state_dict``,
    ``load_state_dict``, ``tokens_per_batch``, ``close``). Only the worker touches the stream while it runs.

    Args:
        stream: a :class:`~p2p_diloco.training.data.PackedStream` (or anything with its interface).
        depth: batches made ahead (at least 1).
        pin: pin each batch's memory (a CUDA peer: the copy to the device can then be asynchronous).
    """

    def __init__(self, stream: Any, depth: int = 2, pin: bool = False):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.stream, self.depth, self.pin = stream, depth, pin
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = stream.state_dict()  # the cursor after the last batch taken
        self._start()

    @property
    def tokens_per_batch(self) -> int:
        return self.stream.tokens_per_batch

    def next_batch(self) -> torch.Tensor:
        """The next batch; the stream's error (no documents, an unreadable dataset) is raised here, in order."""
        batch, state, error = self._queue.get()
        if error is not None:
            self._halt()  # (the worker has stopped: the next call raises again rather than wait forever)
            self._queue.put((None, None, error))
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict:
        """The stream's cursor after the last batch taken (what a checkpoint saves)."""
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the batches made ahead are dropped and made again from there."""
        self._halt()
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()
        self._start()

    def close(self) -> None:
        try:
            self._halt()
        except RuntimeError as e:  # (at shutdown: say so and go on; the daemon thread ends with the process)
            log.warning("%s", e)
            return
        self.stream.close()

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._work, args=(self._queue,), name="prefetch", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        """Stop the worker and wait for it (it finishes the batch it is making, then sees the request), at most
        ``HALT_TIMEOUT`` s: a worker stuck in the stream (a streaming dataset's read that hangs) is an error, not a
        wait without end; the stream is then left to it."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(HALT_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError(f"the data prefetch thread did not stop within {HALT_TIMEOUT:.0f} s (stuck reading "
                               "the dataset)")
        self._thread = None

    def _work(self, out: queue.Queue) -> None:
        while not self._stop.is_set():
            try:
                batch = self.stream.next_batch()
                if self.pin:
                    batch = batch.pin_memory()
                item = (batch, self.stream.state_dict(), None)
            except Exception as e:  # handed to the training thread, which raises it
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    out.put(item, timeout=PUT_POLL)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
