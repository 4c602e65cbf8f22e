"""The invariant checker of ``benchmarks/protocol_sim.py``: fed every event of every peer as it is emitted (and what the
fake network stores, hides and kills), it says which safety invariant an event breaks. No simulation here: the
runner (:mod:`benchmarks._protocol_sim_run`) feeds it, and the unit tests feed it fabricated events to prove that
it can fail (tests/unit/test_protocol_sim.py).

Times are virtual seconds (``Simulation.now``). Only *honest* peers' events are checked: not a lying donor's, not a
Sybil identity's (they have no events), and a killed peer writes no event after its kill (the recorder drops them).

The invariants (the names are the ``invariant`` of a :class:`Violation`):

``agreement``
    For every round k, the honest peers' ``outer_step`` events of round k carry one digest: no two honest peers
    commit different states for the same round (two certificates of one state are not flagged). One exception, the
    price docs/protocol.md ("The hand-off rule") states for "half": the two sides were cut apart (a ``hide``,
    ``stale`` or ``partition`` fault between a committer or member of one and one of the other, in either direction,
    or a freeze of one of them, at some moment before the later commit) *and* each side's certificate keeps at least
    half of the group of the certificate it builds on (``keeps_enough``; any group for round 1, whose certificate
    builds on theta(0)). A fork by a minority of the previous group, or by a chain that does not build on the
    swarm's, is a violation whatever the faults.
``chain``
    An honest ``state_loaded`` of round k carries a digest that a peer committed for round k (``outer_step``; the
    genesis digest for k = 0) and the certificate of that commit (none for k = 0), and that commit is not a fork
    certified by fewer than half of the group it builds on: no honest peer loads a state outside the certified
    chain.
``solo``
    An honest peer p steps alone (``allreduce_done lone=True``) in round k at time t while another honest peer q is a
    *live round-mate*: for the whole confirmation window [t - (peer_ttl + heartbeat_period), t]

    * the record q keeps in the swarm (``FakeNetwork.stored``, every version seen through the store hook) is
      unexpired and says round k - 1 (theta), phase ``train`` or ``sync``, p's digest, and it was never hidden
      from p or stale for p in the window;
    * q is not killed and not frozen at t;
    * q is not cooling down at p (``Syncer.liveness.cooling(t)``: a peer that failed STRIKES attempts with p is
      left out by design), and if q's record says ``train``, t is before p's round deadline (the start of p's sync,
      its first ``sync`` record of the round, + ``swarm.round_timeout``): after it a training round-mate no longer
      holds a solo step back, by design.

    p reads the records at least once per heartbeat over that window before it may step alone, so each of those
    reads showed q: a solo step then is a bug, not bad luck.
``partial``
    Two parts. (a) Group: an honest peer commits the round of an all-reduce attempt whose certificate leaves out an
    honest peer q that, when the attempt started (``allreduce_start``: p read the records at that very moment), had
    a visible, unexpired ``sync`` record of p's round and digest and was not cooling down at p: the rules counted q,
    so a group without q must have been refused. (b) Members: at the end, every honest member of a committed
    certificate that no fault ever touched (never killed, frozen, hidden, stale, dropped, failed late, slowed,
    held or stopped) committed that certificate itself: nobody who signed is left behind by a timing accident.
    Also: an ``outer_step`` must carry as many signers as its certificate has members.
``poison``
    No honest peer's state (``round_start``, ``outer_step``, ``state_loaded`` digests) equals a poisoned digest: a
    state a lying donor served, or a Sybil claim's.
``crash``
    An honest peer's run raised anything but a :class:`~p2p_diloco.errors.SwarmError` (the runner adds these; a
    ``SwarmError`` is the driver's own one-line stop, e.g. giving up on a round it cannot certify: liveness judges
    it), or the simulation got stuck, or the checker itself failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

INVARIANTS = ("agreement", "chain", "solo", "partial", "poison", "crash")


@dataclass(frozen=True)
class Violation:
    invariant: str
    t: float  # virtual seconds
    peer: str
    detail: str

    def line(self) -> str:
        return f"{self.invariant} at t={self.t:.2f} by {self.peer}: {self.detail}"


@dataclass
class _Commit:
    """One state committed for one round, by honest peers, under one or more certificates."""

    members: set[str] = field(default_factory=set)  # of every certificate of it
    peers: set[str] = field(default_factory=set)  # honest peers that committed it
    certificates: dict[str, tuple[str, ...]] = field(default_factory=dict)  # id -> members
    keeps: bool = True  # every certificate of it keeps half of the group of the certificate it builds on
    cert_peers: dict[str, set[str]] = field(default_factory=dict)  # id -> honest peers that committed it


class Checker:
    """Safety invariants, checked as events come (module docstring).

    Args:
        confirm_for: the confirmation window before a solo step (``swarm.peer_ttl + swarm.heartbeat_period``).
        round_timeout: ``swarm.round_timeout``.
        genesis: the digest of theta(0) (every peer builds it from the config).
        cooling: ``(peer, now) -> peers cooling down at that peer`` (the runner asks the live peer's Syncer);
            default: nobody.
    """

    def __init__(self, confirm_for: float, round_timeout: float, genesis: str,
                 cooling: Callable[[str, float], Iterable[str]] | None = None):
        self.confirm_for, self.round_timeout, self.genesis = confirm_for, round_timeout, genesis
        self.cooling = cooling or (lambda peer, now: ())
        self.violations: list[Violation] = []
        self.dishonest: set[str] = set()
        self.records: dict[str, list[tuple[float, dict, float]]] = {}  # peer -> [(stored at, record, expiration)]
        self.blind: dict[tuple[str, str], list[list[float]]] = {}  # (reader, owner) -> [[from, to)]
        self.frozen: dict[str, list[list[float]]] = {}
        self.killed: dict[str, float] = {}
        self.touched: set[str] = set()  # peers some fault acted on (the members check skips them)
        self.poisoned: dict[str, str] = {}  # digest -> where it came from
        self.commits: dict[int, dict[str, _Commit]] = {}  # round -> digest -> honest commits of it
        self.first_commit: dict[int, float] = {}  # round -> time of its first honest commit
        self.groups: dict[str, tuple[str, ...]] = {}  # certificate id -> its members (every commit seen)
        self.digests: dict[int, set[str]] = {0: {genesis}}  # round -> digests committed by any real peer
        self.attempts: dict[str, tuple[int, str, set[str]]] = {}  # peer -> (round, digest, rounds-mates it must take)
        self.sync_started: dict[tuple[str, int], float] = {}  # (peer, theta round) -> first sync record
        self.left_at: dict[str, float] = {}  # peer -> its "left" record (the end of its run)
        self.events = 0

    # ------------------------------------------------------------------------------------------------ the world
    def store(self, peer: str, now: float, record: dict, expiration: float) -> None:
        self.records.setdefault(peer, []).append((now, dict(record), expiration))
        if record.get("phase") == "sync" and isinstance(record.get("round"), int):
            self.sync_started.setdefault((peer, record["round"]), now)
        if record.get("phase") == "left":
            self.left_at.setdefault(peer, now)

    def hide(self, reader: str, owner: str, now: float) -> None:
        spans = self.blind.setdefault((reader, owner), [])
        if not spans or spans[-1][1] < math.inf:
            spans.append([now, math.inf])
        self.touched.update((reader, owner))

    def unhide(self, reader: str, owner: str, now: float) -> None:
        spans = self.blind.get((reader, owner))
        if spans and spans[-1][1] == math.inf:
            spans[-1][1] = now

    def freeze(self, peer: str, now: float) -> None:
        spans = self.frozen.setdefault(peer, [])
        if not spans or spans[-1][1] < math.inf:
            spans.append([now, math.inf])
        self.touched.add(peer)

    def thaw(self, peer: str, now: float) -> None:
        spans = self.frozen.get(peer)
        if spans and spans[-1][1] == math.inf:
            spans[-1][1] = now

    def kill(self, peer: str, now: float) -> None:
        self.killed.setdefault(peer, now)
        self.touched.add(peer)

    def touch(self, *peers: str) -> None:
        """A fault acted on these peers (drop, fail_late, slow_down, hold, lead, stop)."""
        self.touched.update(peers)

    def dishonest_peer(self, peer: str) -> None:
        self.dishonest.add(peer)

    def poison(self, digest: str, source: str) -> None:
        self.poisoned.setdefault(digest, source)

    def crash(self, peer: str, now: float, detail: str) -> None:
        self._flag("crash", now, peer, detail)

    # ------------------------------------------------------------------------------------------------- queries
    def is_frozen(self, peer: str, t: float) -> bool:
        return any(a <= t < b for a, b in self.frozen.get(peer, ()))

    def alive(self, peer: str, t: float) -> bool:
        return self.killed.get(peer, math.inf) > t

    def blinded(self, reader: str, owner: str, a: float, b: float) -> bool:
        """True if ``reader`` could not read ``owner``'s records at some moment of [a, b]."""
        return any(lo <= b and hi > a for lo, hi in self.blind.get((reader, owner), ()))

    def out_of_reach(self, peer: str, a: float, b: float) -> bool:
        """True if ``peer`` was frozen, or could not read or be read by some peer, at some moment of [a, b]."""
        if any(lo <= b and hi > a for lo, hi in self.frozen.get(peer, ())):
            return True
        return any(peer in pair and any(lo <= b and hi > a for lo, hi in spans) for pair, spans in self.blind.items())

    def cut(self, xs: Iterable[str], ys: Iterable[str], until: float) -> str:
        """How some x and some y were cut apart at some moment before ``until``: one could not read the other, or
        one of them was frozen ("" if they were not)."""
        xs, ys = set(xs), set(ys)
        blind = sorted((x, y) for x in xs for y in ys if x != y
                       and (self.blinded(x, y, -math.inf, until) or self.blinded(y, x, -math.inf, until)))
        if blind:
            return f"reads between {blind[0][0]} and {blind[0][1]} hidden or stale"
        frozen = sorted(p for p in xs | ys if any(lo < until for lo, _ in self.frozen.get(p, ())))
        return f"{frozen[0]} frozen" if frozen else ""

    def keeps(self, members: Iterable[str], prev: str | None) -> bool:
        """True if ``members`` include at least half of the group of certificate ``prev`` (the hand-off rule's
        count), or ``prev`` is theta(0)'s or a certificate nobody was seen to commit."""
        group = self.groups.get(prev or "")
        return group is None or 2 * len(set(group) & set(members)) >= len(set(group))

    def record_at(self, peer: str, t: float) -> dict | None:
        """The record ``peer`` had stored at time ``t`` (None if none, or expired)."""
        current = None
        for at, record, expiration in self.records.get(peer, ()):
            if at > t:
                break
            current = (record, expiration)
        if current is None or current[1] <= t:
            return None
        return current[0]

    def covered(self, peer: str, a: float, b: float, ok: Callable[[dict], bool]) -> bool:
        """True if ``peer``'s stored record satisfied ``ok`` and was unexpired at every moment of [a, b]."""
        history = self.records.get(peer, [])
        start = None
        for i, (at, _, _) in enumerate(history):
            if at <= a:
                start = i
        if start is None:
            return False
        versions = [h for h in history[start:] if h[0] <= b]  # in effect over [a, b], in order (the first at a)
        for i, (_, record, expiration) in enumerate(versions):
            if not ok(record):
                return False
            last = i + 1 == len(versions)
            if (last and expiration <= b) or (not last and expiration < versions[i + 1][0]):
                return False  # it expired before the next version (or before b): a gap
        return True

    # ------------------------------------------------------------------------------------------------- events
    def event(self, peer: str, event: dict[str, Any], now: float, *, members: tuple[str, ...] | None = None,
              digest: str | None = None, certificate: str | None = None, prev: str | None = None) -> None:
        """One event of ``peer`` at virtual time ``now``. ``members``, ``prev``: for ``outer_step``, the
        certificate's members and the id of the certificate it builds on;
        ``digest``: the peer's state digest as the event is emitted (before the step, for ``allreduce_*``);
        ``certificate``: for ``state_loaded``, the id of the certificate that came with the state (None: none)."""
        self.events += 1
        kind, k = str(event["event"]), event["round"]
        if kind == "outer_step":  # a liar commits real states too (it lies only to downloaders)
            self.digests.setdefault(k, set()).add(event["digest"])
            if members:
                self.groups.setdefault(event["certificate"], tuple(members))
        if peer in self.dishonest:
            return
        d = event.get("digest")
        if kind in ("round_start", "outer_step", "state_loaded") and d in self.poisoned:
            self._flag("poison", now, peer, f"{kind} of round {k} holds the poisoned state {d[:12]} "
                                            f"({self.poisoned[d]})")
        if kind == "outer_step":
            self._outer_step(peer, event, now, members or (), prev)
        elif kind == "state_loaded":
            self._loaded(peer, event, now, certificate)
        elif kind == "allreduce_start":
            self._attempt(peer, k - 1, digest, now)
        elif kind == "allreduce_done" and event.get("lone"):
            self._solo(peer, k - 1, digest, now)
        elif kind == "allreduce_done" and event.get("lost") and peer in self.attempts:
            # died mid-transfer, its slice re-reduced by the survivors (swarm/slice_repair.py): out of the group
            r, d, must = self.attempts[peer]
            self.attempts[peer] = (r, d, must - set(event["lost"]))

    def _outer_step(self, peer: str, event: dict, now: float, members: tuple[str, ...], prev: str | None) -> None:
        k, cid, digest = event["round"], event["certificate"], event["digest"]
        if members and event.get("signers") != len(members):
            self._flag("partial", now, peer, f"round {k} committed with {event.get('signers')} signatures for "
                                             f"{len(members)} members")
        by_round = self.commits.setdefault(k, {})
        keeps = self.keeps(members, prev)
        if digest not in by_round:
            ours = set(members) | {peer}
            for other_digest, other in by_round.items():
                cut = self.cut(ours, other.members | other.peers, now)
                if keeps and other.keeps and cut:
                    continue  # two halves of a group, cut apart: the documented price of "half"
                why = "" if keeps else f"; less than half of the group of {(prev or '')[:12]}"
                self._flag("agreement", now, peer,
                           f"round {k}: committed {digest[:12]} (certificate {cid[:12]}, members {sorted(members)}"
                           f"{why}) but {sorted(other.peers)} committed {other_digest[:12]} (members "
                           f"{sorted(other.members)}{'' if other.keeps else '; less than half of its previous group'})"
                           f"; {'cut apart: ' + cut if cut else 'never cut apart'}")
                break
        commit = by_round.setdefault(digest, _Commit())
        commit.keeps = commit.keeps and keeps
        commit.members.update(members)
        commit.peers.add(peer)
        commit.certificates[cid] = tuple(members)
        commit.cert_peers.setdefault(cid, set()).add(peer)
        self.first_commit.setdefault(k, now)
        attempt = self.attempts.pop(peer, None)
        if attempt is not None and attempt[0] == k - 1 and len(members) > 1:
            left_out = sorted(attempt[2] - set(members))
            if left_out:
                self._flag("partial", now, peer, f"round {k}: committed a group {sorted(members)} without "
                                                 f"{left_out}, whose sync records it read when the attempt started")

    def _loaded(self, peer: str, event: dict, now: float, certificate: str | None) -> None:
        k, d = event["round"], event["digest"]
        if d not in self.digests.get(k, set()):
            self._flag("chain", now, peer, f"loaded round {k} with digest {d[:12]} from {event.get('from_peer')}: no "
                                           f"peer committed it")
            return
        if k == 0:
            return
        commit = self.commits.get(k, {}).get(d)
        certified = set(commit.certificates) if commit is not None else set()
        if certificate is None or certificate not in certified:
            self._flag("chain", now, peer, f"loaded round {k} from {event.get('from_peer')} with certificate "
                                           f"{(certificate or 'none')[:12]}, not one a peer committed")
        elif not commit.keeps:
            self._flag("chain", now, peer, f"loaded round {k} from {event.get('from_peer')}: a fork certified by "
                                           f"fewer than half of the group it builds on")

    def _attempt(self, peer: str, r: int, digest: str | None, now: float) -> None:
        cooling = set(self.cooling(peer, now))
        must = set()
        for q in self.records:
            if q == peer or q in self.dishonest or q in cooling or not self.alive(q, now):
                continue
            rec = self.record_at(q, now)
            if (rec is not None and rec.get("round") == r and rec.get("phase") == "sync"
                    and rec.get("digest") == digest and not self.blinded(peer, q, now, now)):
                must.add(q)
        self.attempts[peer] = (r, digest or "", must)

    def _solo(self, peer: str, r: int, digest: str | None, now: float) -> None:
        a = now - self.confirm_for
        cooling = set(self.cooling(peer, now))
        deadline = self.sync_started.get((peer, r), now) + self.round_timeout
        for q in sorted(self.records):
            if q == peer or q in self.dishonest or q in cooling or not self.alive(q, now) or self.is_frozen(q, now):
                continue
            if self.blinded(peer, q, a, now):
                continue

            def mate(rec: dict) -> bool:
                phase = rec.get("phase")
                return (rec.get("round") == r and rec.get("digest") == digest
                        and (phase == "sync" or (phase == "train" and now < deadline)))

            if self.covered(q, a, now, mate):
                self._flag("solo", now, peer, f"stepped alone in round {r + 1} while {q} was a live round-mate "
                                              f"(record of round {r}, same digest, for the whole {self.confirm_for} "
                                              f"s window)")
                return

    def finish(self, now: float, honest_alive: Iterable[str]) -> None:
        """End of the schedule: the members check (module docstring, ``partial`` b)."""
        untouched = set(honest_alive) - self.touched - self.dishonest
        for k, by_round in sorted(self.commits.items()):
            for commit in by_round.values():
                for cid, members in commit.certificates.items():
                    behind = sorted(m for m in members if m in untouched and m not in commit.cert_peers[cid])
                    if behind:
                        self._flag("partial", now, behind[0],
                                   f"round {k}: members {behind} of certificate {cid[:12]} (committed by "
                                   f"{sorted(commit.cert_peers[cid])}) never committed it, and no fault touched "
                                   f"them")

    # -------------------------------------------------------------------------------------------------- inside
    def _flag(self, invariant: str, now: float, peer: str, detail: str) -> None:
        self.violations.append(Violation(invariant, now, peer, detail))
