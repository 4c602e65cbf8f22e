"""The global state of Streaming DiLoCo (``outer.fragments = F > 1``): theta whole in this process, synced one
fragment per round (https://arxiv.org/abs/2501.18512; :mod:`p2p_diloco.outer.fragments`).

What changes against :class:`~p2p_diloco.outer.state.WholeState`, and why:

- A round from theta(r) averages the pseudo-gradient of fragment ``r mod F`` only: ``theta_p(r) - local_p``.
  It travels in one flat buffer as long as the largest fragment (zero padded), so the swarm keeps one averager
  and one data plane, whatever F; the partition is balanced by elements, so the padding is small.
- The outer step moves that fragment of theta and of the momentum; the rest stays. The digest, the certificate
  and a donation still cover the whole state: every rule of the round protocol is unchanged.
- The local weights are not reset to theta at a round boundary: the fragment that was synced is merged into
  them (``alpha * local + (1 - alpha) * theta``), the others keep training. So the local weights are part of
  the state a checkpoint must hold (it does: the model's state dict), and :meth:`FragmentState.load_into` is
  told, by :func:`~p2p_diloco.outer.fragments.landing`, which fragments changed since the local weights were
  last in step with theta.
- Evaluation swaps theta into the model for the duration (:meth:`FragmentState.theta_in_model`): the loss
  reported is theta's, as in every other mode.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from ..protocol.actions import Download
from ..protocol.certificate import Certificate
from ..protocol.records import View
from . import optimizer as opt
from .fragments import fragment_of_round, landing, mix_into, partition
from .state import Tensors, WholeState


class FragmentState(WholeState):
    """theta and the momentum whole, synced one fragment per round (module docstring).

    Args:
        params, lr, momentum, nesterov, fingerprint: as :class:`~p2p_diloco.outer.state.WholeState`.
        fragments: F (``outer.fragments``), at most the number of parameter tensors.
        alpha: the local weights' share in the merge (``outer.fragment_alpha``).
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool,
                 fingerprint: str, fragments: int, alpha: float):
        super().__init__(params, lr, momentum, nesterov, fingerprint)
        self.fragments, self.alpha = fragments, alpha
        self.runs = partition(self.theta, fragments)
        self.size = max(sum(self.theta[i].numel() for i in run) for run in self.runs)
        # the round of theta the local weights are in step with; None: none (a fresh peer's weights are theta(0),
        # but the state it joins at may be any round: merging would leave them half way), so the first boundary
        # loads theta whole
        self.local_round: int | None = None

    def swarm_options(self) -> dict[str, Any]:
        return {"state_like": self.theta}  # what a donation holds is the whole state, not the flat buffer

    def tensors_like(self) -> Tensors:
        return [torch.zeros(self.size)]

    def new_buffer(self) -> Tensors:
        return [torch.zeros(self.size)]

    def fragment(self) -> int:
        """The fragment the round from our theta(round) syncs."""
        return fragment_of_round(self.round, self.fragments)

    def views(self, flat: torch.Tensor, fragment: int) -> Tensors:
        """The tensors of ``fragment`` as views of the start of the flat buffer ``flat``."""
        run = self.runs[fragment]
        sizes = [self.theta[i].numel() for i in run]
        pieces = flat[:sum(sizes)].split(sizes)
        return [piece.view_as(self.theta[i]) for piece, i in zip(pieces, run, strict=True)]

    def pseudo_gradient(self, replica: Any, out: Tensors, start: Tensors | None = None) -> None:
        if start is not None:
            raise ValueError("outer.fragments takes no look-ahead start")  # a bug of the caller
        p = self.fragment()
        run = self.runs[p]
        out[0].zero_()  # the padding after the fragment averages to zero
        opt.pseudo_gradient([self.theta[i] for i in run], [replica.params[i] for i in run], self.views(out[0], p))

    def _stepped(self, average: Tensors) -> list[tuple[int, torch.Tensor]]:
        run = self.runs[self.fragment()]
        return list(zip(run, self.views(average[0], self.fragment()), strict=True))

    def lookahead(self, pseudo_gradient: Tensors, out: Tensors) -> None:
        raise ValueError("outer.fragments merges the synced fragment instead of a look-ahead")  # a caller's bug

    def load_into(self, replica: Any, source: Tensors | None = None) -> None:
        """Bring the local weights in step with theta(round): merge the fragments that changed since they last
        were (:func:`~p2p_diloco.outer.fragments.landing`), or load theta whole."""
        if source is not None:
            raise ValueError("outer.fragments takes no look-ahead start")
        with self.lock:
            changed = landing(self.local_round, self.round, self.fragments)
            if changed is None:
                replica.load(self.theta)
            for p in changed or ():
                run = self.runs[p]
                mix_into([replica.params[i] for i in run], [self.theta[i] for i in run], self.alpha)
            self.local_round = self.round

    @contextlib.contextmanager
    def theta_in_model(self, replica: Any) -> Iterator[None]:
        local = [p.detach().clone() for p in replica.params]
        replica.load(self.theta)
        try:
            yield
        finally:
            replica.load(local)

    def fetch(self, swarm: Any, donor: str, plan: Download, read_view: Callable[[], View], fingerprint: str,
              trust: Callable[[Certificate], str | None]) -> str | None:
        before = self.round
        problem = super().fetch(swarm, donor, plan, read_view, fingerprint, trust)
        if problem is None and self.round <= before:  # a repair: the same round (or an earlier one), other weights
            self.local_round = None
        return problem

    def restore(self, state: Any, directory: str) -> None:
        super().restore(state, directory)
        self.local_round = self.round  # the checkpoint's model is the local weights at that boundary
