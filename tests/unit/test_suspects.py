"""peer/suspects.py: which round-mates our own probe found dead, and how often it probes."""

from __future__ import annotations

import pytest

from p2p_diloco.peer.suspects import INTERVAL, Suspects
from p2p_diloco.protocol.records import Phase, PeerRecord

pytestmark = pytest.mark.unit
T, S, J = Phase.TRAIN, Phase.SYNC, Phase.JOIN


class Probe:
    def __init__(self, dead):
        self.dead, self.calls = set(dead), []

    def __call__(self, ids, timeout):
        self.calls.append(tuple(ids))
        return frozenset(self.dead & set(ids))


def test_round_mates_refused_are_suspects_and_the_probe_is_rate_limited():
    probe, now = Probe({"b"}), [0.0]
    sus = Suspects(probe, lambda: now[0])
    view = {"a": PeerRecord(round=3, phase=S, t=1.0), "b": PeerRecord(round=3, phase=T, t=1.0),
            "c": PeerRecord(round=3, phase=S, t=1.0, client=True), "j": PeerRecord(round=3, phase=J, t=1.0),
            "o": PeerRecord(round=2, phase=S, t=1.0)}
    assert sus.in_round(view, 3) == {"b"}
    assert probe.calls == [("a", "b")]  # client-mode, joining and other rounds' peers are not probed
    assert sus.in_round(view, 3) == {"b"} and len(probe.calls) == 1  # within INTERVAL: the last answer
    now[0] += INTERVAL
    probe.dead.clear()
    assert sus.in_round(view, 3) == set() and len(probe.calls) == 2


def test_a_refused_peer_whose_heartbeat_advances_is_not_a_suspect():
    """A peer restarted with its identity on another port: our probe dials its old address (refused), but it
    publishes its record: it lives."""
    now = [0.0]
    sus = Suspects(Probe({"b"}), lambda: now[0])
    assert sus.in_round({"b": PeerRecord(round=3, phase=S, t=10.0)}, 3) == {"b"}
    now[0] += INTERVAL
    assert sus.in_round({"b": PeerRecord(round=3, phase=S, t=10.0)}, 3) == {"b"}  # a dead one's t never moves
    now[0] += INTERVAL
    assert sus.in_round({"b": PeerRecord(round=3, phase=S, t=11.0)}, 3) == set()


def test_members_outside_the_last_probe_are_probed_at_once():
    probe, now = Probe({"x"}), [0.0]
    sus = Suspects(probe, lambda: now[0])
    assert sus.of(["a"]) == set()
    assert sus.of(["a", "x"]) == {"x"} and len(probe.calls) == 2
    assert sus.of([]) == set()
