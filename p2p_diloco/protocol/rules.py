"""The round protocol's decisions: for each moment of a round, what to do next, from what this peer knows of itself,
the live records of the others (a :data:`~p2p_diloco.protocol.records.View`) and the clock.

Pure functions that return an :mod:`~p2p_diloco.protocol.actions` action with its reason; the driver
(:mod:`p2p_diloco.peer`) reads the records, calls them, and carries the action out. Each function is tested case by
case as a table (``tests/unit/test_rules.py``), and the scenarios run against an in-memory swarm on a virtual clock
(``p2p_diloco.testing``). ``now`` is always ``Clock.monotonic()``.

The moments, in the order of a peer's life: :func:`decide_first_round` (wait for ``swarm.min_peers``),
:func:`decide_join` (which round boundary to start at), :func:`decide_catch_up` (whose state to take),
:func:`decide_sync` (the end of every round), :func:`decide_round_end` (sitting a round out after a repair),
:func:`decide_overlap_entry` (``outer.overlap``), :func:`decide_linger` (the end of the run).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

from . import consensus
from .actions import (AllReduce, CatchUp, GiveUp, ConfirmAlone, Download, Leave, Repair, Solo, Start, Stay, TrainAhead,
                      Wait)
from .certificate import MAX_MEMBERS, keeps_enough
from .records import Phase, View

JOIN_POLL = 0.2  # a newcomer waiting for a round boundary looks this often: the window to start in is short
OVERLAP_POLL = 0.2  # an overlapped peer waiting for its round-mates to finish their inner steps
TRAINING_POLL = 0.5  # no round-mate ready, some still training past the straggler deadline: look again this often


def decide_first_round(view: View, round_: int, min_peers: int, now: float, deadline: float, poll: float
                       ) -> Start | Wait:
    """Hold the first round until ``min_peers`` peers (us included) are live and ready to train, so that they
    all start it together and all take part in it; after ``deadline``, start anyway. A swarm already past our
    ``round_`` (in a view of verified records) has no first round to wait for: we join it at once. (Found by the
    protocol simulator: a newcomer that waited for ``min_peers`` while the swarm lingered at the end of its run
    missed every donor, then started a chain of its own from theta(0).)"""
    at = consensus.swarm_round(view)
    if at > round_:
        return Start(phase=Phase.TRAIN, reason=f"the swarm is already in round {at + 1}")
    ready = sum(1 for p in view.values() if p.ready) + 1
    if ready >= min_peers:
        return Start(phase=Phase.TRAIN, reason=f"{ready} of {min_peers} peers ready")
    if now >= deadline:
        return Start(phase=Phase.TRAIN, reason=f"only {ready} of {min_peers} peers ready by the deadline")
    return Wait(seconds=poll, reason=f"waiting for peers: {ready}/{min_peers} ready")


def decide_join(round_: int, view: View, *, inner_steps: int, overlap: bool, waits_for_min_peers: bool,
                finished: bool, now: float, deadline: float, poll: float = JOIN_POLL, me: str = "",
                head_members: Collection[str] | None = None, unverified_ahead: int = 0,
                waited: bool = False) -> CatchUp | Start | Wait:
    """A newcomer holding theta(``round_``): start now, catch up first, or wait for the next round boundary?

    A newcomer that starts a round that is well under way makes every other peer of that round wait for its inner
    steps (:func:`consensus.round_well_under_way`). The first round of a swarm that waited for ``min_peers``
    (``waits_for_min_peers``) is the exception: the others expect us in it. With ``outer.overlap`` the round we
    can still contribute to is decided later (:func:`decide_overlap_entry`), so we start announced as ``join``.

    A member of the group that certified theta(``round_``) (``head_members``; ``me``: our peer id), restarted from
    its checkpoint, starts at once when the members of that group still in the round are fewer than half of it:
    without us they cannot extend the chain (the hand-off rule) and wait for us (:func:`decide_sync`), so waiting
    for the end of their round would be a deadlock (found by ``benchmarks/chaos.py``: half of a group killed and
    restarted).

    A newcomer with no certificate (``head_members`` None) that sees ``unverified_ahead`` records of later rounds
    it cannot verify yet (none of its ``--initial-peers`` signed their certificates: e.g. its initial peer restarted
    with a new identity and has not been in a group since) waits for one it can verify, until ``deadline``:
    starting now would start a chain of its own from theta(0) beside the swarm's (found by ``benchmarks/chaos.py
    --new-identity``: newcomers trained alone from round 1).

    A newcomer that already waited for a round boundary and then took the state of that boundary (``waited``)
    starts at once, however far the round is, unless a peer of it is already syncing (then it would only arrive
    after the round's group had formed): the round went on while it downloaded, and the next boundary would look
    the same, the download taking as long again. Waiting again made newcomers wait, download and wait once per
    round without ever training (found by ``benchmarks/chaos.py``: a restarted peer took 7 states in 140 s; at
    H = 10 and 11 peers a round is "well under way" after one inner step of the fastest peer). Joining late costs
    the others the steps they wait for us, once (the straggler deadline bounds it); waiting again costs all our work.
    """
    phase = Phase.JOIN if overlap else Phase.TRAIN
    if finished:
        return Start(phase=phase, reason="the run's last round is done")
    if now >= deadline:
        return Start(phase=phase, reason="waited swarm.round_timeout for a round boundary")
    if consensus.swarm_round(view) > round_:
        return CatchUp(reason=f"the swarm is past round {round_}")
    if unverified_ahead and head_members is None:
        return Wait(seconds=poll, reason=f"{unverified_ahead} peer(s) ahead of us whose certificates none of our "
                                         f"initial peers signed yet: waiting for one we can verify")
    if round_ == 0 and waits_for_min_peers:
        return Start(phase=phase, reason="the first round of a swarm that waited for its peers")
    if head_members and me in head_members:
        still = [pid for pid in head_members if pid in view and view[pid].round == round_ and view[pid].synced]
        if still and not keeps_enough(head_members, still):
            return Start(phase=phase, reason=f"only {len(still)} of the {len(head_members)} members of round "
                                             f"{round_}'s group are left in it: the hand-off needs us")
    if waited and not consensus.round_syncing(view, round_, overlap):
        return Start(phase=phase, reason=f"we waited for round {round_}'s boundary and took its state: the next "
                                         f"boundary would come after as long a download")
    if not consensus.round_well_under_way(view, round_, inner_steps, overlap):
        return Start(phase=phase, reason=f"round {round_ + 1} is not under way yet")
    return Wait(seconds=poll, reason=f"round {round_ + 1} is well under way: waiting for its end")


def decide_catch_up(round_: int, view: View, rng: random.Random) -> Download | Stay:
    """Whose state to take, if any: the majority's of the swarm's round (:func:`consensus.swarm_round`) when it is
    past ours, or when we hold a round alone ahead of peers that will not follow us (then exactly their round)."""
    target = consensus.swarm_round(view)
    back = consensus.alone_ahead(view, round_)
    if target < 0 or (target <= round_ and not back):
        return Stay(reason=f"the swarm's round {target} is not past ours ({round_})")
    digest, donors = consensus.pick_donors(view, target, rng)
    why = (f"we hold round {round_} alone; the others are in earlier rounds and will not follow" if back
           else f"the swarm is in round {target}, we are in {round_}")
    return Download(target=target, digest=digest, donors=tuple(donors), exact_round=back, reason=why)


@dataclass(frozen=True)
class SyncState:
    """What :func:`decide_sync` needs to know of this peer at the end of round ``round + 1``.

    Args:
        round: theta(round) is what this round started from.
        digest: its digest.
        straggler_deadline: ``now`` after which round-mates still training are left out of a group of those ready.
        alone_since: when the decisions started being :class:`ConfirmAlone`, one after the other (None: the last
            decision was not one).
        confirm_for: how long to confirm before a solo step (a record lifetime: ``swarm.peer_ttl`` + one heartbeat).
        overlap: ``outer.overlap`` (the sync runs in the background, behind the next round's inner steps).
        cooling: peers cooling down after failing attempts with us (:mod:`~p2p_diloco.protocol.liveness`): left
            out of the group, of the round-mates waited for, and of the records that hold back a solo step.
        round_deadline: ``now`` after which round-mates still training no longer hold back a solo step (the start
            of our sync + ``swarm.round_timeout``, the bound on any wait for one round).
        me: our peer id.
        suspects: round-mates whose direct dial our own probe just found refused (:mod:`p2p_diloco.peer.suspects`):
            dead, so their records count as expired.
        head_members: the members of the certificate of theta(``round``) (None: we hold none); a group that keeps
            fewer than half of them cannot extend our chain (the hand-off rule).
        client: we run in client mode (accept no connection): we never lead matchmaking.
    """

    round: int
    digest: str
    straggler_deadline: float
    alone_since: float | None = None
    confirm_for: float = 0.0
    overlap: bool = False
    cooling: frozenset[str] = field(default_factory=frozenset)
    round_deadline: float = math.inf
    me: str = ""  # our peer id
    suspects: frozenset[str] = field(default_factory=frozenset)  # round-mates our own probe found dead
    head_members: tuple[str, ...] | None = None  # the group that certified theta(round) (None: no certificate)
    client: bool = False


def decide_sync(s: SyncState, view: View, now: float
                ) -> CatchUp | Repair | Wait | ConfirmAlone | Solo | AllReduce | GiveUp:
    """Our pseudo-gradient for the round after theta(``s.round``) is ready: what now? Checked in this order:

    * records of ``s.suspects`` (found dead by our own probe) are left out, as if expired; then
    * the swarm is past our round, or will not follow us ahead → :class:`CatchUp` (our work is dropped); peers
      cooling down do not lead unless they are all there is;
    * the synced peers of our round mostly hold another digest than ours → :class:`Repair`;
    * the round's group is every live peer of our round, and round-mates still training count until the straggler
      deadline (after it only those ready to sync do); with ``overlap`` we wait until all of them are ready;
      peers cooling down (``s.cooling``) count for nothing;
    * nobody to group with, but round-mates still training past the straggler deadline → :class:`Wait` for them
      (until ``s.round_deadline``): leaving them out is only for a group of the others, never for a solo step;
    * a group smaller than the round-mates cooling down, or one the hand-off rule forbids, takes them in again;
      above :data:`~p2p_diloco.protocol.certificate.MAX_MEMBERS` peers the group is those seated, and without a
      seat → :class:`Wait` (the round is sat out, then caught up): :func:`_limited`;
    * a group that would not keep half of the group that certified our state → :class:`Wait` for the members
      of that group live in our round, :class:`GiveUp` at ``s.round_deadline`` (never a fork);
    * nobody else is in our round → :class:`Solo`, once confirmed over a record lifetime (:func:`_alone`);
    * otherwise → :class:`AllReduce` with exactly that group, and the member that leads its matchmaking.
    """
    r = s.round
    view = {pid: p for pid, p in view.items() if pid not in s.suspects}
    # A peer cooling down can be ahead of the others only by a solo step (it is in no group of ours): following it
    # would drop our round for its one-peer step. The others decide, unless every other peer is cooling down (then
    # we may well be the broken one, and must not drift away from the swarm).
    others = {pid: p for pid, p in view.items() if pid not in s.cooling}
    leaders = others if consensus.synced(others) else view
    if consensus.swarm_round(leaders) > r or consensus.alone_ahead(leaders, r):
        return CatchUp(reason=f"the swarm is past round {r} (or will not follow us): our round is lost")
    good = consensus.needs_repair(view, r, s.digest)
    if good is not None:
        donors = consensus.reachable_first(view, (pid for pid, p in consensus.synced(view, r).items()
                                                          if p.digest == good))
        return Repair(digest=good, donors=donors, reason=f"the majority of round {r} holds {good[:12]}")
    late = [pid for pid in consensus.training(view, r) if pid not in s.cooling]
    ready = (Phase.TRAIN, Phase.SYNC) if now <= s.straggler_deadline or not late else (Phase.SYNC,)
    mates = sorted(pid for pid, p in view.items() if p.round == r and p.phase in ready and pid not in s.cooling)
    if s.overlap and any(view[m].phase != Phase.SYNC for m in mates):
        # Overlapped peers start syncing as soon as their inner steps end, at different moments: matching now
        # would fix the group size before the slower ones (or a newcomer) are in, and whoever came first would
        # take their places. We are training meanwhile, so waiting costs nothing.
        return Wait(seconds=OVERLAP_POLL, reason="round-mates still training")
    if not mates and late and now < s.round_deadline:
        return Wait(seconds=TRAINING_POLL, reason=f"no round-mate ready; {len(late)} still training past the straggler "
                                                  f"deadline, and a solo step beside them would shut them out")
    cooled = sorted(pid for pid, p in view.items() if p.round == r and p.phase in ready and pid in s.cooling)
    mates = _limited(s, mates, cooled)
    if mates is None:
        return Wait(seconds=TRAINING_POLL, reason=f"more peers in round {r + 1} than a group holds ({MAX_MEMBERS}) "
                                                  f"and no seat for us: sitting this round out")
    problem = _hand_off_problem(s, mates)
    if problem:
        return _wait_for_hand_off(s, view, mates, problem, now)
    if not mates:
        return _alone(s, now)
    give_up_at = s.straggler_deadline if late and ready != (Phase.SYNC,) else None
    return AllReduce(group_size=len(mates) + 1, all_in=not late, give_up_at=give_up_at, members=tuple(mates),
                     leader=consensus.matchmaking_leader(r, [s.me, *mates], view, s.me, s.client),
                     reason=f"{len(mates)} round-mate(s) " + ("ready" if not late else f"({len(late)} training)"))


def _limited(s: SyncState, mates: list[str], cooled: list[str]) -> list[str] | None:
    """The round-mates of our group, given those ready (``mates``) and those cooling down (``cooled``): None if
    the group is full without us.

    A group smaller than the round-mates we cooled down may be the broken side (a network outage fails every
    group, and after it every peer would have cooled every other one down and stepped alone: a fork), and one the
    hand-off rule forbids cannot commit: then the round-mates cooling down get another chance. Above
    :data:`~p2p_diloco.protocol.certificate.MAX_MEMBERS`, the group is the peers :func:`consensus.seats` seats."""
    if len(mates) + 1 < len(cooled) or (cooled and _hand_off_problem(s, mates)):
        mates = sorted(mates + cooled)
    if len(mates) + 1 <= MAX_MEMBERS:
        return mates
    seated = consensus.seats(s.round, [s.me, *mates], s.head_members, MAX_MEMBERS)
    return [pid for pid in seated if pid != s.me] if s.me in seated else None


def _hand_off_problem(s: SyncState, mates: Collection[str]) -> str | None:
    """Why a round certified by us and ``mates`` would not follow our certified chain (the hand-off rule:
    :func:`~p2p_diloco.protocol.trust.extension_problem`), or None. No certificate of our own: no rule."""
    if s.head_members is None or keeps_enough(s.head_members, [s.me, *mates]):
        return None
    kept = len(set(s.head_members) & {s.me, *mates})
    return (f"only {kept} of the {len(s.head_members)} members of round {s.round}'s certified group would sign "
            f"(half are needed)")


def _wait_for_hand_off(s: SyncState, view: View, mates: Collection[str], problem: str, now: float
                       ) -> Wait | GiveUp:
    """The group we could form now may not extend our chain: wait for members of our certified group that are
    live in our round but not ready (a member restarted from its checkpoint joins the round at once for this:
    :func:`decide_join`), and give up at ``s.round_deadline`` rather than fork."""
    if now >= s.round_deadline:
        return GiveUp(reason=f"no group within swarm.round_timeout can extend our chain: {problem}")
    coming = sorted(pid for pid in s.head_members or () if pid in view and pid not in mates
                    and view[pid].round == s.round and view[pid].phase in (Phase.JOIN, Phase.TRAIN, Phase.SYNC))
    if coming:
        return Wait(seconds=TRAINING_POLL, reason=f"{problem}; waiting for {len(coming)} of them, live in our round")
    return Wait(seconds=TRAINING_POLL, reason=f"we cannot form a group now: {problem}")


def _alone(s: SyncState, now: float) -> ConfirmAlone | Solo:
    """No record holds back a solo step: no round-mate of ours (``train`` or ``sync`` in our round, not cooling
    down; one training past ``s.round_deadline`` no longer counts). Step alone once that has held for a record
    lifetime (``s.confirm_for``), whatever the size of our last group: one read of the records can miss some, and a
    solo step beside a live round-mate forks theta or, beside a newcomer in its first round, shuts it out.

    That costs a peer that is really alone one record lifetime per round (``swarm.peer_ttl`` + one heartbeat, 7 s
    by default; tests/sim/test_liveness.py measures it). An empty view is no proof on its own even when we were
    alone last round too: a newcomer in our round got theta(r) from us and started training since, and we have not
    read the records since our last round ended.

    Records of our round that do not hold it back: ``join`` and ``repair`` ones (those peers sit the round out and
    wait for theta(r+1) from us: waiting for them would deadlock until their own ``swarm.round_timeout``; a newcomer
    that does start in our round announces ``train`` at once, and counts then), and peers cooling down (a broken
    peer stuck in our round would otherwise hold every solo step back forever; it failed
    :data:`~p2p_diloco.protocol.liveness.STRIKES` attempts with us in a row)."""
    if s.alone_since is None:
        return ConfirmAlone(reason="no round-mate's record; confirming for a record lifetime before a solo step")
    if now >= s.alone_since + s.confirm_for:
        return Solo(reason=f"no round-mate's record for {now - s.alone_since:.1f} s")
    return ConfirmAlone(reason="confirming that no round-mate is live")


def decide_round_end(round_: int, view: View, now: float, deadline: float, poll: float) -> CatchUp | Stay | Wait:
    """Sitting round ``round_`` out (after a repair, or an overlapped newcomer): take theta(round_+1) once the
    swarm holds it; stop waiting if the peers of round ``round_`` are gone (nothing will come) or at ``deadline``."""
    if now >= deadline:
        return Stay(reason="waited swarm.round_timeout for the round to end")
    if consensus.swarm_round(view) > round_:
        return CatchUp(reason=f"the swarm holds round {round_ + 1}")
    if not consensus.synced(view, round_):
        return Stay(reason=f"no synced peer of round {round_} is left")
    return Wait(seconds=poll, reason=f"waiting for round {round_ + 1} to end")


def decide_overlap_entry(round_: int, view: View) -> TrainAhead | Start:
    """(``outer.overlap``) Start training with no sync in flight (first round, after a join or a lost round): are
    the peers of our round already averaging it? Then our pseudo-gradient can only go into the next round."""
    if any(p.phase == Phase.SYNC for p in consensus.synced(view, round_).values()):
        return TrainAhead(reason=f"the peers of round {round_ + 1} are already averaging it")
    return Start(phase=Phase.TRAIN, reason=f"a member of round {round_ + 1}")


def decide_linger(round_: int, view: View, now: float, deadline: float, poll: float, digest: str = "",
                  unverified: Collection[str] = ()) -> Leave | Wait | Repair:
    """The run's last round is done. Before leaving, the digest vote every round has: if the synced peers of our
    round mostly hold another state than ours → :class:`Repair` (a divergence in the last round is repaired too).
    Then stay a state donor (until ``deadline``) while a peer is still behind, or while a peer of our round holds a
    state we could not verify (``unverified``: it may be the one that repairs from us), so that it can still
    download from us."""
    if now >= deadline:
        return Leave(reason="waited swarm.state_timeout for the peers behind")
    good = consensus.needs_repair(view, round_, digest) if digest else None
    if good is not None:
        donors = consensus.reachable_first(view, (pid for pid, p in consensus.synced(view, round_).items()
                                                          if p.digest == good))
        return Repair(digest=good, donors=donors, reason=f"the majority of the last round holds {good[:12]}")
    late = consensus.behind(view, round_)
    if not late and not unverified:
        return Leave(reason="no live peer is behind")
    waiting = f"{len(late)} peer(s) to catch up" if late else f"{len(unverified)} peer(s) of our round to repair"
    return Wait(seconds=poll, reason=f"finished round {round_}; waiting for {waiting}")


def donation_target(target: int, digest: str | None, got: Any, donor: str, read_view: Callable[[], View],
                    exact_round: bool) -> tuple[int, str | None, str | None]:
    """``(round, digest, problem)``: which round and digest a state downloaded from ``donor`` must have, given the
    round ``got`` it says it holds. A donor that moved on during the download must hold the majority's digest of
    *that* round, vouched for by peers other than the donor (else a liar would only need to claim a later round);
    with no other synced peer at all (a lone donor), its own live record is all there is to go by. ``read_view``
    is called (a fresh read of the records) only then."""
    if not (isinstance(got, int) and got > target and not exact_round):
        return target, digest, None
    view = read_view()
    others = {pid: p for pid, p in view.items() if pid != donor}
    vouching: Mapping = others if consensus.synced(others) else {donor: view[donor]} if donor in view else {}
    expected = consensus.majority_digest(p.digest for p in consensus.synced(vouching, got).values())
    if expected is None:
        return got, None, f"no other peer vouches for its round {got}"
    return got, expected, None


def group_mismatch(round_: int, digest: str, gathered: Mapping[str, Any]) -> dict[str, Any] | None:
    """The members of an all-reduce group that started from other weights than ours (theirs by peer id), or None.

    The result is still applied: the next round's digest check repairs whichever side is in the minority."""
    other = {pid: g.get("digest") for pid, g in gathered.items() if g.get("digest") != digest}
    if other or any(g.get("round") != round_ for g in gathered.values()):
        return other
    return None
