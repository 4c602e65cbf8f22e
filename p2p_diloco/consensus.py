"""Decisions every peer takes alone from the same DHT records, so that they agree without a coordinator.

Pure functions over live records (``{peer_id: {"round", "digest", "phase", "inner_step", ...}}``): no network,
no hivemind. The round protocol in :mod:`p2p_diloco.peer` calls them; the unit tests pin their rules.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Iterable, Sequence

import torch

from .outer import digest as digest_of

# Phases in which a record's round/digest describe global weights the peer really holds. "join" (still loading)
# and "repair" (known-bad weights being replaced) are neither waited for nor used as donors.
SYNCED_PHASES = ("train", "sync", "done")


def majority_digest(digests: Iterable[str]) -> str | None:
    """The digest held by the most peers; a tie goes to the smallest digest, so every peer picks the same one.

    Two peers that disagree therefore converge too (one of them repairs), instead of both keeping their weights.
    """
    counts = Counter(d for d in digests if d)
    if not counts:
        return None
    top = max(counts.values())
    return min(d for d, c in counts.items() if c == top)


def synced(peers: dict[str, dict[str, Any]], round_: int | None = None) -> dict[str, dict[str, Any]]:
    """Records of peers holding real global weights (optionally only those of round ``round_``)."""
    return {pid: p for pid, p in peers.items()
            if p.get("phase") in SYNCED_PHASES and (round_ is None or p.get("round") == round_)}


def swarm_round(peers: dict[str, dict[str, Any]]) -> int:
    """The swarm's round: the highest round held (or passed) by two synced peers; with fewer than three synced
    peers, the highest round any of them holds. -1 if none.

    A straggler follows the peers that went ahead, which always come at least two at a time (a group), except
    after a solo step. One peer claiming a later round alone (a liar, a buggy peer) is not followed once there are
    three others to compare with: a peer that trusted the highest claim would download whatever state that one
    peer serves for it, and the digest check cannot help, since the claimant is then the whole of its own round.
    The honest peer that is ahead alone goes back to the others' round instead (:func:`alone_ahead`).
    """
    rounds = sorted((int(p.get("round", -1)) for p in synced(peers).values()), reverse=True)
    if not rounds:
        return -1
    return rounds[0] if len(rounds) < 3 else rounds[1]


def alone_ahead(peers: dict[str, dict[str, Any]], round_: int) -> bool:
    """True if we hold a later round than every one of at least three synced peers: they will not follow us
    (:func:`swarm_round`), so we must go back to theirs, or the swarm would stay split (we stepped alone while they
    were unreachable, or only we applied an all-reduce that failed for the others)."""
    at = synced(peers)
    return len(at) >= 3 and all(int(p.get("round", -1)) < round_ for p in at.values())


def pick_donors(peers: dict[str, dict[str, Any]], round_: int, rng: random.Random | None = None
                ) -> tuple[str | None, list[str]]:
    """``(digest, donors)``: the majority digest among synced peers of ``round_`` and the peers holding it, in
    random order (spreads the download load; a dead donor is simply skipped by the caller)."""
    at = synced(peers, round_)
    digest = majority_digest(p.get("digest", "") for p in at.values())
    # a client-mode peer accepts no inbound connection: it votes, but nobody can download from it
    donors = sorted(pid for pid, p in at.items() if p.get("digest") == digest and not p.get("client"))
    (rng or random).shuffle(donors)
    return digest, donors


def needs_repair(peers: dict[str, dict[str, Any]], round_: int, ours: str) -> str | None:
    """The digest we should hold instead of ``ours``, if the synced peers of our round (and we) disagree with us."""
    digests = [p.get("digest", "") for p in synced(peers, round_).values()]
    if not digests:
        return None
    best = majority_digest([*digests, ours])
    return best if best != ours else None


def round_well_under_way(peers: dict[str, dict[str, Any]], round_: int, inner_steps: int,
                         overlap: bool = False) -> bool:
    """True if round ``round_`` is too far along for a newcomer to join it.

    Peers of a round wait for every live peer of that round, so a newcomer that starts ``d`` inner steps late
    idles the N others for ``d`` steps each, and adds H steps of its own: worth it while ``N * d < H``. The
    newcomer joins if the most advanced peer of the round is within ``H / (N + 1)`` steps of the start (slightly
    conservative, since it also needs a moment to download), and not if any peer is already syncing.

    With ``overlap`` the peers of round r are syncing it in the background while they train the next round, and
    their ``inner_step`` is that training's progress: a newcomer who trains from theta(r) now arrives in round r's
    all-reduce that many steps after them, so only the ``inner_step`` rule applies.
    """
    at = synced(peers, round_)
    if not at:
        return False
    if not overlap and any(p.get("phase") == "sync" for p in at.values()):
        return True
    training = [p.get("inner_step", 0) for p in at.values() if overlap or p.get("phase") == "train"]
    return max(training, default=0) > inner_steps / (len(at) + 1)


def check_donated_state(meta: dict, tensors: Sequence[torch.Tensor], theta: Sequence[torch.Tensor],
                        fingerprint: str, target: int, digest: str | None, exact_round: bool = False) -> str | None:
    """Why a downloaded ``(meta, theta + momentum)`` must be refused, or None if it is what we asked for.

    A donor could be buggy, of another config, already a round further, or (for repairs) not in the majority;
    the digest is recomputed from the bytes received, so a transfer error cannot slip through either.
    """
    n = len(theta)
    if not isinstance(meta, dict) or not isinstance(meta.get("round"), int) or not isinstance(meta.get("digest"), str):
        return "malformed metadata"
    if meta.get("fp") != fingerprint or len(tensors) != 2 * n:
        return "fingerprint or tensor count mismatch"
    if any(a.shape != b.shape for a, b in zip(theta, tensors)):
        return "tensor shapes differ from our model"
    if digest_of(tensors[:n]) != meta.get("digest"):
        return "digest does not match its contents"
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return "it holds non-finite values"
    got = meta.get("round", -1)
    if got < target or (exact_round and got != target):
        return f"it holds round {got}, we need {target}"
    if got == target and digest is not None and meta["digest"] != digest:
        return "it does not hold the majority's weights"
    return None
