"""The commit step of every round, carried out: sign the round's statement, exchange the members' signatures
through the swarm (``sig`` blobs), and return the complete certificate, or None if the round did not commit.
:mod:`p2p_diloco.protocol.commit` decides; this part only publishes, reads and waits.

**A statement we signed and gave up on may still complete**: the commit window assumes that a stored signature is
readable within half of it, and on a starved machine it was not (`chaos --quick`, 16 peers on 2 cores, 2026-12-07,
on 3efd27d: b gave up on {a, b}'s certificate of round 1 after 8 s without reading a's signature, while a had read
b's and committed; b then signed {b, c}'s statement of round 1, which committed too: two states for one round).
So before we sign another statement of the same round, we read the one we gave up on once more, with the
certificates the members published since; if it is complete, we sign nothing else (the round is then taken from
its certificate, as any peer behind takes it). This narrows the window from the commit window to the time until our
next group's result; it does not close it (a signature stored later still would be missed)."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ..metrics.events import Event
from ..protocol import commit
from ..protocol.certificate import Certificate, Statement, sign
from .context import PeerContext

log = logging.getLogger("p2p_diloco.peer")
FIRST_POLL = 0.025  # the other members sign within milliseconds of us: look this often for FAST_POLLS reads,
FAST_POLLS = 10  # then less and less often (doubling up to MAX_POLL): a member that is late is late by seconds
MAX_POLL = 0.25


class Certifier:
    """The commit step (module docstring). The commit window is a record lifetime (``swarm.peer_ttl``)."""

    def __init__(self, ctx: PeerContext):
        self.ctx = ctx
        self.window = ctx.cfg.swarm.peer_ttl
        # the last statement we signed and gave up on, with the signatures we held then (ours among them)
        self.gave_up: tuple[Statement, dict[str, tuple[bytes, bytes]]] | None = None

    def statement(self, r: int, after: str, gathered: Mapping[str, Any]) -> Statement:
        ctx = self.ctx
        return commit.statement_for(ctx.cfg.run.run_id, ctx.cfg.fingerprint(), r, ctx.state.digest, after, gathered)

    def certify(self, r: int, statement: Statement, got_result_at: float) -> Certificate | None:
        """Sign ``statement`` (unless we got the result too long ago) and wait for every member's signature."""
        ctx = self.ctx
        signer = ctx.swarm.signer
        if signer is None or not commit.may_sign(got_result_at, ctx.clock.monotonic(), self.window):
            return self._failed(r, statement, "the result came too long ago to sign it safely")
        late = self._completed_late(statement)
        if late is not None:
            return self._failed(r, statement, f"the group we signed for before in this round committed after we "
                                              f"gave up on it (certificate {late.id[:12]}): we sign no other")
        public_key, signature = sign(statement, signer)
        signatures = {signer.peer_id: (public_key, signature)}
        if len(statement.members) > 1:
            try:
                ctx.swarm.put_blob("sig", commit.encode_signature(statement, public_key, signature), ttl=self.window)
            except (TimeoutError, OSError) as e:
                return self._failed(r, statement, f"could not publish our signature: {e!r}")
        deadline, poll, polls = got_result_at + self.window, FIRST_POLL, 0
        verified: frozenset[str] = frozenset()  # members whose signature we hold and checked: never replaced
        while True:
            action = commit.decide_commit(statement, signatures, ctx.swarm.keys, ctx.clock.monotonic(), deadline,
                                          poll, verified)
            if isinstance(action, commit.Commit):  # (the boundary publishes it: ``PeerContext.announce``)
                return action.certificate
            if isinstance(action, commit.Abandon) or ctx.sleep(action.seconds):
                if len(statement.members) > 1:  # (a statement of ours alone cannot complete later)
                    self.gave_up = (statement, dict(signatures))
                return self._failed(r, statement, action.reason if isinstance(action, commit.Abandon) else "stopped")
            verified = frozenset(statement.members) - set(action.missing)
            polls += 1
            poll = FIRST_POLL if polls < FAST_POLLS else min(MAX_POLL, poll * 2)
            read = self._read(statement, certificates=polls >= FAST_POLLS)
            signatures.update((pid, sig) for pid, sig in read.items() if pid not in verified)

    def _completed_late(self, statement: Statement) -> Certificate | None:
        """The complete certificate of the statement of ``statement``'s round that we signed and gave up on, if
        the members' signatures or a published certificate of it can be read now (module docstring)."""
        if self.gave_up is None or self.gave_up[0].round != statement.round or self.gave_up[0] == statement:
            return None
        earlier, signatures = self.gave_up
        read = self._read(earlier, certificates=True)
        action = commit.decide_commit(earlier, {**read, **signatures}, self.ctx.swarm.keys, 0.0, 0.0, 0.0)
        return action.certificate if isinstance(action, commit.Commit) else None

    def _read(self, statement: Statement, certificates: bool) -> dict[str, tuple[bytes, bytes]]:
        """The signatures over ``statement`` in the ``sig`` blobs and, once the fast reads are over (a member is
        late: the others may have committed and published the certificate), in the ``cert`` blobs."""
        swarm = self.ctx.swarm
        try:
            return commit.signatures_for(statement, swarm.get_blobs("sig"),
                                         swarm.get_blobs("cert") if certificates else {})
        except TimeoutError:
            log.warning("DHT did not answer while reading round signatures; retrying")
            return {}

    def _failed(self, r: int, statement: Statement, reason: str) -> None:
        log.warning("round %d: not committed: %s", r + 1, reason)
        self.ctx.emit_in_round(Event.COMMIT_FAILED, r, reason=reason, members=len(statement.members))
        return None
