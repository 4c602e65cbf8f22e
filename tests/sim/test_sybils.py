"""Records that claim a round without a certificate the reader can trust move nobody (issue 17, point 1, and the
``swarm_target`` and max-rounds variants of points 1 and 9)."""

from __future__ import annotations

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.outer import optimizer as opt
from p2p_diloco.protocol.certificate import Certificate, Statement, sign
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import one_digest

pytestmark = pytest.mark.sim
YEAR = 365 * 86400.0
ROUNDS = 6


def _plant_sybils(swarm: SimSwarm, victim, claimed_round: int, serve: bool) -> str:
    """Two free identities claim ``claimed_round`` with the digest of a poisoned, self-consistent state and a
    certificate both of them signed; their records and certificates never expire (as if a DHT node had taken a
    one-year expiration: the real DHT's cap is tested in tests/swarm/test_records.py). The first one serves the
    poisoned state to anyone who asks (``serve``)."""
    cfg, net, now = victim.cfg, swarm.net, swarm.sim.clock.monotonic()
    poisoned = [t.clone() + 1.0 for t in victim.state.optimizer.state_tensors()]
    digest = opt.digest(poisoned)
    members = ("sybil1", "sybil2")
    statement = Statement(run_id=cfg.run.run_id, fingerprint=cfg.fingerprint(), round=claimed_round - 1,
                          members=members, weights=(1.0, 1.0), before="0" * 64, after=digest, prev="1" * 64)
    cert = Certificate(statement, {m: sign(statement, net.keys.signer(m)) for m in members})
    for m in members:
        record = {"fp": cfg.fingerprint(), "round": claimed_round, "phase": "train", "digest": digest,
                  "head": cert.id, "ready": True, "t": swarm.sim.clock.time()}
        net.stored[m] = (record, now + YEAR)
        net.blobs["cert"][m] = (cert.to_bytes(), now + YEAR)
    if serve:
        meta = {"round": claimed_round, "digest": digest, "fp": cfg.fingerprint(), "peer_id": members[0],
                "certificate": cert.to_json()}
        donor = net.factory(members[0])(cfg, victim.state.tensors_like(), lambda *shard: (meta, poisoned))
        donor.peer_id = members[0]
    return digest


@pytest.mark.parametrize("claim, serve", [(5, True), (1000, True), (5, False)],
                         ids=["ahead-served", "past-max-rounds", "nobody-serves"])
def test_two_free_identities_do_not_move_honest_peers(claim, serve):
    """Before certificates, an honest peer loaded the poisoned state (``state_loaded from_peer=sybil1``), stopped
    (a claim past ``max_rounds``), or kept trying to catch up with a round nobody served (the swarm stalled)."""
    with SimSwarm([f"run.max_rounds={ROUNDS}", "swarm.min_peers=2"]) as swarm:
        a, b = swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=2)) and bool(b.of(Event.OUTER_STEP, round=2)))
        poisoned = _plant_sybils(swarm, a, a.state.round + claim, serve)
        swarm.finish([a, b], max_time=900)
        for p in (a, b):
            assert not [e for e in p.of(Event.STATE_LOADED) if e["from_peer"].startswith("sybil")], p.events
            assert p.summary()["rounds_completed"] == ROUNDS and not p.summary()["stopped_early"]
        assert one_digest([a, b]) != poisoned


def test_a_newcomer_trusts_the_chain_its_initial_peers_serve():
    """A newcomer given an honest initial peer takes the honest chain, not the Sybils' (the trust root)."""
    with SimSwarm([f"run.max_rounds={ROUNDS}", "swarm.min_peers=2"]) as swarm:
        a, b = swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=2)))
        poisoned = _plant_sybils(swarm, a, a.state.round + 2, serve=True)
        late = swarm.add(sets=[f"swarm.initial_peers=['/sim/{a.name}/p2p/{a.name}']"])
        swarm.finish([a, b, late], max_time=900)
        loaded = late.of(Event.STATE_LOADED)
        assert loaded and all(not e["from_peer"].startswith("sybil") for e in loaded), late.events
        assert one_digest([a, b, late]) != poisoned


def test_a_record_in_a_later_round_does_not_end_swarm_target_rounds():
    """Issue 17, point 9: under ``swarm_target`` any record in a later round counted as "someone stopped", so one
    liar (or a stale peer) ended every round after a single inner step. An uncertified claim now counts for
    nothing: every round still trains the swarm's target."""
    h = 40
    with SimSwarm(["round.mode=swarm_target", f"train.inner_steps={h}", f"run.max_rounds={ROUNDS}",
                   "swarm.min_peers=2"]) as swarm:
        a, b = swarm.add(), swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.OUTER_STEP, round=2)) and bool(b.of(Event.OUTER_STEP, round=2)))
        _plant_sybils(swarm, a, a.state.round + 1, serve=False)
        swarm.finish([a, b], max_time=900)
        for p in (a, b):
            steps = {e["round"]: e["inner_steps"] for e in p.of(Event.INNER_DONE)}
            assert all(steps[r] >= h // 2 for r in range(4, ROUNDS + 1)), steps
