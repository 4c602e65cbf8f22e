"""The commit step of a round: which group a member agrees to sign for, what it signs, and when the round is
committed, from the signatures it has seen and the clock. Pure functions; the driver
(:mod:`p2p_diloco.peer.certifier`) publishes and reads the signatures.

Every member that holds the complete average of a round builds the same :class:`~.certificate.Statement` from
what the all-reduce gave every member alike (the members, their weights, their starting digests) and from the
outer step it computed aside; it signs it only if the group is the one it expected (:func:`group_problem`) and
only within :data:`SIGN_WINDOW` of the result (:func:`may_sign`); then it commits as soon as it holds a valid
signature of every member, and drops the round if it does not within the commit window (:func:`decide_commit`).

Why members cannot end a round differently (docs/protocol.md, "The commit step"): a complete certificate needs
the signature of every member, so a member that did not sign leaves every other member without one; a member
that signed commits only with the complete certificate, which any other member that signed can also read.
The one assumption is timing: a signature is stored within half the commit window of the result (a member
checks :func:`may_sign` right before signing, and members finish an all-reduce within a fraction of it of each
other), so a member that gave up waiting could not have missed a complete certificate.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Collection, Mapping

from .actions import Action
from .certificate import MAX_MEMBERS, Certificate, KeyBook, Statement, decode_signature

SIGN_WINDOW = 0.5  # of the commit window: a member signs only this soon after it got the result


@dataclass(frozen=True, kw_only=True)
class Commit(Action):
    """Every member signed: take the step."""

    certificate: Certificate


@dataclass(frozen=True, kw_only=True)
class Abandon(Action):
    """The commit window is over without a complete certificate: drop the step (nothing is applied)."""


@dataclass(frozen=True, kw_only=True)
class Poll(Action):
    """Some signatures are still missing: read them again in ``seconds``."""

    seconds: float
    missing: tuple[str, ...]


def group_problem(round_: int, before: str, me: str, expected: Collection[str] | None, group_size: int,
                  gathered: Mapping[str, Any]) -> str | None:
    """Why this member must not sign for the group an all-reduce gave it, or None.

    ``gathered``: every member's gathered data (round, digest, tokens), by peer id, us included; ``expected``:
    the round-mates the rules counted (us excluded), or None if any group of ``group_size`` will do. The leader
    of hivemind's matchmaking picks the group and a follower accepts it as sent: agreeing here means that no
    leader alone decides who is in a round.
    """
    members = set(gathered)
    if me not in members:
        return "we are not in the group we were given"
    if len(members) != group_size:
        return f"a group of {len(members)}, we expected {group_size}"
    if len(members) > MAX_MEMBERS:
        return f"a group of {len(members)} (at most {MAX_MEMBERS})"
    if expected is not None and members != set(expected) | {me}:
        unexpected = sorted(members - set(expected) - {me})
        absent = sorted(set(expected) - members)
        return f"not the round-mates we expected (unexpected {unexpected}, absent {absent})"
    for pid, g in gathered.items():
        if not isinstance(g, Mapping) or g.get("round") != round_ or g.get("digest") != before:
            return f"member {pid} did not start from our state (round {round_}, {before[:12]})"
        tokens = g.get("tokens")
        if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or not tokens > 0:
            return f"member {pid} gathered no valid weight"
    return None


def statement_for(run_id: str, fingerprint: str, round_: int, before: str, after: str,
                  gathered: Mapping[str, Any]) -> Statement:
    """The statement every member of the group builds alike (after :func:`group_problem` passed). ``prev`` is the
    chain head most members name (the smallest id on a tie): a member restored from an old checkpoint or given
    an uncertified state may hold none, and the group still agrees on one statement."""
    members = tuple(sorted(gathered))
    heads = Counter(str(gathered[m].get("head", "")) for m in members)
    top = max(heads.values())
    prev = min(h for h, n in heads.items() if n == top)
    weights = tuple(float(gathered[m]["tokens"]) for m in members)
    return Statement(run_id=run_id, fingerprint=fingerprint, round=round_, members=members, weights=weights,
                     before=before, after=after, prev=prev)


def may_sign(got_result_at: float, now: float, window: float) -> bool:
    """A member signs only within ``SIGN_WINDOW`` of the commit window after it got the result: one that was
    frozen past it will not complete a certificate the others may already have given up on."""
    return now - got_result_at < SIGN_WINDOW * window


def decide_commit(statement: Statement, signatures: Mapping[str, tuple[bytes, bytes]], keys: KeyBook,
                  now: float, deadline: float, poll: float, verified: Collection[str] = ()) -> Commit | Abandon | Poll:
    """Commit once every member's signature checks out; give up at ``deadline`` (the commit window's end).
    ``verified``: members whose signature in ``signatures`` was checked already (by an earlier call: a poll
    checks only the new ones, or every poll would verify N signatures again)."""
    members = set(statement.members)
    known = {pid for pid in verified if pid in members and pid in signatures}
    fresh = Certificate(statement, {pid: sig for pid, sig in signatures.items() if pid in members - known})
    signed = known | fresh.signed_by(keys)
    missing = tuple(sorted(set(statement.members) - signed))
    if not missing:
        return Commit(certificate=Certificate(statement, {pid: signatures[pid] for pid in signed}),
                      reason=f"all {len(signed)} members signed")
    if now >= deadline:
        return Abandon(reason=f"{len(missing)} of {len(statement.members)} members did not sign in time: {missing}")
    return Poll(seconds=poll, missing=missing, reason=f"waiting for {len(missing)} signature(s)")


def encode_signature(statement: Statement, public_key: bytes, signature: bytes) -> bytes:
    """A member's signature as it goes into the DHT (the ``sig`` blob)."""
    cert = Certificate(statement, {"_": (public_key, signature)})
    pub, sig = cert.to_json()["signatures"]["_"]
    return json.dumps({"id": statement.id, "round": statement.round, "pub": pub, "sig": sig},
                      separators=(",", ":")).encode()


def signatures_for(statement: Statement, blobs: Mapping[str, bytes],
                   certificates: Mapping[str, bytes] = {}) -> dict[str, tuple[bytes, bytes]]:  # noqa: B006
    """The signatures over ``statement`` found in the members' ``sig`` blobs and in any complete certificate a
    member published (``cert`` blobs); malformed blobs are ignored (they are a peer's data)."""
    found: dict[str, tuple[bytes, bytes]] = {}
    after = statement.after.encode()
    for raw in certificates.values():
        if after not in raw:  # not a certificate of this state: no need to decode it (N blobs of N members each)
            continue
        try:
            cert = Certificate.from_bytes(raw)
        except ValueError:
            continue
        if cert.id == statement.id:
            found.update(cert.signatures)
    for pid, raw in blobs.items():
        try:
            body = json.loads(raw)
            if body.get("id") != statement.id:
                continue
            found[pid] = decode_signature(body["pub"], body["sig"])
        except (ValueError, AttributeError, TypeError, KeyError):
            continue
    return found
