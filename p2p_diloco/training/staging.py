"""The outer state's copies between the host and the device: the pseudo-gradient out, theta in, once per round.

On a CUDA peer the model's weights live on the device and theta, its momentum and the pseudo-gradient on the host
(fp32, :mod:`p2p_diloco.outer.state`). Copied tensor by tensor through pageable memory (``p.to("cpu")``), each
copy goes through the driver's own bounce buffer and the host thread waits for it before it can subtract, and the
next tensor's copy waits for that subtraction: the device and the host take turns. :class:`HostStaging` streams
the weights through two pinned buffers of a bounded size instead: the device copies piece k+1 into one while the
host subtracts piece k out of the other (and the other way round for theta). The buffers are
:data:`CHUNK_BYTES` each, whatever the model's size: a 30B model's fp32 weights are 120 GB, more than a host can
pin.

The values are the plain functions' bits (:func:`p2p_diloco.outer.optimizer.pseudo_gradient`,
:func:`~p2p_diloco.outer.optimizer.load_into`): the copies are exact, and the subtraction and the dtype conversion are
element by element, so doing them piece by piece changes nothing (unit-tested on the CPU with the staged path forced
on; the pinned buffers and CUDA events themselves need a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from ..outer import optimizer as outer

CHUNK_BYTES = 64 * 2**20  # per buffer (two of them, pinned): ~2.5 ms of a PCIe 4 copy, large enough to stream


class _NoEvent:
    """A CUDA event's stand-in on the CPU, where every copy is done when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostStaging:
    """The model's weights out (as a pseudo-gradient) and theta in, through two pinned buffers on a CUDA device.

    Args:
        device: the model's device. Staged only on CUDA (pinned memory needs it; on the CPU the plain functions
            read the weights where they are, with no copy at all).
        chunk_bytes: the size of each of the two buffers.
        staged: force the staged path on (tests, on the CPU: unpinned buffers, synchronous copies) or off.
    """

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES, staged: bool | None = None):
        self.device, self.chunk_bytes = device, chunk_bytes
        self.staged = device.type == "cuda" if staged is None else staged
        self.buffers: list[torch.Tensor] = []  # made at first use, as large as the largest piece needs
        self.events: list = []

    def pseudo_gradient(self, theta: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                        out: Sequence[torch.Tensor]) -> None:
        """``out = theta - params`` (fp32, on the host), as :func:`~p2p_diloco.outer.optimizer.pseudo_gradient`."""
        if len(theta) != len(params) or len(out) != len(params):
            raise ValueError(f"{len(theta)} theta, {len(params)} weights and {len(out)} outputs")
        if not self.staged:
            outer.pseudo_gradient(theta, params, out)
            return
        plain = [i for i in range(len(params)) if not self._streamable(params[i], theta[i], out[i])]
        outer.pseudo_gradient([theta[i] for i in plain], [params[i] for i in plain], [out[i] for i in plain])
        pending = None
        with self._on_device():
            for k, (i, a, b) in enumerate(self._pieces(params, skip=set(plain))):
                slot = k % 2  # its buffer was last read by the subtraction two pieces ago, done before this turn
                source = params[i].detach().view(-1)[a:b]
                self._stage(slot, source).copy_(source, non_blocking=True)
                self.events[slot].record()
                if pending is not None:  # the host subtracts the previous piece while the device copies this one
                    self._subtract(theta, out, *pending)
                pending = (slot, i, a, b, source.dtype)
            if pending is not None:
                self._subtract(theta, out, *pending)

    @torch.no_grad()
    def load(self, params: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> None:
        """Copy theta into the model's weights, as :func:`~p2p_diloco.outer.optimizer.load_into`; returns once every
        copy is done (the buffers are then free, and theta may change)."""
        if len(theta) != len(params):
            raise ValueError(f"{len(theta)} theta for {len(params)} weights")
        if not self.staged:
            outer.load_into(params, theta)
            return
        plain = [i for i in range(len(params)) if not self._streamable(params[i], theta[i])]
        outer.load_into([params[i] for i in plain], [theta[i] for i in plain])
        with self._on_device():
            for k, (i, a, b) in enumerate(self._pieces(params, skip=set(plain))):
                slot = k % 2
                self.events[slot].synchronize()  # the device has read what this buffer held two pieces ago
                target = params[i].detach().view(-1)[a:b]
                stage = self._stage(slot, target)
                stage.copy_(theta[i].view(-1)[a:b])  # the dtype conversion on the host, as load_into's .to(dtype)
                target.copy_(stage, non_blocking=True)
                self.events[slot].record()
            for event in self.events:
                event.synchronize()

    @staticmethod
    def _streamable(*tensors: torch.Tensor) -> bool:
        """Pieces of flat views need contiguous tensors, and only host tensors need the host's buffers (theta kept
        on the device, as ``FragmentState.theta_in_model``'s copy of the local weights, is copied directly)."""
        return all(t.is_contiguous() for t in tensors) and all(t.device.type == "cpu" for t in tensors[1:])

    def _on_device(self) -> contextlib.AbstractContextManager:
        """The model's device as the current one: the events must be recorded on the stream of the device the
        copies run on (``train.device = cuda:1`` with device 0 current would time the wrong stream)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _subtract(self, theta, out, slot: int, i: int, a: int, b: int, dtype: torch.dtype) -> None:
        self.events[slot].synchronize()
        staged = self.buffers[slot][:(b - a) * dtype.itemsize].view(dtype)
        torch.sub(theta[i].view(-1)[a:b], staged.to(torch.float32), out=out[i].view(-1)[a:b])

    def _pieces(self, params: Sequence[torch.Tensor], skip: set[int]) -> Iterator[tuple[int, int, int]]:
        """(tensor index, first element, end element) of pieces of at most ``chunk_bytes`` (one element at least),
        tensor by tensor, leaving out the tensors of ``skip``; makes the buffers at first use."""
        if not self.buffers:
            largest = max((p.numel() * p.element_size() for p in params), default=0)
            widest = max((p.element_size() for p in params), default=1)
            size = max(min(self.chunk_bytes, largest), widest)
            pin = self.device.type == "cuda"
            self.buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
            self.events = [torch.cuda.Event() if pin else _NoEvent() for _ in range(2)]
        for i, p in enumerate(params):
            if i in skip:
                continue
            step = len(self.buffers[0]) // p.element_size()
            for a in range(0, p.numel(), step):
                yield i, a, min(a + step, p.numel())

    def _stage(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        return self.buffers[slot][:like.numel() * like.element_size()].view(like.dtype)
