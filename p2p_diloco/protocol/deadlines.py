"""Deadlines derived from observed times instead of constants guessed up front (``swarm.deadlines = "adaptive"``).

A fixed timeout is wrong both ways: too long and every fault costs the worst case (a stuck straggler holds the
whole swarm for ``round_timeout``), too short and slow-but-healthy peers are dropped. hivemind's docstrings say as
much ("allreduce_timeout: around 2x the actual all-reduce time"), and hivemind issue #676 asks for deadlines that
track what the swarm actually does. Each deadline here is ``factor * (median + k * MAD)`` of a rolling window of
observed durations, clamped to ``[floor, cap]``:

- the median and the median absolute deviation are robust to the one round where something went wrong;
- ``cap`` is the configured constant, so an adaptive deadline is never longer than the fixed one;
- until ``min_samples`` durations are seen, the deadline is ``before`` (the constant, or the floor for
  deadlines that only grow).

Three deadlines use it (``Deadlines``): how long a peer waits for round-mates still training (arrival offsets),
the all-reduce timeout (all-reduce durations), and the matchmaking window (time to assemble a group), which
also doubles after each attempt that found no group.

Pure Python: no torch, no network, no clock of its own (times are passed in).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass
class RollingDeadline:
    """``clamp(factor * (median + k * MAD), floor, cap)`` over the last ``window`` observations."""

    floor: float
    cap: float
    before: float  # the deadline until min_samples observations exist
    factor: float = 2.0
    k: float = 3.0
    window: int = 16
    min_samples: int = 3

    def __post_init__(self):
        self.samples: deque[float] = deque(maxlen=self.window)
        self.failures = 0  # consecutive failures (see backoff)

    def observe(self, seconds: float) -> None:
        """Record one observed duration (a success: the failure backoff is reset)."""
        self.samples.append(max(0.0, float(seconds)))
        self.failures = 0

    def backoff(self) -> None:
        """One more consecutive failure: :attr:`value` doubles (up to ``cap``) until the next success."""
        self.failures += 1

    @property
    def value(self) -> float:
        if len(self.samples) < self.min_samples:
            base = self.before
        else:
            med = statistics.median(self.samples)
            mad = statistics.median(abs(x - med) for x in self.samples)
            base = self.factor * (med + self.k * mad)
        return min(self.cap, max(self.floor, base) * 2 ** min(self.failures, 16))


class Deadlines:
    """The round protocol's adaptive deadlines for one peer, or the fixed constants (``swarm.deadlines``).

    Args:
        sc: the ``[swarm]`` config: ``round_timeout``, ``allreduce_timeout`` and ``matchmaking_time`` are the
            caps (and the fixed values); ``straggler_floor`` and ``next_chunk_timeout`` bound them from below.
    """

    def __init__(self, sc):
        self.adaptive = sc.deadlines == "adaptive"
        # Waiting for round-mates still training: starts at round_timeout, then tracks arrival offsets.
        self.straggler = RollingDeadline(floor=min(sc.straggler_floor, sc.round_timeout), cap=sc.round_timeout,
                                         before=sc.round_timeout)
        # The all-reduce itself, once the group is assembled; a transfer never gets less than a chunk timeout.
        self.allreduce = RollingDeadline(floor=min(sc.next_chunk_timeout, sc.allreduce_timeout),
                                         cap=sc.allreduce_timeout, before=sc.allreduce_timeout)
        # Assembling a group only grows from the configured window (up to 4x): a slow DHT gets more time.
        self.matchmaking = RollingDeadline(floor=sc.matchmaking_time, cap=4 * sc.matchmaking_time,
                                           before=sc.matchmaking_time)
        self._fixed = {"straggler": sc.round_timeout, "allreduce": sc.allreduce_timeout,
                       "matchmaking": sc.matchmaking_time}

    def get(self, name: str) -> float:
        """The deadline in seconds for ``"straggler"``, ``"allreduce"`` or ``"matchmaking"``."""
        return getattr(self, name).value if self.adaptive else self._fixed[name]

    def snapshot(self) -> dict[str, float]:
        """All three, rounded, for events and logs."""
        return {f"{name}_s": round(self.get(name), 2) for name in self._fixed}


class StragglerWait:
    """One round's wait for round-mates still training, from the moment our pseudo-gradient is ready.

    Until the straggler deadline, round-mates still training count as members of the group to form (we wait
    for them); after it only those ready to sync do. The time at which no round-mate was training any more is
    the round's arrival offset, which feeds the next rounds' deadline.
    """

    def __init__(self, deadlines: Deadlines, now: float):
        self.deadlines, self.started = deadlines, now
        self.deadline = now + deadlines.get("straggler")
        self.arrived = self.dropped = False

    def observe(self, late: list[str], now: float) -> bool:
        """Record what the live records say now; True exactly once: when the round-mates still training are given
        up on (the straggler deadline has passed). Which round-mates to group with is the rule's
        (:func:`~p2p_diloco.protocol.rules.decide_sync`).

        Args:
            late: round-mates still in the ``train`` phase, as the live records say now.
            now: ``Clock.monotonic()``.
        """
        if not late and not self.arrived:
            self.arrived = True
            self.deadlines.straggler.observe(now - self.started)
        if now <= self.deadline or not late:
            return False
        newly, self.dropped = not self.dropped, True
        return newly

    def averaged(self, now: float) -> None:
        """The round's all-reduce succeeded. Unless stragglers were left out, everyone had arrived by now: the
        records may never have shown all round-mates in ``sync`` at once (a group assembles within a heartbeat)."""
        if not self.arrived and not self.dropped:
            self.arrived = True
            self.deadlines.straggler.observe(now - self.started)
