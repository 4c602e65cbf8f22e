"""What a decision of :mod:`p2p_diloco.protocol.rules` tells the peer to do next, with the reason why.

Actions are plain data: the driver (:mod:`p2p_diloco.peer`) carries them out and logs their reasons; the unit tests
compare them. Each decision function returns one of a few of them (its docstring says which).
"""

from __future__ import annotations

from dataclasses import dataclass

from .records import Phase


@dataclass(frozen=True, kw_only=True)
class Action:
    reason: str  # one line, for logs and tests: why this action and not another


@dataclass(frozen=True, kw_only=True)
class Wait(Action):
    """Nothing to do yet: look again in ``seconds``."""

    seconds: float


@dataclass(frozen=True, kw_only=True)
class CatchUp(Action):
    """The swarm is in a later round than ours (or will not follow us ahead): take its state
    (:func:`~p2p_diloco.protocol.rules.decide_catch_up` says from whom)."""


@dataclass(frozen=True, kw_only=True)
class Download(Action):
    """Download theta(``target``) and its momentum from the first of ``donors`` whose state checks out."""

    target: int
    digest: str | None  # the majority's digest of theta(target), which the state must have
    donors: tuple[str, ...]
    exact_round: bool  # a donor that moved past ``target`` meanwhile will not do (we are going back)


@dataclass(frozen=True, kw_only=True)
class Stay(Action):
    """Keep the state we hold."""


@dataclass(frozen=True, kw_only=True)
class Repair(Action):
    """Our theta differs from the majority of our round: replace it (from ``donors``, who hold ``digest``) and sit
    the rest of the round out."""

    digest: str
    donors: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ConfirmAlone(Action):
    """No live record holds back a solo step (none of a round-mate of ours): before taking one, make sure for a
    record lifetime that none shows, not just that one read missed them. The confirmation runs as long as the
    decisions are ``ConfirmAlone`` one after the other; any other decision (a round-mate's record showed) starts it
    over."""


@dataclass(frozen=True, kw_only=True)
class GiveUp(Action):
    """The certified chain cannot go on from here (too few of our group are left to certify a round, and they did
    not come back within ``swarm.round_timeout``): stop with an error rather than fork."""


@dataclass(frozen=True, kw_only=True)
class Solo(Action):
    """We are the whole swarm: apply our own pseudo-gradient."""


@dataclass(frozen=True, kw_only=True)
class AllReduce(Action):
    """Average with every live peer of our round: a group of exactly ``group_size`` (us included).

    ``all_in``: no round-mate is still training, so failing to assemble the group says the matchmaking window is
    too short. ``members``: exactly these round-mates (and us) must be the group, or we do not sign its round
    (:func:`~p2p_diloco.protocol.commit.group_problem`); None: any group of ``group_size`` will do.
    ``give_up_at``: ``Clock.monotonic()`` at which matchmaking stops waiting for round-mates still training (the
    straggler deadline), or None. ``leader``: the member (maybe us) every member asks to lead matchmaking
    (:func:`~p2p_diloco.protocol.consensus.matchmaking_leader`), or None.
    """

    group_size: int
    all_in: bool
    give_up_at: float | None = None
    members: tuple[str, ...] | None = None  # the round-mates counted (us excluded): a member signs for no other group
    leader: str | None = None

    @property
    def charged(self) -> tuple[str, ...]:
        """The members a failure of this attempt is charged to (:mod:`~p2p_diloco.protocol.liveness`): all of them
        when every one was ready to sync, none while round-mates still training were expected (they may only have
        been late)."""
        return tuple(self.members or ()) if self.give_up_at is None else ()


@dataclass(frozen=True, kw_only=True)
class Start(Action):
    """Start training at this round boundary, announced with ``phase``."""

    phase: Phase


@dataclass(frozen=True, kw_only=True)
class TrainAhead(Action):
    """(``outer.overlap``) The peers of our round are already averaging it: ours can only go into the next round.
    Train for it at once, announced as ``join``, and take theta(r+1) from them in the background."""


@dataclass(frozen=True, kw_only=True)
class Leave(Action):
    """Nothing is left to do for the others: leave the swarm."""
