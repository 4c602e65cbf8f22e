"""Which claims of the other peers a peer may act on: only what a round certificate it can verify backs.

A live record says "I hold theta(round), with this digest, certified by the certificate ``head``". Anyone can
publish a record under a fresh identity, so a record alone moves nobody: before the rules see it
(:func:`verified_view`), a claim to be *ahead* of us must come with a complete certificate (every member signed)
of exactly that state, which we *trust* (:func:`trust_problem`):

* it follows our own certificate (the hand-off rule, :func:`~.certificate.check_link`), or
* at least half of our own certificate's group signed it: the peers we last agreed with vouch for the rounds in
  between, which no fresh identity, nor a minority of that group, can do; or
* we hold no certificate yet (a newcomer, or theta(0)): one of the peers we were given with ``--initial-peers``
  signed it (the newcomer's trust root, docs/protocol.md); a peer given no initial peers (the swarm's first one)
  trusts any complete certificate.

A claim to be in our round with another digest (a repair) needs the same. A claim to be *behind* us must match a
state of our own recent chain (:class:`History`), else it is dropped: a peer that fell further behind than we
remember does not keep us lingering. Pure functions; the driver reads the records and the certificates.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

from .certificate import Certificate, KeyBook, check_link, keeps_enough
from .records import View

HISTORY = 64  # rounds of our own chain we remember: claims of peers further behind are not verified


class History:
    """The digests of the states we held in the last :data:`HISTORY` rounds (``{round: digest}``): what a
    record of an earlier round must hold to be believed."""

    def __init__(self):
        self.digests: OrderedDict[int, str] = OrderedDict()

    def add(self, round_: int, digest: str) -> None:
        self.digests[round_] = digest
        self.digests.move_to_end(round_)
        while len(self.digests) > HISTORY:
            self.digests.popitem(last=False)

    def holds(self, round_: int, digest: str) -> bool:
        return self.digests.get(round_) == digest


def initial_peer_ids(maddrs: Sequence[str]) -> frozenset[str] | None:
    """The peer ids our ``--initial-peers`` name (``.../p2p/<id>``): our trust root; None if none were given."""
    ids = frozenset(m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m)
    return ids or None


def trust_problem(cert: Certificate, head: Certificate | None, roots: frozenset[str] | None, run_id: str,
                  fingerprint: str, keys: KeyBook, known: Mapping[str, Certificate] | None = None) -> str | None:
    """Why we may not follow ``cert`` (None if we may; module docstring). ``head``: our own certificate (None:
    we hold none); ``roots``: the peer ids of our ``--initial-peers`` (None: we were given none); ``known``:
    certificates read from the swarm, by id, through which ``cert`` may be :func:`linked` to ``head``."""
    s = cert.statement
    if (s.run_id, s.fingerprint) != (run_id, fingerprint):
        return "a certificate of another run or config"
    problem = cert.problem(keys)
    if problem:
        return problem
    if head is None:
        if roots is None or roots & set(s.members):
            return None
        return "signed by none of our initial peers"
    if cert.id == head.id:
        return None
    if s.round <= head.round:
        return f"of round {s.round + 1}, not after ours ({head.round + 1})"
    if check_link(head, cert, keys) is None:
        return None
    if keeps_enough(head.statement.members, s.members) or (known and linked(head, cert, known, keys)):
        return None
    kept = len(set(head.statement.members) & set(s.members))
    return f"signed by {kept} of the {len(head.statement.members)} members of our last certified group (half needed)"


def linked(head: Certificate, cert: Certificate, known: Mapping[str, Certificate], keys: KeyBook) -> bool:
    """True if ``known`` holds the certificates of every round between ``head`` and ``cert``, each following the
    one before by the hand-off rule (:func:`~.certificate.check_link`): then ``cert`` follows ours exactly as if
    we had followed the swarm round by round, whatever the turnover in between. What a peer restarted from an old
    checkpoint needs: after a few rounds of churn none of its group may be left, and the intermediate certificates
    come from the others' ``chain`` blobs (certificate.encode_chain). At most :data:`HISTORY` links."""
    by_prev: dict[str, list[Certificate]] = {}
    for c in known.values():
        if head.round < c.round < cert.round:
            by_prev.setdefault(c.statement.prev, []).append(c)
    frontier, seen, steps = [head], {head.id}, 0
    while frontier and steps < HISTORY:
        steps += 1
        nxt = []
        for prev in frontier:
            if cert.statement.prev == prev.id and check_link(prev, cert, keys) is None:
                return True
            for c in by_prev.get(prev.id, ()):
                if c.id not in seen and check_link(prev, c, keys) is None:
                    seen.add(c.id)
                    nxt.append(c)
        frontier = nxt
    return False


def extension_problem(members, head: Certificate | None, roots: frozenset[str] | None) -> str | None:
    """Why a round certified by ``members`` would not be one we follow (None if it would): the hand-off rule from
    our own certificate ``head``, or (no certificate yet) our trust root. A peer never signs a round that it would
    refuse from any other peer, or a minority cut off from its group (a partition, a freeze across the others'
    commit, the others gone at the end of the run) would commit a state of its own for a round the others
    certified differently (found by benchmarks/protocol_sim.py: tests/sim/test_found_by_simulation.py)."""
    if head is None:
        # (no chain of our own yet: our --initial-peers may be bootstrap nodes that never train, so requiring one of
        # them in the group would stop every swarm that starts through one; a newcomer that starts a chain of its
        # own while the swarm it was meant to join is out of sight remains possible: docs/protocol.md)
        return None
    if keeps_enough(head.statement.members, members):
        return None
    kept = len(set(head.statement.members) & set(members))
    return (f"only {kept} of the {len(head.statement.members)} members of round {head.round + 1}'s certified "
            f"group would sign (half are needed)")


def verified_view(view: View, round_: int, digest: str, history: History, certificates: Mapping[str, Certificate],
                  trust) -> tuple[dict, dict[str, str]]:
    """``(view, dropped)``: the records whose claims we may act on, and why each other one was dropped.

    ``certificates``: complete certificates by id (read from the swarm); ``trust``: ``cert -> problem or None``
    (:func:`trust_problem` with our head and roots). A record of our round and digest, or of an earlier round
    with the digest our chain had then, needs no certificate; any other claim needs a trusted certificate of
    exactly its round and digest, named by its ``head``.
    """
    kept, dropped = {}, {}
    for pid, rec in view.items():
        if rec.round < 0 or (rec.round == round_ and rec.digest == digest) or (not rec.digest and not rec.synced):
            kept[pid] = rec  # (a record with no digest that is not synced claims no state: a newcomer's)
            continue
        if rec.round < round_:
            if history.holds(rec.round, rec.digest):
                kept[pid] = rec
            else:
                dropped[pid] = f"round {rec.round} with a digest our chain did not have"
            continue
        cert = certificates.get(rec.head)
        if cert is None:
            dropped[pid] = f"claims round {rec.round} with no certificate we can read"
            continue
        if cert.round + 1 != rec.round or cert.statement.after != rec.digest:
            dropped[pid] = f"its certificate is not of round {rec.round} with its digest"
            continue
        problem = trust(cert)
        if problem:
            dropped[pid] = f"claims round {rec.round}: {problem}"
            continue
        kept[pid] = rec
    return kept, dropped
