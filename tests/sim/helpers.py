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


def certificates(peer: SimPeer) -> dict[int, str]:
    """``{round: certificate id}`` of the peer's committed rounds (``outer_step`` events)."""
    return {e["round"]: e["certificate"] for e in peer.of(Event.OUTER_STEP)}


def assert_every_round_certified_alike(peers: list[SimPeer], rounds: int) -> None:
    """Every peer committed rounds 1..``rounds`` itself (no catch-up, no state loaded), with the same certificates,
    and ends with one digest."""
    for p in peers:
        assert sorted(certificates(p)) == list(range(1, rounds + 1)), p.events
        assert not p.of(Event.STATE_LOADED), p.events
    assert all(certificates(p) == certificates(peers[0]) for p in peers[1:])
    one_digest(peers)


def forks(peers) -> dict[int, set[str]]:
    """Rounds that honest peers committed (``outer_step``) with more than one state."""
    states: dict[int, set[str]] = {}
    for p in peers:
        for e in p.of(Event.OUTER_STEP):
            states.setdefault(e["round"], set()).add(e["digest"])
    return {k: d for k, d in states.items() if len(d) > 1}


def roots(*peers: str) -> str:
    """The setting that gives a simulated peer ``peers`` as its ``--initial-peers``."""
    return f"swarm.initial_peers={[f'/sim/{p}/p2p/{p}' for p in peers]!r}"
