"""Expiration and size limits of the run's DHT records (RecordLimitsValidator in p2p_diloco/swarm/schema.py), the
schema of the sig/cert blobs, and the blobs of the in-memory swarm (p2p_diloco/testing/fake_swarm.py)."""

import dataclasses
import pickle

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p_diloco.config import Config
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.port import BLOB_MAX_BYTES, check_blob
from p2p_diloco.swarm.schema import (LIFETIMES, MAX_VALUE_BYTES, TTL_SLACK_S, RecordLimitsValidator,
                                     RunRecordsValidator, record_lifetime, ttl_cap)
from p2p_diloco.swarm.swarm import record_validators
from p2p_diloco.testing.fake_swarm import FakeNetwork
from p2p_diloco.testing.sim import Killed, Simulation

pytestmark = pytest.mark.unit

PEER_TTL = 6.0
SUBKEY = b"QmPeer[owner:ssh-rsa AAAA]"
YEAR = 365 * 24 * 3600.0


def _record(key, value, lifetime, subkey=SUBKEY):
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), get_dht_time() + lifetime)


def test_normal_records_pass_and_other_keys_are_not_limited():
    v = RecordLimitsValidator("run", PEER_TTL)
    assert v.validate(_record("run.live", {"round": 3}, PEER_TTL))
    assert v.validate(_record("run.live", {"round": 3}, 1.0))  # a "left" record
    assert v.validate(_record("run.config", Config().fingerprint_fields(), 5 * PEER_TTL))
    assert v.validate(_record("run.sig", b"s" * BLOB_MAX_BYTES["sig"], PEER_TTL))
    assert v.validate(_record("run.cert", b"c" * BLOB_MAX_BYTES["cert"], PEER_TTL))
    assert v.validate(_record("run.live", {"round": 3}, -1.0))  # expired: hivemind's storage drops it anyway
    assert v.validate(_record("other.live", {"round": 3}, YEAR))  # another run, or hivemind's own keys
    assert v.validate(_record("run.averager", b"x" * 10**6, YEAR))


@pytest.mark.parametrize("name", list(LIFETIMES))
def test_expirations_beyond_the_cap_are_refused(name):
    v = RecordLimitsValidator("run", PEER_TTL)
    value = {"round": 3} if name in ("live", "config") else b"x"
    cap = LIFETIMES[name] * ttl_cap(PEER_TTL)
    assert v.validate(_record(f"run.{name}", value, cap - 0.5))
    assert not v.validate(_record(f"run.{name}", value, cap + 0.5))
    assert not v.validate(_record(f"run.{name}", value, YEAR))


@pytest.mark.parametrize("intervals, lifetime", [
    ([], 6.0),  # no heartbeat yet: peer_ttl
    ([1.0, 1.1, 1.05], 6.0),  # on time
    ([1.0, 3.0], 6.0),  # half of peer_ttl apart: still peer_ttl
    ([1.0, 4.0, 1.0], 8.0),  # the slowest of the window counts
    ([7.0], 9.0),  # capped at 1.5 x peer_ttl
    ([60.0], 9.0),
])
def test_a_live_record_lives_longer_when_our_heartbeats_are_late(intervals, lifetime):
    """Swarm.publish: a starved host's record outlives two of its slowest recent heartbeat intervals (16 peers on 2
    cores: records up to 13.7 s old with a 1 s heartbeat), never beyond what every DHT node of the run accepts with
    the clock-skew slack left whole."""
    assert record_lifetime(PEER_TTL, intervals) == lifetime
    v = RecordLimitsValidator("run", PEER_TTL)
    assert v.validate(_record("run.live", {"round": 3}, lifetime + TTL_SLACK_S - 0.5))  # a skewed node's view


@pytest.mark.parametrize("name", list(LIFETIMES))
def test_oversized_values_are_refused(name):
    v = RecordLimitsValidator("run", PEER_TTL)
    key = DHTID.generate(source=f"run.{name}").to_bytes()
    limit = MAX_VALUE_BYTES[name]
    ok = DHTRecord(key, MSGPackSerializer.dumps(SUBKEY), b"x" * limit, get_dht_time() + 1.0)
    assert v.validate(ok)
    assert not v.validate(dataclasses.replace(ok, value=b"x" * (limit + 1)))


def test_limits_survive_pickling_and_merge_per_run():
    v = pickle.loads(pickle.dumps(RecordLimitsValidator("run", PEER_TTL)))
    assert not v.validate(_record("run.live", {"round": 3}, YEAR))
    assert v.merge_with(RecordLimitsValidator("other", 100.0))
    assert not v.validate(_record("other.live", {"round": 3}, YEAR))
    assert v.validate(_record("other.live", {"round": 3}, 100.0))  # the other run's own peer_ttl
    assert not v.validate(_record("run.live", {"round": 3}, 100.0))


def test_the_whole_chain_signs_and_refuses_long_lived_or_oversized_records():
    """Through hivemind's CompositeValidator, as a DHT node applies it: the limits run first (priority 20, on the
    signed value), then the signature (10), then the owner and schema checks on the stripped value."""
    ident = Identity()
    try:
        chain = CompositeValidator(record_validators(ident, "run", PEER_TTL))
        assert [type(v).__name__ for v in reversed(chain._validators)][:2] == ["RecordLimitsValidator",
                                                                               "RSASignatureValidator"]

        def signed(key, value, lifetime):
            record = _record(key, value, lifetime, subkey=ident.subkey())
            return dataclasses.replace(record, value=chain.sign_value(record))

        for key, value in (("run.live", {"round": 3}), ("run.sig", b"s" * 700), ("run.cert", b"c" * 64 * 700),
                           ("run.sig", b"s" * BLOB_MAX_BYTES["sig"]), ("run.cert", b"c" * BLOB_MAX_BYTES["cert"])):
            ok = signed(key, value, PEER_TTL)
            assert chain.validate(ok), key
            assert MSGPackSerializer.loads(chain.strip_value(ok)) == value
            assert not chain.validate(signed(key, value, YEAR)), key
        # one byte more than a blob may hold: the schema refuses it (and a much larger one the size limit)
        assert not chain.validate(signed("run.sig", b"s" * (BLOB_MAX_BYTES["sig"] + 1), PEER_TTL))
        assert not chain.validate(signed("run.cert", b"c" * (BLOB_MAX_BYTES["cert"] + 1), PEER_TTL))
        assert not chain.validate(signed("run.sig", b"s" * MAX_VALUE_BYTES["sig"], PEER_TTL))
        # a blob that is not bytes, or an unsigned one
        assert not chain.validate(signed("run.sig", "text", PEER_TTL))
        assert not chain.validate(_record("run.sig", b"s", PEER_TTL, subkey=ident.subkey()))
        assert not chain.validate(_record("run.sig", b"s", PEER_TTL, subkey=ident.peer_id.encode()))
    finally:
        ident.close()


def test_blob_schema():
    v = RunRecordsValidator("run")
    for name, limit in BLOB_MAX_BYTES.items():
        assert v.validate(_record(f"run.{name}", b"", 1.0))
        assert v.validate(_record(f"run.{name}", b"x" * limit, 1.0))
        assert not v.validate(_record(f"run.{name}", b"x" * (limit + 1), 1.0))
        assert not v.validate(_record(f"run.{name}", "x", 1.0))
        assert not v.validate(_record(f"run.{name}", {"round": 1}, 1.0))


def test_check_blob():
    assert check_blob("sig", b"x", None, PEER_TTL) == PEER_TTL
    assert check_blob("cert", b"x" * BLOB_MAX_BYTES["cert"], 2.0, PEER_TTL) == 2.0
    for args in (("live", b"x", None), ("sig", "x", None), ("sig", b"x" * (BLOB_MAX_BYTES["sig"] + 1), None),
                 ("sig", b"x", PEER_TTL + 1), ("sig", b"x", -1.0)):
        with pytest.raises(ValueError):
            check_blob(*args, PEER_TTL)


def test_fake_swarm_blobs_are_shared_expire_and_keep_the_latest_expiration():
    cfg = Config()
    cfg.swarm.peer_ttl = PEER_TTL
    seen = {}
    with Simulation() as sim:
        net = FakeNetwork(sim)
        a, b = (net.factory(name)(cfg, [], lambda: ({}, [])) for name in ("a", "b"))
        clock = sim.clock

        def scenario():
            a.put_blob("sig", b"a1")
            b.put_blob("sig", b"b1", ttl=2.0)
            b.put_blob("cert", b"c" * BLOB_MAX_BYTES["cert"])
            seen["start"] = a.get_blobs("sig"), b.get_blobs("sig"), a.get_blobs("cert")
            clock.sleep(3.0)
            seen["b1 expired"] = a.get_blobs("sig")
            a.put_blob("sig", b"a2")  # expires later than a1: replaces it
            a.put_blob("sig", b"a3", ttl=1.0)  # expires earlier than a2: a DHT node keeps a2
            seen["latest expiration"] = b.get_blobs("sig")
            net.hide("b", "a")
            seen["hidden"] = b.get_blobs("sig"), a.get_blobs("sig")
            net.hidden.clear()
            for bad in (lambda: a.put_blob("live", b"x"), lambda: a.put_blob("sig", b"x" * 5000),
                        lambda: a.put_blob("sig", b"x", ttl=PEER_TTL * 2), lambda: a.get_blobs("config")):
                with pytest.raises(ValueError):
                    bad()
            net.kill("a")
            with pytest.raises(Killed):
                a.put_blob("sig", b"a4")
            seen["killed"] = b.get_blobs("sig")  # a's last blob outlives it until it expires
            clock.sleep(PEER_TTL)
            seen["end"] = b.get_blobs("sig"), b.get_blobs("cert")

        sim.spawn(scenario, "scenario")
        sim.run(until=lambda: "end" in seen, max_time=60.0)
    assert seen["start"] == ({"a": b"a1", "b": b"b1"}, {"a": b"a1", "b": b"b1"},
                             {"b": b"c" * BLOB_MAX_BYTES["cert"]})
    assert seen["b1 expired"] == {"a": b"a1"}
    assert seen["latest expiration"] == {"a": b"a2"}
    assert seen["hidden"] == ({}, {"a": b"a2"})
    assert seen["killed"] == {"a": b"a2"}
    assert seen["end"] == ({}, {})
