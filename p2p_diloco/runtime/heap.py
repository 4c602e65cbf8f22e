"""Giving the allocator's free memory back to the system where nothing will reuse it soon.

Why: on the CPU, torch's tensors come from glibc's ``malloc``, which keeps freed memory in its heaps for reuse.
Two places keep it for nothing (issue 22, docs/scale.md): the peer's heap just before it forks hivemind's
processes (the children would inherit the dirty free pages, and copy each one the peer reuses later), and an
averager's heap after an all-reduce (its transient buffers, until the next round). The peer's own heap is *not*
trimmed between its phases: the next inner step would fault its gradients and activations in again, measured
+3 % of the inner time at H = 5.
"""

from __future__ import annotations

import ctypes
import threading

_malloc_trim = None
try:  # (the process's own symbols: libc is loaded; find_library would run ldconfig at every import)
    _malloc_trim = ctypes.CDLL(None).malloc_trim
    _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):  # not glibc: nothing to give back this way
    pass


def trim() -> None:
    """Return every whole free page of the allocator's heaps to the system (glibc ``malloc_trim(0)``)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def trim_in_background() -> None:
    """:func:`trim` in a thread of its own (it takes milliseconds per hundred MB; glibc locks each heap as it
    goes), so that a caller about to wait on the network does not wait for it first."""
    if _malloc_trim is not None:
        threading.Thread(target=trim, name="heap-trim", daemon=True).start()
