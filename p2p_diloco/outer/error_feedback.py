"""Error feedback: what a sparse codec leaves out of this round's pseudo-gradient is sent in later rounds.

Each peer keeps ``error`` (local, in its checkpoints, never synchronised). At a round's end it sends the codec's
decoded encoding of ``pseudo_gradient + error`` and keeps the rest: ``error <- pseudo_gradient + error - sent``
(Karimireddy et al., arXiv 1901.09847; SparseLoCo, arXiv 2508.15706, with top-k and 2-bit values). The sum of what a
peer sent over the rounds then differs from the sum of its pseudo-gradients by only the current ``error``: nothing
is lost, only delayed. With a decay beta < 1 (``outer.topk_error_decay``), ``error <- pseudo_gradient + beta *
error - sent``, SparseLoCo's accumulator: what stays unsent fades, and with ``outer.momentum = 0`` it stands in for
the outer momentum.

The encoding is computed here, over the concatenation of the tensors in the order the data plane concatenates them,
in chunks from its start. The data plane cuts its slices on the same chunk boundaries (``Codec.align``), and the
codec re-encodes its own decoded output to the same bits (``TopKCodec``), so the members receive exactly ``sent``.

Commit contract: :meth:`compensate` computes ``sent`` and the error that would follow, and changes nothing;
:meth:`accept` (the round committed: ``sent`` went into theta(r + 1)) makes that error ours; a round that ends
otherwise (caught up, repaired, stopped) leaves the error as it was, and the next round sends it again.

With ``outer.fragments = F > 1`` (Streaming DiLoCo) a round sends one fragment of the model, so the error is kept per
fragment (:class:`FragmentFeedback`): what fragment p left unsent goes out with fragment p's next round, F rounds
later, and never into another fragment's positions of the shared flat buffer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .codecs import Codec

Tensors = Sequence[torch.Tensor]


class ErrorFeedback:
    """One peer's error-feedback accumulator for ``codec`` (module docstring).

    Args:
        codec: the run's codec (``outer.compression``).
        like: tensors shaped like the pseudo-gradient (the all-reduce's buffers, in their order).
        decay: the error is multiplied by it before the next pseudo-gradient is added (SparseLoCo's beta: the
            accumulator then stands in for outer momentum); 1: nothing is lost, only delayed.
    """

    def __init__(self, codec: Codec, like: Tensors, decay: float = 1.0):
        self.codec, self.decay = codec, decay
        self.shapes = [t.shape for t in like]
        self.error = torch.zeros(sum(t.numel() for t in like), dtype=torch.float32)
        self._next: torch.Tensor | None = None  # the error after the round being synced, until it commits

    def compensate(self, pseudo_gradient: Tensors) -> list[torch.Tensor]:
        """What to send for ``pseudo_gradient`` (left unchanged): the codec's decoded encoding of it plus the
        error, in its shapes. The error is not changed until :meth:`accept`."""
        total = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in pseudo_gradient]).add_(
            self.error, alpha=self.decay)
        sent = self.codec.round_trip(total)
        self._next = total.sub_(sent)
        return [piece.view(shape) for piece, shape in zip(sent.split([s.numel() for s in self.shapes]),
                                                          self.shapes, strict=True)]

    def accept(self) -> None:
        """The round whose ``sent`` the last :meth:`compensate` gave committed: its error becomes ours."""
        if self._next is not None:
            self.error, self._next = self._next, None

    def reject(self) -> None:
        """The round ended without committing what we sent: the error stays as it was."""
        self._next = None

    def state(self) -> torch.Tensor:
        """The accumulator, for a checkpoint (a copy)."""
        return self.error.clone()

    def load(self, error: torch.Tensor | None) -> None:
        """Continue from a checkpoint's accumulator (None: a checkpoint without one starts from zero).

        Raises:
            ValueError: it does not fit this model.
        """
        if error is None:
            self.error.zero_()
            return
        if not isinstance(error, torch.Tensor) or error.shape != self.error.shape or error.dtype != torch.float32:
            got = (f"{tuple(error.shape)} {error.dtype} values" if isinstance(error, torch.Tensor)
                   else type(error).__name__)
            raise ValueError(f"the checkpoint's error feedback is {got}, this model's {tuple(self.error.shape)} "
                             f"float32 values")
        self.error.copy_(error)
        self._next = None


class FragmentFeedback:
    """One :class:`ErrorFeedback` per fragment of ``outer.fragments`` (module docstring), with the same interface.

    Args:
        codec, like, decay: as :class:`ErrorFeedback` (``like``: the one flat buffer every fragment travels in).
        fragments: F.
        fragment: the fragment of the round being synced (the state's
            :meth:`~p2p_diloco.outer.fragment_state.FragmentState.fragment`; its round does not move before the
            round commits or ends).
    """

    def __init__(self, codec: Codec, like: Tensors, decay: float, fragments: int, fragment: Callable[[], int]):
        self.parts = [ErrorFeedback(codec, like, decay) for _ in range(fragments)]
        self.fragment = fragment
        self._pending: ErrorFeedback | None = None

    def compensate(self, pseudo_gradient: Tensors) -> list[torch.Tensor]:
        """:meth:`ErrorFeedback.compensate` with the error of the fragment being synced."""
        self._pending = self.parts[self.fragment()]
        return self._pending.compensate(pseudo_gradient)

    def accept(self) -> None:
        if self._pending is not None:
            self._pending.accept()
            self._pending = None

    def reject(self) -> None:
        if self._pending is not None:
            self._pending.reject()
            self._pending = None

    def state(self) -> torch.Tensor:
        """Every fragment's accumulator, one row each (a copy)."""
        return torch.stack([part.error for part in self.parts])

    def load(self, error: torch.Tensor | None) -> None:
        """Continue from a checkpoint's accumulators (None: from zero).

        Raises:
            ValueError: they do not fit this model and F.
        """
        self._pending = None
        if error is None:
            for part in self.parts:
                part.load(None)
            return
        rows, size = len(self.parts), self.parts[0].error.numel()
        if not isinstance(error, torch.Tensor) or error.shape != (rows, size) or error.dtype != torch.float32:
            got = (f"{tuple(error.shape)} {error.dtype} values" if isinstance(error, torch.Tensor)
                   else type(error).__name__)
            raise ValueError(f"the checkpoint's error feedback is {got}, this model's with outer.fragments = {rows} "
                             f"{(rows, size)} float32 values")
        for part, row in zip(self.parts, error, strict=True):
            part.load(row.clone())
