"""Our certified chain, and what it lets us believe of the others' records (:mod:`p2p_diloco.protocol.trust`).

Every view of the swarm the rules decide from goes through :meth:`Chain.verified`: a record that claims a state
we cannot tie to a certificate we trust is left out (and logged once), so it moves nobody: no catch-up, no
repair, no ``swarm_target`` progress, no run-end stop. The certificates come from the swarm's ``cert`` blobs
(each peer keeps its head certificate there); they are read only when a record claims a state we do not know.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from ..protocol.certificate import CHAIN_LENGTH, Certificate, decode_chain, encode_chain
from ..protocol.records import View
from ..protocol.trust import History, extension_problem, initial_peer_ids, trust_problem, verified_view
from .context import PeerContext

log = logging.getLogger("p2p_diloco.peer")
CACHE = 256  # parsed certificates kept, by id
CHAIN_READ_EVERY = 2.0  # seconds between reads of the others' ``chain`` blobs while a record is left out


class Chain:
    """Verifies the others' records against certificates (module docstring)."""

    def __init__(self, ctx: PeerContext):
        self.ctx = ctx
        self.history = History()
        self.roots = initial_peer_ids(ctx.cfg.swarm.initial_peers)
        self.cache: OrderedDict[str, Certificate] = OrderedDict()
        self.dropped: dict[str, str] = {}  # peer id -> why its record was left out (logged when it changes)
        self.unverified: dict[str, int] = {}  # peer id -> the round its left-out record claims
        self.former_ids: set[str] = set()  # our own peer ids before a restart (a checkpoint names who wrote it)
        self.mine: list[Certificate] = []  # our chain, oldest first, head last (published: _publish_mine)
        self.chains_read_at = -float("inf")

    def trust(self, cert: Certificate) -> str | None:
        """Why we may not follow ``cert`` (None if we may): :func:`~p2p_diloco.protocol.trust.trust_problem`."""
        return self.trust_from(cert, self.ctx.state.certificate)

    def extension_problem(self, members) -> str | None:
        """Why a round certified by ``members`` would not follow our chain: we never sign one
        (:func:`~p2p_diloco.protocol.trust.extension_problem`)."""
        ours = set(members) | (self.former_ids if self.ctx.swarm.peer_id in members else set())
        return extension_problem(ours, self.ctx.state.certificate, self.roots)

    def head_members(self) -> tuple[str, ...] | None:
        """The members of the certificate of our state (None: we hold none), our former peer ids (a restart with a
        new identity) counted as our current one, as :meth:`extension_problem` counts them."""
        cert = self.ctx.state.certificate
        if cert is None:
            return None
        me = self.ctx.swarm.peer_id or ""
        return tuple(sorted({me if pid in self.former_ids else pid for pid in cert.statement.members}))

    def trust_from(self, cert: Certificate, head: Certificate | None) -> str | None:
        """:meth:`trust` as it was when our certificate was ``head``."""
        ctx = self.ctx
        return trust_problem(cert, head, self.roots, ctx.cfg.run.run_id, ctx.cfg.fingerprint(), ctx.swarm.keys,
                             self.cache)

    def verified(self, view: View) -> dict:
        """The records of ``view`` whose claims we may act on."""
        state = self.ctx.state
        self.history.add(state.round, state.digest)
        self._publish_mine()
        known = all(r.round < 0 or self.history.holds(r.round, r.digest) or (not r.digest and not r.synced)
                    for r in view.values())
        certificates = {} if known else self._certificates()
        kept, dropped = verified_view(view, state.round, state.digest, self.history, certificates, self.trust)
        now = self.ctx.clock.monotonic()
        ahead = any(view[pid].round > state.round for pid in dropped)
        if ahead and state.certificate is not None and now - self.chains_read_at >= CHAIN_READ_EVERY:
            # the intermediate certificates may tie the records we left out to our chain (trust.linked)
            self.chains_read_at = now
            if self._read_chains():
                kept, dropped = verified_view(view, state.round, state.digest, self.history, dict(self.cache),
                                              self.trust)
        for pid, why in dropped.items():
            if self.dropped.get(pid) != why:
                log.warning("not following the record of peer %s: %s", pid, why)
        self.dropped = dropped
        self.unverified = {pid: view[pid].round for pid in dropped}
        return kept

    def certify_download(self, head: Certificate | None) -> None:
        """A state downloaded without a certificate (a sharded donation): take the certificate we read for exactly
        that state, if we trusted it from ``head`` (our certificate before the download), so that our chain goes
        on from it."""
        state = self.ctx.state
        if state.certificate is not None and state.certificate.statement.after == state.digest:
            return
        for cert in reversed(self.cache.values()):
            if cert.statement.after == state.digest and self.trust_from(cert, head) is None and state.adopt(cert):
                return

    def _publish_mine(self) -> None:
        """Keep our chain before its head in the swarm (the ``chain`` blob), for peers that fell behind it."""
        head = self.ctx.state.certificate
        if head is None or (self.mine and self.mine[-1].id == head.id):
            return
        linked = self.mine and head.statement.prev == self.mine[-1].id
        self.mine = [*self.mine, head][-CHAIN_LENGTH - 1:] if linked else [head]
        if len(self.mine) > 1:
            try:
                self.ctx.swarm.keep_blob("chain", encode_chain(self.mine[:-1]))
            except TimeoutError:
                log.warning("DHT did not answer while storing our chain")

    def _read_chains(self) -> bool:
        """Add the certificates of the others' ``chain`` blobs to the cache; True if any was new."""
        try:
            blobs = self.ctx.swarm.get_blobs("chain")
        except TimeoutError:
            return False
        new = False
        for raw in blobs.values():
            try:
                certs = decode_chain(raw)
            except ValueError:
                continue
            for cert in certs:
                new |= cert.id not in self.cache
                self.cache[cert.id] = cert
                self.cache.move_to_end(cert.id)
        while len(self.cache) > CACHE:
            self.cache.popitem(last=False)
        return new

    def _certificates(self) -> dict[str, Certificate]:
        """The complete certificates peers keep in the swarm, by id (malformed ones are skipped)."""
        try:
            blobs = self.ctx.swarm.get_blobs("cert")
        except TimeoutError:
            log.warning("DHT did not answer while reading certificates")
            return dict(self.cache)
        for raw in blobs.values():
            try:
                cert = Certificate.from_bytes(raw)
            except ValueError:
                continue
            self.cache[cert.id] = cert
            self.cache.move_to_end(cert.id)
        while len(self.cache) > CACHE:
            self.cache.popitem(last=False)
        return dict(self.cache)
