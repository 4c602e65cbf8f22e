"""The host's copy of an attempt's input, read by its averager process only to repair a dead member's slice.

Why: the averager's direct-TCP all-reduce (fastpath.py) works in the averager's shared input buffer itself (the
host copies its pseudo-gradient there for every attempt and reads the average back from it), instead of in a
private copy of it: a copy costs 4 bytes per parameter for the averager's whole life (docs/scale.md). Working in
place overwrites the input, and one thing still needs it afterwards: when a member dies mid-all-reduce, each
survivor sends its own *original* part of the dead member's slice to the re-reducer (slice_repair.py). The host
keeps its pseudo-gradient unchanged until the round is over (a retry sends it again), so the averager asks the
host for that part, which is 1/N of the vector, on a pipe of its own; a repair is rare, and nothing else crosses.

Bounded: one request at a time per averager (the repair's), answered from the tensors of the current attempt
only; a request while there is none fails that repair (and so the all-reduce), never reads stale values.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
from typing import Sequence

import torch
from hivemind.utils import MPFuture

log = logging.getLogger("p2p_diloco.swarm")


def cut(tensors: Sequence[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Values ``start:stop`` of the flat fp32 vector that ``tensors`` make end to end (a new tensor)."""
    pieces, offset = [], 0
    for t in tensors:
        lo, hi = max(start, offset), min(stop, offset + t.numel())
        if lo < hi:
            pieces.append(t.detach().reshape(-1)[lo - offset:hi - offset].to(torch.float32))
        offset += t.numel()
    return torch.cat(pieces) if pieces else torch.empty(0)


class SourceChannel:
    """Made by the host before its averager forks; :meth:`serve` in the host, :meth:`read` in the averager."""

    def __init__(self):
        self._host_end, self._averager_end = mp.Pipe(duplex=True)
        self._inputs: Sequence[torch.Tensor] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------ host side
    def serve(self) -> None:
        """Host: answer the averager's requests in a daemon thread (once the averager has forked)."""
        self._thread = threading.Thread(target=self._serve, name="source-channel", daemon=True)
        self._thread.start()

    def set_inputs(self, tensors: Sequence[torch.Tensor] | None) -> None:
        """Host: the input of the attempt that starts now (None: no attempt). The tensors must stay unchanged
        until the next call."""
        with self._lock:
            self._inputs = tensors

    def close(self) -> None:
        """Host: stop serving."""
        try:
            self._averager_end.send(None)  # wakes the host thread's recv with the end marker
        except (OSError, ValueError):
            pass

    def _serve(self) -> None:
        while True:
            try:
                request = self._host_end.recv()
            except (EOFError, OSError):
                return
            if request is None:
                return
            start, stop, future = request
            try:
                with self._lock:
                    inputs = self._inputs
                    if inputs is None:
                        raise RuntimeError("no all-reduce input on the host")
                    total = sum(t.numel() for t in inputs)
                    if not 0 <= start <= stop <= total:
                        raise ValueError(f"values {start}:{stop} of an input of {total}")
                    part = cut(inputs, start, stop)
            except Exception as e:  # the repair fails with the reason; the host thread goes on
                _settle(future, exception=e)
            else:
                _settle(future, result=part)

    # -------------------------------------------------------------------------------------------- averager side
    async def read(self, start: int, stop: int, timeout: float) -> torch.Tensor:
        """Averager: values ``start:stop`` of the host's input of the current attempt."""
        future = MPFuture()
        self._averager_end.send((start, stop, future))
        return await asyncio.wait_for(future, timeout)


def _settle(future: MPFuture, result=None, exception: BaseException | None = None) -> None:
    """Answer a request, unless its reader gave up on it (timed out: the future is cancelled)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except Exception as e:  # (InvalidStateError of a cancelled future, or its process is gone)
        log.debug("a source request was not answered: %r", e)
