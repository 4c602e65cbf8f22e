"""Swarm-wide round targets (``round.mode = "swarm_target"``): when does a round's inner training end?

With a fixed H per peer, peers of different speeds either wait for each other (OpenDiLoCo's WAIT_FOR_ALL) or the
slow ones miss rounds. Here, as in hivemind's ``ProgressTracker``, every peer publishes its progress in the round
(tokens trained, and tokens per inner step) in its live record, and reads everyone else's. The round ends for
everyone when the swarm's combined progress reaches the target: by default H inner steps of every live peer,
counted in tokens so that a peer with a bigger batch counts for more. A fast peer thus does more inner steps and
a slow one fewer; the all-reduce weights each pseudo-gradient by its tokens (the paper's weighting by examples,
and the step-count-to-speed scaling of Async Local-SGD's DyLU, https://arxiv.org/abs/2401.09135).

Records are read every ``round.progress_period`` seconds and are up to that old, so between reads each peer
extrapolates every other training peer's tokens from its published rate (tokens/s) and the record's age, on every
inner step. Every peer thus computes about the same estimate and they stop at about the same moment, instead of
up to a read period apart, and the swarm overshoots the target by less. As a backstop, a peer also stops as soon
as any peer of its round has stopped (its phase is ``sync``) or any peer is in a later round (training, syncing or
done). Extrapolation spans at most ``MAX_EXTRAPOLATION`` seconds, so a stale record (or another host's clock
running ahead) cannot count much work that was never done.

Pure functions of the records: no network here (the peer reads and publishes them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .records import Phase, PeerRecord, View

MAX_EXTRAPOLATION = 2.0  # seconds: about a read period plus a heartbeat; older records are not extrapolated further


@dataclass(frozen=True)
class RoundProgress:
    """The swarm's progress in one round, as far as this peer can see."""

    target: int  # tokens the swarm trains this round
    done: int  # tokens trained in this round so far, this peer's exact and the others' as last published
    peers: int  # peers counted, this one included
    someone_stopped: bool  # a peer of this round already stopped training, or one is in a later round

    @property
    def reached(self) -> bool:
        return self.someone_stopped or self.done >= self.target

    @property
    def fraction(self) -> float:
        """How far through the round the swarm is, in [0, 1]: positions the lr schedule within the round."""
        return min(1.0, self.done / self.target) if self.target > 0 else 1.0


def swarm_progress(round_: int, own_tokens: int, own_step_tokens: int, view: View, inner_steps: int,
                   target_tokens: int = 0, now: float | None = None) -> RoundProgress:
    """Combine this peer's progress in ``round_`` with the other live peers' records.

    Args:
        round_: the round being trained (theta(round_) is where it started, as in the records).
        own_tokens: tokens this peer trained in the round so far.
        own_step_tokens: tokens per inner step of this peer (batch x sequence x accumulation).
        view: the other live peers' records (``round``, ``phase``, ``round_tokens``, ``step_tokens``, and for
            extrapolation ``tokens_per_s`` and ``t``, the publisher's ``time.time()``).
        inner_steps: H; the default target is H steps of every live peer of the round.
        target_tokens: a fixed swarm-wide target instead (0 = the default).
        now: ``time.time()`` to extrapolate the training peers' tokens to; None = no extrapolation.
    """
    mates = [p for p in view.values() if p.round == round_ and p.phase in (Phase.TRAIN, Phase.SYNC)]
    ahead = any(p.round > round_ and p.phase in (Phase.TRAIN, Phase.SYNC, Phase.DONE) for p in view.values())
    step_tokens = own_step_tokens + sum(_count(p.step_tokens, own_step_tokens) for p in mates)
    done = own_tokens + sum(_count(p.round_tokens, 0) + _since(p, now) for p in mates)
    return RoundProgress(target=target_tokens or inner_steps * step_tokens, done=done, peers=len(mates) + 1,
                         someone_stopped=ahead or any(p.phase == Phase.SYNC for p in mates))


def _since(record: PeerRecord, now: float | None) -> int:
    """Tokens a training peer has probably trained since it published ``record``: its rate times the record's age
    (at most ``MAX_EXTRAPOLATION`` s)."""
    rate, t = record.tokens_per_s, record.t
    if now is None or record.phase != Phase.TRAIN or not all(_is_number(x) for x in (rate, t)) or rate <= 0:
        return 0
    return int(rate * min(max(now - t, 0.0), MAX_EXTRAPOLATION))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(value: Any, default: int) -> int:
    """A token count from a peer's record; anything else (missing, negative, not an int) counts as ``default``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
