"""What every peer concludes alone from the same live records, so that they agree without a coordinator.

Pure functions over a :data:`~p2p_diloco.protocol.records.View`: no network, no torch. The decisions of
:mod:`p2p_diloco.protocol.rules` are built from them; the unit tests pin each rule.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from typing import Iterable

from .records import Phase, View


def majority_digest(digests: Iterable[str]) -> str | None:
    """The digest held by the most peers; a tie goes to the smallest digest, so every peer picks the same one.

    Two peers that disagree therefore converge too (one of them repairs), instead of both keeping their weights.
    """
    counts = Counter(d for d in digests if d)
    if not counts:
        return None
    top = max(counts.values())
    return min(d for d, c in counts.items() if c == top)


def synced(view: View, round_: int | None = None) -> View:
    """Records of peers holding real global weights (optionally only those of round ``round_``)."""
    return {pid: p for pid, p in view.items() if p.synced and (round_ is None or p.round == round_)}


def training(view: View, round_: int) -> list[str]:
    """Peers of round ``round_`` still in their inner steps (phase ``train``), sorted."""
    return sorted(pid for pid, p in view.items() if p.round == round_ and p.phase == Phase.TRAIN)


def swarm_round(view: View) -> int:
    """The swarm's round: the highest round held (or passed) by two synced peers; with fewer than three synced
    peers, the highest round any of them holds. -1 if none.

    A straggler follows the peers that went ahead, which always come at least two at a time (a group), except
    after a solo step. One peer claiming a later round alone (a liar, a buggy peer) is not followed once there are
    three others to compare with: a peer that trusted the highest claim would download whatever state that one
    peer serves for it, and the digest check cannot help, since the claimant is then the whole of its own round.
    The honest peer that is ahead alone goes back to the others' round instead (:func:`alone_ahead`).
    """
    rounds = sorted((p.round for p in synced(view).values()), reverse=True)
    if not rounds:
        return -1
    return rounds[0] if len(rounds) < 3 else rounds[1]


def alone_ahead(view: View, round_: int) -> bool:
    """True if we hold a later round than every one of at least three synced peers: they will not follow us
    (:func:`swarm_round`), so we must go back to theirs, or the swarm would stay split (we stepped alone while they
    were unreachable, or only we applied an all-reduce that failed for the others)."""
    at = synced(view)
    return len(at) >= 3 and all(p.round < round_ for p in at.values())


def pick_donors(view: View, round_: int, rng: random.Random) -> tuple[str | None, list[str]]:
    """``(digest, donors)``: the majority digest among synced peers of ``round_`` and the peers holding it, in
    random order (spreads the download load; a dead donor is simply skipped by the caller), reachable donors first.

    A client-mode peer accepts no inbound connection: it is a donor of last resort, after every reachable one, and
    can only hand its state over by pushing it to a reachable peer that asks (protocol/push.py)."""
    at = synced(view, round_)
    digest = majority_digest(p.digest for p in at.values())
    reachable = sorted(pid for pid, p in at.items() if p.digest == digest and not p.client)
    clients = sorted(pid for pid, p in at.items() if p.digest == digest and p.client)
    rng.shuffle(reachable)
    rng.shuffle(clients)
    return digest, reachable + clients


def reachable_first(view: View, donors: Iterable[str]) -> tuple[str, ...]:
    """``donors`` sorted, the client-mode peers (donors of last resort, :func:`pick_donors`) after the others."""
    return tuple(sorted(donors, key=lambda pid: (bool(view[pid].client) if pid in view else False, pid)))


def needs_repair(view: View, round_: int, ours: str) -> str | None:
    """The digest we should hold instead of ``ours``, if the synced peers of our round (and we) disagree with us."""
    digests = [p.digest for p in synced(view, round_).values()]
    if not digests:
        return None
    best = majority_digest([*digests, ours])
    return best if best != ours else None


def round_syncing(view: View, round_: int, overlap: bool = False) -> bool:
    """True if a synced peer of round ``round_`` is already syncing it: a newcomer starting now would arrive after
    the round's group formed. With ``overlap`` the peers sync in the background while training on, so never."""
    return not overlap and any(p.phase == Phase.SYNC for p in synced(view, round_).values())


def round_well_under_way(view: View, round_: int, inner_steps: int, overlap: bool = False) -> bool:
    """True if round ``round_`` is too far along for a newcomer to join it.

    Peers of a round wait for every live peer of that round, so a newcomer that starts ``d`` inner steps late
    idles the N others for ``d`` steps each, and adds H steps of its own: worth it while ``N * d < H``. The
    newcomer joins if the most advanced peer of the round is within ``H / (N + 1)`` steps of the start (slightly
    conservative, since it also needs a moment to download), and not if any peer is already syncing.

    With ``overlap`` the peers of round r are syncing it in the background while they train the next round, and
    their ``inner_step`` is that training's progress: a newcomer who trains from theta(r) now arrives in round r's
    all-reduce that many steps after them, so only the ``inner_step`` rule applies.
    """
    at = synced(view, round_)
    if not at:
        return False
    if round_syncing(view, round_, overlap):
        return True
    steps = [p.inner_step or 0 for p in at.values() if overlap or p.phase == Phase.TRAIN]
    return max(steps, default=0) > inner_steps / (len(at) + 1)


def behind(view: View, round_: int) -> list[str]:
    """Live peers still working towards ``round_`` (joining, training or syncing an earlier round), sorted."""
    return sorted(pid for pid, p in view.items()
                  if p.phase in (Phase.JOIN, Phase.TRAIN, Phase.SYNC) and p.round < round_)


def seats(round_: int, candidates: Iterable[str], previous: Iterable[str] | None, cap: int) -> list[str]:
    """Who sits in round ``round_``'s group when more than ``cap`` peers could (a certificate holds at most
    :data:`~p2p_diloco.protocol.certificate.MAX_MEMBERS` members): a group is every live peer of its round, so above
    the cap no group could ever form, and peers that kept failing would cool each other down (found by
    ``benchmarks/protocol_sim.py --scale 70``). Sorted; ``candidates`` itself (sorted) when it fits.

    Every peer computes the same seats from the same candidates: half of the seats (rounded up) go to members of
    the group that certified our state (``previous``), the rest to the other candidates, each part in an order
    drawn from the round (a hash of the round and the peer id), so the peers left out change from round to round
    and two rounds' groups keep the half of each other that the hand-off rule needs. Seats left empty by one part
    go to the other. The peers without a seat sit the round out (their round's work is lost, never forked) and
    take theta(round+1) from the group."""
    pool = sorted(set(candidates))
    if len(pool) <= cap:
        return pool

    def order(pids: Iterable[str]) -> list[str]:
        return sorted(pids, key=lambda pid: hashlib.sha256(f"{round_}:{pid}".encode()).digest())

    before = set(previous or ())
    kept, new = order(p for p in pool if p in before), order(p for p in pool if p not in before)
    half = (cap + 1) // 2
    first = kept[:max(half, cap - len(new))]
    return sorted(first + new[:cap - len(first)])


def matchmaking_leader(round_: int, members: Iterable[str], view: View, me: str = "",
                       me_client: bool = False) -> str | None:
    """The member every member of round ``round_``'s group asks to lead its matchmaking (swarm/led_matchmaking.py):
    the first, in an order drawn from the round (a hash of the round and the peer id, as :func:`seats`), of the
    ``members`` (us included) that accept connections (not client mode, by their records; ``me_client`` for us).
    Every member with the same members computes the same leader, and the lead moves from round to round. None if
    no member can lead (then hivemind's own election runs)."""
    def client(pid: str) -> bool:
        return me_client if pid == me else bool(view[pid].client) if pid in view else True
    able = [pid for pid in set(members) if pid and not client(pid)]
    return min(able, key=lambda pid: hashlib.sha256(f"{round_}:{pid}".encode()).digest(), default=None)
