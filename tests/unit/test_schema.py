"""Schemas of the run's DHT records (p2p_diloco/swarm/schema.py), without a network."""

import math
import pickle

import pydantic.v1 as pydantic
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from p2p_diloco.config import Config
from p2p_diloco.errors import SwarmError
from p2p_diloco.swarm.schema import LiveRecord, RunRecordsValidator, check_config_record, normalize_record

pytestmark = pytest.mark.unit

FULL = {"fp": "0123456789abcdef", "round": 3, "phase": "train", "client": False, "t": 1700000000.25, "ready": True,
        "digest": "ab" * 32, "inner_step": 7, "tokens": 4096, "round_tokens": 1024, "step_tokens": 128,
        "tokens_per_s": 2048.5, "eval_loss": 3.25, "last_sync": 1699999990.5, "shard_peers": ["QmA", "QmB"]}
BAD = [{"t": 1}, {"round": "3"}, {"round": True}, {"phase": "resting"}, {"color": "red"}, {"round": -1},
       {"t": None}, {"digest": "not hex"}, {"fp": "abc"}, {"tokens_per_s": -1.0}, {"shard_peers": [1]}]
SUBKEY = b"QmPeer[owner:ssh-rsa AAAA]"


def _record(key, subkey, value):
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), 0.0)


def test_live_record_accepts_a_full_record_and_a_partial_one():
    assert LiveRecord.parse_obj(FULL).dict() == FULL
    assert LiveRecord.parse_obj({"round": 0}).dict() == {"round": 0}  # what is left out stays out


@pytest.mark.parametrize("bad", BAD, ids=str)
def test_live_record_rejects_wrong_types_values_and_fields(bad):
    with pytest.raises(pydantic.ValidationError):
        LiveRecord.parse_obj(bad)


def test_normalize_record_converts_ints_drops_nan_and_none():
    out = normalize_record({"round": 2, "tokens_per_s": 0, "t": 5, "eval_loss": float("nan"), "digest": None})
    assert out == {"round": 2, "tokens_per_s": 0.0, "t": 5.0}
    assert isinstance(out["tokens_per_s"], float) and isinstance(out["t"], float)
    assert normalize_record({"eval_loss": math.inf, "round": 1}) == {"round": 1}
    assert normalize_record(FULL) == FULL


@pytest.mark.parametrize("bad", [{"round": "1"}, {"color": "red"}, {"phase": "x"}, {"client": 1}])
def test_normalize_record_refuses_a_bad_record_on_one_line(bad):
    with pytest.raises(SwarmError) as e:
        normalize_record(bad)
    assert "\n" not in str(e.value)


def test_config_record_keeps_every_value_type():
    fields = {"a.bool": True, "a.int": 1, "a.float": 1.0, "a.str": "x", "a.list": ["x", "y"]}
    checked = check_config_record(fields)
    assert [type(v) for v in checked.values()] == [bool, int, float, str, list]
    ours = Config().fingerprint_fields()
    assert check_config_record(ours) == ours
    for bad in ({"a": None}, {"a": [1]}, {"a": {"b": 1}}, {1: "x"}):
        with pytest.raises(SwarmError):
            check_config_record(bad)


def test_validator_accepts_valid_records_and_unrelated_keys():
    v = RunRecordsValidator("run")
    assert v.validate(_record("run.live", SUBKEY, FULL))
    assert v.validate(_record("run.live", SUBKEY, {"round": 0, "phase": "join"}))
    assert v.validate(_record("run.config", SUBKEY, Config().fingerprint_fields()))
    assert v.validate(_record("other.live", SUBKEY, {"round": "x"}))  # another run's key, or hivemind's own
    assert v.validate(_record("run_live", SUBKEY, {"round": "x"}))  # not SchemaValidator's prefixed key


@pytest.mark.parametrize("bad", BAD, ids=str)
def test_validator_rejects_invalid_live_records(bad):
    assert not RunRecordsValidator("run").validate(_record("run.live", SUBKEY, bad))


def test_validator_rejects_invalid_config_records_and_shapes():
    v = RunRecordsValidator("run")
    assert not v.validate(_record("run.config", SUBKEY, {"a": None}))
    assert not v.validate(_record("run.config", SUBKEY, {"a": {"b": 1}}))
    assert not v.validate(_record("run.live", "str subkey", {"round": 1}))
    assert not v.validate(_record("run.live", SUBKEY, [1, 2]))
    plain = DHTRecord(DHTID.generate(source="run.live").to_bytes(), MSGPackSerializer.dumps(None),
                      MSGPackSerializer.dumps(5), 0.0)  # a plain value would replace the whole dictionary
    assert not v.validate(plain)


def test_validator_survives_pickling_and_merges():
    v = pickle.loads(pickle.dumps(RunRecordsValidator("run")))
    assert v.validate(_record("run.live", SUBKEY, FULL))
    assert not v.validate(_record("run.live", SUBKEY, {"t": 1}))
    assert v.merge_with(RunRecordsValidator("other"))
    assert not v.validate(_record("other.live", SUBKEY, {"t": 1}))
    assert v.validate(_record("other.live", SUBKEY, {"t": 1.0})) and len(v._schemas) == 1
