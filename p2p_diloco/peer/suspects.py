"""Fast, honest failure detection: round-mates this peer has found dead by its own probe.

A ``kill -9``ed peer's live record stays in the DHT for up to ``swarm.peer_ttl`` (6 s): until it expires, every
attempt that expects it fails, and a round-mate training waits for it. But the host of a dead process answers a
dial with a refusal at once. So each peer probes the round-mates it would group with (:meth:`SwarmPort.probe
<p2p_diloco.swarm.port.SwarmPort.probe>`) and treats those that refused as gone, as if their records had expired
(:attr:`rules.SyncState.suspects <p2p_diloco.protocol.rules.SyncState>`), and an attempt that expects one of them
is aborted at once. Every member probes on its own, and a dead peer refuses them all alike, so they regroup
together without waiting for the record to expire.

Why this cannot evict an honest peer:

* only a refusal counts: a peer that does not answer in time (frozen, slow, far, behind a slow link) is not a
  suspect; its record's expiry, as before, is what leaves it out;
* only our own observation counts: no peer's claim about another is ever believed, so a liar cannot make us drop
  anyone, and one peer with a broken link to a member (a refusal only it sees) drops it only from its own
  count: the member's group then disagrees with it and the rules' group agreement refuses that group; nothing is
  certified without every member's signature;
* a suspect is no proof of absence for a solo step: with nobody else left, the record-lifetime confirmation of
  :func:`rules._alone <p2p_diloco.protocol.rules.decide_sync>` still applies;
* client-mode peers accept no inbound connection at all: they are never probed.
A suspect is only as old as the last probe (:data:`INTERVAL`), and a refused peer whose record's heartbeat ``t``
advances after the refusal is not one: it is publishing, so it lives (e.g. a probe that dialled an address the
peer's record no longer announces, read just before its new record). The abort of an attempt in flight
(:meth:`Suspects.of` on its members) counts the refusal alone: a member that is in our group was connected to us
through matchmaking, and the probe reports no peer our p2pd is connected to.
"""

from __future__ import annotations

from typing import Callable, Collection

from ..protocol.records import Phase, View

INTERVAL = 0.5  # a probe of the same round-mates at most this often (each syncer look and each 0.1 s abort check)
TIMEOUT = 0.5  # one probe call's dial timeout: a refusal comes in milliseconds; a timeout proves nothing anyway
MAX_PROBED = 64  # round-mates probed per call (a group holds at most 64 members)


class Suspects:
    """The round-mates our own last probe found refused (module docstring).

    Args:
        probe: ``(peer_ids, timeout) -> refused peer ids`` (the swarm port's ``probe``).
        monotonic: the clock.
    """

    def __init__(self, probe: Callable[[Collection[str], float], frozenset[str]], monotonic: Callable[[], float]):
        self.probe, self.monotonic = probe, monotonic
        self.asked: tuple[str, ...] = ()
        self.at = -float("inf")
        self.refused: frozenset[str] = frozenset()
        self.heartbeat: dict[str, float | None] = {}  # refused peer -> its record's ``t`` when first refused

    def of(self, peer_ids: Collection[str]) -> frozenset[str]:
        """The peers among ``peer_ids`` that refused our probe: probed again if the last probe is older than
        :data:`INTERVAL` or did not cover them all."""
        ids = tuple(sorted(set(peer_ids)))[:MAX_PROBED]
        now = self.monotonic()
        if now - self.at >= INTERVAL or not set(ids) <= set(self.asked):
            self.refused = frozenset(self.probe(ids, TIMEOUT)) if ids else frozenset()
            self.asked, self.at = ids, now
        return self.refused & set(ids)

    def in_round(self, view: View, round_: int) -> frozenset[str]:
        """The suspects among the round-mates of ``round_`` a group or a solo step depends on (``train`` or
        ``sync`` in that round), client-mode peers excluded: refused by our probe, and no heartbeat of theirs
        since the first refusal."""
        refused = self.of([pid for pid, p in view.items() if p.round == round_ and not p.client
                           and p.phase in (Phase.TRAIN, Phase.SYNC)])
        self.heartbeat = {pid: self.heartbeat.get(pid, view[pid].t) for pid in refused}
        return frozenset(pid for pid in refused if not _later(view[pid].t, self.heartbeat[pid]))


def _later(t: float | None, than: float | None) -> bool:
    return t is not None and than is not None and t > than
