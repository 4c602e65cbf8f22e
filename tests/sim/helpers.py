"""Shared checks of the in-process protocol scenarios (p2p_diloco.testing: real peers, fake swarm, virtual clock)."""

from __future__ import annotations

from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimPeer, SimSwarm


def assert_consistent(swarm: SimSwarm, peers: list[SimPeer] | None = None) -> None:
    """One digest per round among the given peers (from their outer steps and state loads)."""
    per_round = swarm.digests_by_round(peers)
    assert all(len(d) == 1 for d in per_round.values()), per_round


def assert_no_solo_steps(peers: list[SimPeer]) -> None:
    for p in peers:
        lone = p.of(Event.ALLREDUCE_DONE, lone=True)
        assert not lone, f"{p.name} took a solo step while others were alive: {lone}"


def finals(peers: list[SimPeer]) -> dict[str, dict]:
    return {p.name: p.summary() for p in peers}


def one_digest(peers: list[SimPeer]) -> str:
    digests = {s["global_digest"] for s in finals(peers).values()}
    assert len(digests) == 1, digests
    return digests.pop()
