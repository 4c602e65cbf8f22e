"""Tensors that stay out of the processes this one forks (hivemind's DHT and averager processes).

hivemind starts its DHT and averager as ``multiprocessing`` processes, forked from the peer after the model and
the outer state exist (their shapes size the averager's buffers). A forked child shares the parent's pages
copy-on-write, and each page the parent writes afterwards (every inner step writes the weights, every round
theta and the momentum) is copied for the parent: the child's view becomes a private copy of memory it never
reads. Measured on a 12.9M-parameter 2-peer swarm: 6 bytes per parameter in the DHT process and ~10 in the
averager's, of 64.7 for a whole peer (docs/scale.md).

:func:`keep_out_of_children` names such tensors; right after every ``fork`` the child drops the whole pages of
their storages (``madvise(MADV_DONTNEED)``), before the parent writes any. Dropping is safe whatever the child
does later: a dropped page of private anonymous memory reads as zeros if touched again (no fault), and its
allocator metadata lies outside the whole pages of a live allocation. The children never read these tensors: the
averager's inputs and outputs are its own shared-memory buffers (excluded here), and a donation is read by the
host's thread and sent through a pipe (:meth:`~p2p_diloco.swarm.exact_averager.ExactAverager.get_current_state`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Iterable

import torch

from . import heap

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_lock = threading.Lock()
_kept_out: list[weakref.ref] = []  # tensors; weak: a freed tensor needs no dropping
_installed = False
_dropped_bytes = 0  # in a child: what the last fork dropped (for tests)


def keep_out_of_children(tensors: Iterable[torch.Tensor]) -> None:
    """Drop the pages of ``tensors`` (CPU, not shared memory) in every process forked from now on.

    Only for tensors no child reads: a child that did would read zeros."""
    global _installed
    with _lock:
        _kept_out[:] = [r for r in _kept_out if r() is not None]
        _kept_out.extend(weakref.ref(t) for t in tensors if t.device.type == "cpu" and not t.is_shared())
        if not _installed and hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_trim_heap, after_in_child=_drop_in_child)
            _installed = True


def whole_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """``(start, length)`` of the whole pages inside ``[ptr, ptr + nbytes)`` (length 0 if none)."""
    start = -(-ptr // PAGE) * PAGE
    end = (ptr + nbytes) // PAGE * PAGE
    return start, max(0, end - start)


def _trim_heap() -> None:
    """Before a fork: a child would otherwise inherit the allocator's free pages (dirty, from tensors freed while
    the model was built) and keep a private copy of each one the parent reuses afterwards."""
    heap.trim()


def _drop_in_child() -> None:
    global _dropped_bytes
    _dropped_bytes = 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    seen = set()
    for ref in _kept_out:  # no lock: the child has one thread, and a parent thread holding it is gone
        t = ref()
        if t is None or t.device.type != "cpu":  # (freed, or moved to a device since it was named)
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or not ptr:
            continue
        seen.add(ptr)
        start, length = whole_pages(ptr, storage.nbytes())
        if length and madvise(start, length, MADV_DONTNEED) == 0:
            _dropped_bytes += length


def dropped_bytes() -> int:
    """In a forked child: the bytes its fork dropped."""
    return _dropped_bytes
