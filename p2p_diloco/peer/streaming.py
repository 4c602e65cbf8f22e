"""Overlapped rounds of Streaming DiLoCo (``outer.overlap`` with ``outer.fragments = F > 1``): the sync of one
fragment runs in the background behind the next round's inner steps, and lands merged into the local weights.

Douillard et al. 2025, https://arxiv.org/abs/2501.18512: with the model cut into F fragments
(:mod:`p2p_diloco.outer.fragments`), the round from theta(r) syncs fragment ``r mod F`` only. While that sync runs,
the peer trains round r+1 from its local weights as they are (no look-ahead: nothing is reset), and round r+1's
pseudo-gradient is of fragment ``(r+1) mod F``, a part of theta that the sync in flight does not touch, so it is
exactly theta(r+1)'s pseudo-gradient, whenever theta(r+1) lands. When it lands, the fragment it moved is merged
into the local weights, ``alpha * local + (1 - alpha) * theta`` (:meth:`FragmentState.load_into
<p2p_diloco.outer.fragment_state.FragmentState.load_into>`). The sync is hidden behind one round (H / F inner
steps when each fragment is synced every H steps); in the simulator (``benchmarks/outer_sweep.py --streaming``,
4 workers) this schedule ends at 0.98 and 1.01 of blocking DiLoCo's loss on two data orders (docs/performance.md).

A newcomer, or a peer whose sync failed or that fell behind, re-enters as :class:`~.overlap.OverlapLoop` does
(:func:`~p2p_diloco.protocol.rules.decide_overlap_entry`): it trains meanwhile, and its training is kept, as
local weights, whatever the sync gives: theta's changed fragments are merged, or theta is loaded whole when the
local weights are too far from it (:func:`~p2p_diloco.outer.fragments.landing`).
"""

from __future__ import annotations

import functools
import logging

from ..runtime.clock import Task
from .overlap import OverlapLoop

log = logging.getLogger("p2p_diloco.peer")


class StreamingLoop(OverlapLoop):
    """The round loop of ``outer.overlap`` with ``outer.fragments > 1`` (module docstring): :class:`~.overlap.
    OverlapLoop`'s, but for what happens at the end of a round's inner steps."""

    def _begin(self) -> None:
        pass  # no look-ahead start: each round trains on from the local weights

    def _next(self, r: int, pending: Task | None, tokens: int, steps: int) -> tuple[Task | None, int]:
        ctx, state = self.ctx, self.ctx.state
        if pending is not None:
            self._land(pending)  # theta(r) merged into the local weights (or whatever the sync gave)
        if state.round != r:  # the sync in flight did not give theta(r): its round is lost to us
            log.info("round %d: the swarm's state is theta(%d), not theta(%d); this round's inner steps stay in the "
                     "local weights", r + 1, state.round, r)
            return None, -1
        buffer = state.new_buffer()
        state.pseudo_gradient(self.rounds.training.replica, buffer)  # fragment r mod F, from theta(r)
        return ctx.clock.spawn(functools.partial(self._background_round, r, buffer, tokens, steps), "sync"), r
