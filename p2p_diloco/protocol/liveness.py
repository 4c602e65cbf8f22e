"""Bounded liveness: a live peer whose all-reduces keep failing is left out of group sizing for a while.

A group is *every* live peer of the round (rules.decide_sync), so one live peer that can never complete an
all-reduce (firewalled without ``--client-mode``, broken, malicious) would make every attempt of every round fail, and
its record alone says nothing is wrong. :class:`Liveness` is what each peer remembers of its own attempts: per peer id,
how many attempts in a row it was charged with (it was expected in them, and they failed), and when it was last in a
successful group with us. A peer charged :data:`STRIKES` times in a row *cools down*: :func:`rules.decide_sync`
leaves it out of the group size, of the round-mates it waits for, of the records that hold back a solo step and of
the peers it follows ahead, until the cool-down ends. A successful group with it clears everything.

Whom a failure is charged to. An attempt tells the driver only that it failed, not whose part went missing, and a
failed group fails for every member alike, the broken one included: every member would blame every other one. So:

* an attempt that still expected round-mates in their inner steps is charged to nobody (they may simply not have
  arrived in time: :attr:`AllReduce.charged <p2p_diloco.protocol.actions.AllReduce.charged>`);
* if the caller knows whom the failure names (``suspects``: the member whose parts went missing, from the
  transport's error), only those members are charged, and that singles them out;
* otherwise the members least recently proven are charged: those that have not been in a successful group with us
  since the others were (never, for a newcomer). A peer that averaged with us a round ago and a newcomer that has
  failed every attempt since it arrived are not equally likely to be at fault, and a firewall or a broken setup
  usually comes with a newcomer. If that leaves out some members, the charged ones are singled out.

A peer singled out cools down at its ``STRIKES``-th failure in a row. When nothing singles anyone out (every member
expected is equally proven: a peer that broke after averaging with us, a pair of peers, or a network outage that fails
every group for everyone), the failures say nothing about who is at fault, and cooling everyone down would make every
peer step alone: a fork of theta on every peer. Then the members cool down only once their failures in a row have
lasted ``patience`` (the driver passes ``swarm.round_timeout``: the bound on any wait for one round). Until then
the attempts are retried, as they were before liveness was bounded; an outage shorter than that costs nothing. A
transport error naming the culprit (``suspects``) ends such a stall after ``STRIKES`` attempts.

The numbers:

* :data:`STRIKES` = 3. A peer that dies mid all-reduce costs its round-mates at most two failed attempts in which it
  was expected: the one it died in, and one retry while its record is still live (a record expires ``swarm.peer_ttl``,
  6 s, after the last heartbeat; a retry looks for a group for up to 2 x the matchmaking window, 16 s), so 3 never
  cools a peer down for dying or for a one-off hiccup, and a live peer singled out costs at most 3 failed attempts.
* cool-down: ``cool_down`` seconds (the driver passes ``swarm.round_timeout``, 600 s), doubled for every further
  cool-down before the peer is next in a successful group with us, up to ``2 ** MAX_DOUBLINGS`` times. A peer coming
  back from a cool-down is on probation: its count is not reset, so its next failure charged to it cools it down again
  at once. A peer broken for good therefore costs 3 failed attempts, then one per cool-down, each twice as far apart;
  a peer cooled down wrongly is left out of our groups for one cool-down: it follows the swarm meanwhile (it still
  sees our records, votes on digests and downloads state), only its pseudo-gradients are lost.

Pure Python: no clock of its own (``now`` is passed in, ``Clock.monotonic()``), no network. Memory: one small entry per
peer id ever expected in one of our groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

STRIKES = 3  # failed attempts in a row charged to a peer before it cools down (module docstring)
MAX_DOUBLINGS = 4  # a cool-down is at most 16 x the first one


@dataclass
class PeerLiveness:
    """What we know of one peer's attempts with us."""

    streak: int = 0  # failed attempts in a row charged to it (not reset by a cool-down: probation)
    since: float = math.inf  # ``now`` of the first of them
    proven: float = -math.inf  # ``now`` of the last successful group it was in with us
    cooling_until: float = -math.inf
    cool_downs: int = 0  # cool-downs since it was last in a successful group with us


class Liveness:
    """Per peer id: failed attempts in a row, the last successful group, and cool-downs (module docstring).

    Args:
        cool_down: seconds of the first cool-down (then doubled, up to ``2 ** MAX_DOUBLINGS`` times).
        strikes: failed attempts in a row, each charged to a peer, after which that peer cools down.
        patience: how long failures in a row that single nobody out must last before they cool a peer down
            (default: ``cool_down``).
    """

    def __init__(self, cool_down: float, strikes: int = STRIKES, patience: float | None = None):
        patience = cool_down if patience is None else patience
        if strikes < 1 or cool_down <= 0 or patience < 0:
            raise ValueError(f"need strikes >= 1, cool_down > 0 and patience >= 0, got {strikes}, {cool_down} and "
                             f"{patience}")
        self.cool_down, self.strikes, self.patience = float(cool_down), strikes, float(patience)
        self.peers: dict[str, PeerLiveness] = {}

    def _of(self, pid: str) -> PeerLiveness:
        return self.peers.setdefault(pid, PeerLiveness())

    def failed(self, members: Iterable[str], now: float, suspects: Iterable[str] | None = None) -> list[str]:
        """An attempt that expected ``members`` (round-mates, us excluded) failed. Charge it (module docstring) and
        return the peers that start a cool-down now, sorted.

        Args:
            members: the round-mates the attempt expected (empty: charge nobody).
            now: ``Clock.monotonic()``.
            suspects: the members the failure names, if the transport said whose part went missing; None: unknown.
        """
        members = sorted(set(members))
        named = sorted(set(suspects or ()) & set(members))
        if named:
            charged = named
        elif members:
            least = min(self._of(m).proven for m in members)
            charged = [m for m in members if self._of(m).proven == least]
        else:
            return []
        singled = bool(named) or len(charged) < len(members)
        started = []
        for pid in charged:
            peer = self._of(pid)
            if peer.streak == 0:
                peer.since = now
            peer.streak += 1
            due = singled or now - peer.since >= self.patience
            if peer.streak >= self.strikes and due and peer.cooling_until <= now:
                peer.cooling_until = now + self.cool_down * 2 ** min(peer.cool_downs, MAX_DOUBLINGS)
                peer.cool_downs += 1
                started.append(pid)
        return started

    def succeeded(self, members: Iterable[str], now: float) -> None:
        """An all-reduce with ``members`` (round-mates, us excluded) succeeded: they are live and well."""
        for pid in members:
            self.peers[pid] = PeerLiveness(proven=now)

    def cooling(self, now: float) -> frozenset[str]:
        """The peers cooling down at ``now``: left out of group sizing (rules.decide_sync)."""
        return frozenset(pid for pid, p in self.peers.items() if p.cooling_until > now)
