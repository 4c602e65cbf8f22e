"""The big buffers of the direct-TCP data plane (fastpath.py), kept by one averager from one all-reduce to the next.

Why: a buffer allocated for one all-reduce and freed after it is fresh memory again at the next one. Every page of it
then costs a page fault and a zeroing before the first byte lands (the kernel's ``clear_page``): in a peer at N = 4
with 40 MB of fp32, that was a third of the averager's CPU time on the data path, and the main part of the sync's
1.5x slowdown after contribution validation (issue 18, point 6: the validated reduction keeps every member's part
until all are in, where the earlier one summed each part into one buffer as it came). Reused buffers are faulted in
once, at the first all-reduce.

Memory: the workspace holds what one all-reduce needs at its peak besides the vector itself: one part per other
member of our slice ((N - 1)/N of the vector's encoded size), and with a lossy codec the encoded answers. The vector
is the averager's shared buffer (source_channel.py; a copy here only for an averager without a host to re-read its
input from), and our own slice is reduced in it, in place (issue 22: the averager held 13 bytes per parameter of
a 12.9M-parameter model before, 4.6 after; docs/scale.md).

Commit contract: a workspace serves one all-reduce at a time. An all-reduce that ends while work on the workspace may
still be running in a thread (its reduction, on an abort) gives it up: the averager takes a new one
(:meth:`~p2p_diloco.swarm.fastpath.FastAllReduce.settled`), so that late work can never write into the next
all-reduce's buffers.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named byte buffers that grow to the largest size asked for and are handed out as typed views."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A view of ``numel`` values of ``dtype`` on buffer ``name`` (its contents are whatever was left there).

        Two names never share memory; the same name gives the same memory each time it fits."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:
            self._buffers.pop(name, None)  # (freed before the larger one is made: the peak holds one of them)
            buffer = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() for b in self._buffers.values())
