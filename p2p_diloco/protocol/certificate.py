"""Round certificates: what every member of a round's group signs, and the chain they form.

After a round's all-reduce, each member that holds the complete average signs one :class:`Statement`: the run,
the config, the round, the sorted members and their weights, and the digests of the whole outer state (theta *and*
momentum) before and after the outer step, and the id of the certificate it builds on. A round is *committed* only
by a :class:`Certificate` that carries a valid signature of every member of that statement: nobody can make one
without a member that did not sign, and every member that signed commits the same state (docs/protocol.md,
"The commit step").

Certificates are chained (each names the previous one's id), small (:data:`MAX_MEMBERS`, :data:`MAX_BYTES`) and
canonical: the same statement gives the same bytes, hence the same id, on every peer. The hand-off rule
(:func:`check_link`) says which certificate may follow which. No network, no torch here: keys are checked through a
:class:`KeyBook` (the real one checks RSA signatures against libp2p peer ids, the fake one of
:mod:`p2p_diloco.testing` a table of simulated keys).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

MAX_MEMBERS = 64  # members of one group: more would make certificates (and the all-reduce) unwieldy
MAX_BYTES = 128 * 1024  # one encoded certificate: 64 members x (380 B RSA key + 344 B signature, base64) fits
GENESIS = ""  # the ``prev`` of round 0's certificate: theta(0) is built from the config, the same on every peer


class Signer(Protocol):
    """Our identity: signs statements."""

    peer_id: str
    public_key: bytes

    def sign(self, data: bytes) -> bytes: ...


class KeyBook(Protocol):
    """Checks signatures: is ``signature`` over ``data`` made by the key ``public_key``, and is that key
    ``peer_id``'s (a libp2p peer id is a hash of its public key)?"""

    def verify(self, peer_id: str, public_key: bytes, data: bytes, signature: bytes) -> bool: ...


@dataclass(frozen=True)
class Statement:
    """What each member of round ``round``'s group signs: theta(round) -> theta(round + 1).

    Args:
        run_id, fingerprint: the run and its config (a statement of another run or config is worthless here).
        round: the round's starting theta: theta(round) -> theta(round + 1).
        members: the group's peer ids, sorted.
        weights: each member's weight in the average (tokens), in the order of ``members``.
        before: digest of the whole outer state (theta and momentum) the group started from.
        after: digest of the whole outer state after the outer step.
        prev: the id of the certificate that produced ``before`` (:data:`GENESIS` for round 0, or the id of the
            certificate a peer was handed as its trust root).
    """

    run_id: str
    fingerprint: str
    round: int
    members: tuple[str, ...]
    weights: tuple[float, ...]
    before: str
    after: str
    prev: str

    def encode(self) -> bytes:
        """Canonical bytes: what is signed, and what the id is a hash of."""
        body = {"run_id": self.run_id, "fp": self.fingerprint, "round": self.round, "members": list(self.members),
                "weights": list(self.weights), "before": self.before, "after": self.after, "prev": self.prev}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def id(self) -> str:
        return hashlib.sha256(b"p2p-diloco-round:" + self.encode()).hexdigest()

    def problem(self) -> str | None:
        """Why this statement is malformed (None if it is not)."""
        if not 0 < len(self.members) <= MAX_MEMBERS:
            return f"{len(self.members)} members (1..{MAX_MEMBERS} allowed)"
        if list(self.members) != sorted(set(self.members)):
            return "members are not sorted and distinct"
        if len(self.weights) != len(self.members):
            return "one weight per member is needed"
        if not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in self.weights):
            return "weights must be finite and > 0"
        if self.round < 0:
            return f"round {self.round}"
        return None


@dataclass(frozen=True)
class Certificate:
    """A statement and its members' signatures: ``{peer id: (public key, signature)}``."""

    statement: Statement
    signatures: Mapping[str, tuple[bytes, bytes]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.statement.id

    @property
    def round(self) -> int:
        return self.statement.round

    def signed_by(self, keys: KeyBook) -> frozenset[str]:
        """The members whose signature over the statement checks out."""
        data = self.statement.encode()
        members = set(self.statement.members)
        return frozenset(pid for pid, (pub, sig) in self.signatures.items()
                         if pid in members and keys.verify(pid, pub, data, sig))

    def problem(self, keys: KeyBook) -> str | None:
        """Why this is not a complete certificate (None if every member signed)."""
        bad = self.statement.problem()
        if bad:
            return f"malformed statement: {bad}"
        missing = set(self.statement.members) - self.signed_by(keys)
        if missing:
            return f"{len(missing)} of {len(self.statement.members)} member signature(s) missing or invalid"
        return None

    def to_json(self) -> dict[str, Any]:
        s = self.statement
        sigs = {pid: [_b64(pub), _b64(sig)] for pid, (pub, sig) in sorted(self.signatures.items())}
        return {"statement": json.loads(s.encode()), "signatures": sigs}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, body: Any) -> Certificate:
        """ValueError on anything malformed (a peer's data is never trusted to be well-formed)."""
        try:
            s = body["statement"]
            statement = Statement(run_id=str(s["run_id"]), fingerprint=str(s["fp"]), round=int(s["round"]),
                                  members=tuple(str(m) for m in s["members"]),
                                  weights=tuple(float(w) for w in s["weights"]), before=str(s["before"]),
                                  after=str(s["after"]), prev=str(s["prev"]))
            sigs = {str(pid): decode_signature(pub, sig) for pid, (pub, sig) in body["signatures"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed certificate: {e!r}") from None
        bad = statement.problem()
        if bad:
            raise ValueError(f"malformed certificate: {bad}")
        return cls(statement, sigs)

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        """ValueError on anything malformed or over :data:`MAX_BYTES`."""
        return cls.from_json(_json(data, MAX_BYTES, "certificate"))


def _json(data: bytes, limit: int, what: str) -> Any:
    """``data`` parsed as JSON; ValueError if it is over ``limit`` bytes or malformed (a peer's data)."""
    if len(data) > limit:
        raise ValueError(f"{what} of {len(data)} bytes (at most {limit})")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed {what}: {e}") from None


def sign(statement: Statement, signer: Signer) -> tuple[bytes, bytes]:
    """Our ``(public key, signature)`` over ``statement``."""
    return signer.public_key, signer.sign(statement.encode())


def check_link(prev: Certificate | None, cert: Certificate, keys: KeyBook) -> str | None:
    """Why ``cert`` may not follow ``prev`` in the chain (None if it may). ``prev`` None: ``cert`` is checked on
    its own (round 0's, or a trust root's successor that the caller checks otherwise).

    The hand-off rule: the certificate of round r+1 needs the signatures of at least half of round r's certified
    group (:func:`keeps_enough`). Identities that were never in a certified group, or a minority of one group,
    cannot extend the chain. It tolerates any turnover over many rounds as long as each round keeps half of the
    previous group; a round that loses more than half its group cannot be certified by the rest. Exactly half
    is allowed so that the survivor of a pair goes on; the price is that the two halves of an even group cut
    apart by a network partition could both extend it (docs/protocol.md, "The hand-off rule").
    """
    bad = cert.problem(keys)
    if bad or prev is None:
        return bad
    s, p = cert.statement, prev.statement
    if s.prev != prev.id or s.round != p.round + 1 or s.before != p.after:
        return f"does not follow the certificate of round {p.round + 1}"
    if (s.run_id, s.fingerprint) != (p.run_id, p.fingerprint):
        return "another run or config"
    if not keeps_enough(p.members, s.members):
        kept = len(set(s.members) & set(p.members))
        return f"only {kept} of the previous group's {len(p.members)} members signed (half is needed)"
    return None


CHAIN_LENGTH = 8  # certificates before the head a peer publishes (as many as fit in CHAIN_BYTES)
CHAIN_BYTES = 32 * 1024  # one chain blob: 64 peers' blobs stay well under the 4 MiB of one DHT reply (swarm/port.py)


def encode_chain(certificates: Sequence[Certificate]) -> bytes:
    """The newest of ``certificates`` (oldest first) that fit in :data:`CHAIN_BYTES`, at most :data:`CHAIN_LENGTH`,
    as one blob (a JSON list): what a peer publishes of its chain before its head, so that a peer that fell behind
    can walk from its own certificate to the swarm's (:func:`~p2p_diloco.protocol.trust.linked`)."""
    kept: list[bytes] = []
    size = 2
    for cert in reversed(list(certificates)[-CHAIN_LENGTH:]):
        raw = cert.to_bytes()
        if size + len(raw) + 1 > CHAIN_BYTES:
            break
        kept.insert(0, raw)
        size += len(raw) + 1
    return b"[" + b",".join(kept) + b"]"


def decode_chain(data: bytes) -> list[Certificate]:
    """The certificates of a blob made by :func:`encode_chain`; ValueError on anything malformed or too long."""
    body = _json(data, CHAIN_BYTES, "chain")
    if not isinstance(body, list) or len(body) > CHAIN_LENGTH:
        raise ValueError(f"a chain is a list of at most {CHAIN_LENGTH} certificates")
    return [Certificate.from_json(c) for c in body]


def keeps_enough(previous: Sequence[str], signers: Sequence[str]) -> bool:
    """The hand-off rule's count: at least half of the ``previous`` group is among the ``signers``."""
    return 2 * len(set(previous) & set(signers)) >= len(set(previous))


def decode_signature(public_key: Any, signature: Any) -> tuple[bytes, bytes]:
    """``(public key, signature)`` from their base64 text in a certificate's JSON; ValueError if malformed."""
    return _unb64(public_key), _unb64(signature)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ValueError("not base64 text")
    return base64.b64decode(text, validate=True)
