"""``swarm.allowed_peers``: the peers of a private run.

A private run still uses an ordinary DHT (anyone who knows a multiaddr can join the DHT itself), so privacy is
enforced where it matters, on every allowed peer, by peer id. A peer id is the hash of the peer's RSA key
(identity.py), which libp2p proves on every connection, so it cannot be claimed by someone without the key:

* matchmaking: we neither accept a stranger into a group we lead nor join a group a stranger leads, and we refuse
  any assembled group that contains a stranger (exact_averager.py);
* state: a stranger cannot download our state, and we never take a stranger as a donor;
* records: a stranger's live record is ignored, so it is never waited for, counted in a vote, or a round-mate.

Entries are base58 peer ids or files holding them (one per line, ``#`` starts a comment), so an operator can keep
one file of the run's members, made with ``p2p-diloco join --identity-path`` keys (docs/security.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import multihash
from hivemind.p2p import PeerID

from ..errors import SwarmError


def _ids_in(entry: str) -> list[str]:
    path = Path(entry)
    if not path.is_file():
        return [entry]
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SwarmError(f"cannot read swarm.allowed_peers file {entry}: {e}") from None
    return [word for line in lines for word in line.split("#", 1)[0].split()]


def resolve_allowed_peers(entries: Iterable[str]) -> frozenset[str] | None:
    """The set of allowed base58 peer ids, or None for an open run (no entries).

    Raises:
        SwarmError: an entry that is neither a readable file nor a valid peer id, or files that list nobody.
    """
    entries = [e.strip() for e in entries if e.strip()]
    if not entries:
        return None
    allowed = set()
    for entry in entries:
        for word in _ids_in(entry):
            try:
                multihash.decode(PeerID.from_base58(word).to_bytes())  # a peer id is a multihash
                allowed.add(word)
            except Exception:
                raise SwarmError(f"swarm.allowed_peers: {word!r} is neither a file nor a peer id") from None
    if not allowed:
        raise SwarmError("swarm.allowed_peers lists no peer id (a private run of nobody)")
    return frozenset(allowed)
