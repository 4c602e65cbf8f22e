"""Schemas of the records peers publish in the DHT, enforced on store by every honest DHT node.

Every peer reads every other peer's live record and acts on it: the round it is in, its digest, its progress.
A signature (identity.py) proves who wrote a record, not that it makes sense: a buggy or hostile peer could
publish ``round="999"``, ``t=None`` or a megabyte of extra fields, and each reader would crash on it or be misled
by it. hivemind's ``SchemaValidator`` makes every honest DHT node refuse such a record on store (and drop a reply
that carries one), so readers only ever see records of the documented shape.

The schema is strict: hivemind refuses a record that pydantic would have to convert (``t=1`` for a float field),
so :func:`normalize_record` converts our own values first, and refuses loudly what it cannot fix: a record our
own code got wrong must fail at the publisher, not make the peer silently invisible to the swarm.

A valid signature only proves that *some* key signed a record, and any fresh key will do. So every DHT node also
caps how far in the future a record of the run may expire and how large it may be (:class:`RecordLimitsValidator`):
a claim stored once by a throw-away identity that then disconnects lives at most about one ``swarm.peer_ttl``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable, List, Literal, Optional, Union

import pydantic.v1 as pydantic
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from pydantic.v1 import StrictBool, StrictBytes, StrictFloat, StrictInt, StrictStr

from ..errors import SwarmError
from ..protocol.records import Phase, PeerRecord
from .identity import Identity, OwnedRecordsValidator
from .port import BLOB_LIFETIMES, BLOB_MAX_BYTES

Count = pydantic.conint(strict=True, ge=0)
Finite = pydantic.confloat(strict=True, allow_inf_nan=False)
Rate = pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)
Fingerprint = pydantic.constr(strict=True, regex=r"^[0-9a-f]{16}$")  # Config.fingerprint()
Digest = pydantic.constr(strict=True, regex=r"^[0-9a-f]{0,64}$")  # sha256 hexdigest (outer.optimizer.digest)
PeerIdText = pydantic.constr(strict=True, regex=r"^[0-9A-Za-z]{0,128}$")  # a base58 peer id ("" = none)
PhaseName = Literal[tuple(p.value for p in Phase)]  # type: ignore[valid-type]
# A published config (config/sharing.py published_settings(): the fingerprinted, shared and per-peer settings) as
# {"section.key": value}. Bounded for a stranger's record by MAX_VALUE_BYTES (16 KiB: ours is ~1.5 KB) and here by
# the shape of a key and the length of a string (a path: 4096, Linux's PATH_MAX) and of a list.
ConfigKey = pydantic.constr(strict=True, regex=r"^[a-z][a-z_]*\.[a-z][a-z0-9_]*$", max_length=64)
ConfigText = pydantic.constr(strict=True, max_length=4096)
ConfigValue = Union[StrictBool, StrictInt, StrictFloat, ConfigText, pydantic.conlist(ConfigText, max_items=64)]
ConfigRecord = Dict[ConfigKey, ConfigValue]
# The wire type of each kind of field of the typed record (PeerRecord's ``wire`` metadata): one definition of the
# record's fields, in p2p_diloco/protocol/records.py, for the rules and for this schema.
WIRE_TYPES = {"fingerprint": Fingerprint, "count": Count, "phase": PhaseName, "bool": StrictBool, "finite": Finite,
              "rate": Rate, "digest": Digest, "str_list": List[StrictStr], "peer_id": PeerIdText}


class _LiveRecordBase(pydantic.BaseModel):
    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.root_validator(pre=True)
    def _no_nulls(cls, values: Dict[str, Any]) -> Dict[str, Any]:
        nulls = sorted(str(name) for name, value in values.items() if value is None)
        if nulls:
            raise ValueError(f"fields {nulls} are null (leave a field out instead)")
        return values

    def dict(self, **kwargs) -> Dict[str, Any]:
        """Only the fields the record has: hivemind compares this to the raw record, which has no ``None``s."""
        kwargs["exclude_unset"] = True
        return super().dict(**kwargs)


# A peer's live record (``{run_id}.live``): every field of :class:`PeerRecord` is optional (a record is built up
# over time), but a field that is present holds a value of its wire type, never ``None``.
_FIELDS = {f.name: WIRE_TYPES[f.metadata["wire"]] for f in dataclasses.fields(PeerRecord)}
LiveRecord = pydantic.create_model("LiveRecord", __base__=_LiveRecordBase,
                                   **{name: (Optional[kind], None) for name, kind in _FIELDS.items()})


# Owned, signed blobs (``SwarmPort.put_blob``: the round certificate exchange), bounded by port.BLOB_MAX_BYTES.
SigBlob = pydantic.conbytes(strict=True, max_length=BLOB_MAX_BYTES["sig"])
CertBlob = pydantic.conbytes(strict=True, max_length=BLOB_MAX_BYTES["cert"])
ChainBlob = pydantic.conbytes(strict=True, max_length=BLOB_MAX_BYTES["chain"])


class _RunRecords(pydantic.BaseModel):
    """The run's shared DHT keys (``{run_id}.live``, ``.config``, ``.sig``, ``.cert``, ``.chain``) as SchemaValidator
    fields.

    Each is a dictionary keyed by owner subkeys (identity.py): SchemaValidator checks one ``{subkey: value}`` at a
    time, so every field is a ``Dict[subkey, value]`` (a plain value under these keys is refused)."""

    live: Optional[Dict[StrictBytes, LiveRecord]] = None
    config: Optional[Dict[StrictBytes, ConfigRecord]] = None
    sig: Optional[Dict[StrictBytes, SigBlob]] = None
    cert: Optional[Dict[StrictBytes, CertBlob]] = None
    chain: Optional[Dict[StrictBytes, ChainBlob]] = None

    class Config:  # our own, so that SchemaValidator's patch of ``schema.Config`` stays ours
        extra = pydantic.Extra.forbid


RUN_KEYS = tuple(_RunRecords.__fields__)  # the run's DHT keys are "{run_id}.{name}"

_FLOAT_FIELDS = frozenset(name for name, field in LiveRecord.__fields__.items()
                          if isinstance(field.type_, type) and issubclass(field.type_, float))


def _one_line(error: pydantic.ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())


def normalize_record(fields: Dict[str, Any]) -> Dict[str, Any]:
    """The live record to publish: ints made floats for the float fields, ``None`` and non-finite floats
    (a NaN loss) left out, then checked against :class:`LiveRecord`.

    Raises:
        SwarmError: the record would not pass the schema (a bug in the publishing code).
    """
    out = {}
    for name, value in fields.items():
        if name in _FLOAT_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        out[name] = value
    try:
        parsed = LiveRecord.parse_obj(out).dict()
    except pydantic.ValidationError as e:
        raise SwarmError(f"our live record breaks its schema: {_one_line(e)}") from None
    if parsed != out:
        raise SwarmError(f"our live record needs type conversions: {out!r}")
    return out


def check_config_record(fields: Dict[str, Any]) -> Dict[str, Any]:
    """``fields`` (``published_settings(cfg)``) if it is a valid :data:`ConfigRecord`; else :class:`SwarmError`."""
    try:
        parsed = _RunRecords.parse_obj({"config": {b"": fields}}).config[b""]
    except pydantic.ValidationError as e:
        raise SwarmError(f"our config record breaks its schema: {_one_line(e)}") from None
    if parsed != fields:
        raise SwarmError(f"our config record needs type conversions: {fields!r}")
    return fields


class RunRecordsValidator(SchemaValidator):
    """DHT validator: the records under ``{run_id}.live`` and ``{run_id}.config`` must match their schemas.

    Other keys (hivemind's own: matchmaking, averager state) pass. Validation runs after
    ``RSASignatureValidator`` (priority 10) has checked and stripped the signature.

    Args:
        run_id: the run whose keys are checked.
    """

    def __init__(self, run_id: str):
        super().__init__(_RunRecords, allow_extra_keys=True)
        self.run_id = run_id
        # SchemaValidator's prefix would make the keys "{prefix}_live": ours are "{run_id}.live"
        self._key_id_to_field_name = {DHTID.generate(source=f"{run_id}.{name}").to_bytes(): name
                                      for name in _RunRecords.__fields__}

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Another run's validator adds its keys (same schema, tried once); other schemas merge as in hivemind."""
        if isinstance(other, RunRecordsValidator):
            self._key_id_to_field_name.update(other._key_id_to_field_name)
            return True
        return super().merge_with(other)


# ------------------------------------------------------------------------------------------------ record limits
# How long each record of the run lives, in units of ``swarm.peer_ttl``: a live record (refreshed every heartbeat),
# a sig/cert blob (put_blob's ttl is at most peer_ttl) and the config record (refreshed every 10th heartbeat, so it
# lives longer: Swarm._publish_config).
LIFETIMES = {"live": 1, "config": 5, **BLOB_LIFETIMES}
# The longest peer_ttl a DHT node accepts from another peer, given its own: 1.5 x its own plus 5 s. The 5 s cover
# clock skew between hosts (the DHT time is the wall clock; hivemind tolerates 3 s between nodes at bootstrap); a
# record's lifetime only shrinks on its way to other nodes. peer_ttl is not in the config fingerprint, so nothing
# else makes peers agree on it: a peer whose peer_ttl exceeds this bound has its records refused by our DHT node,
# and a reply from a node holding one of them loses the whole key's dictionary (hivemind drops a dictionary reply
# with any invalid entry), so such a peer is invisible to us and makes the key's other replicas matter more. Keep
# peer_ttl the same on every peer of a run.
TTL_SLACK_FACTOR, TTL_SLACK_S = 1.5, 5.0
# The largest serialized value of each record, as a DHT node sees it: msgpack of the value plus the signature
# hivemind appends ("[signature:<base64>]", 356 bytes for a 2048-bit key, 696 for 4096). A live record is ~300 bytes,
# plus ~48 bytes per shard in ``shard_peers`` (sharded runs); a config record ~1.5 KB of msgpack (69 settings at
# their defaults), more with long strings.
SIGNATURE_ROOM = 1024
MAX_VALUE_BYTES = {"live": 16 * 1024, "config": 16 * 1024,
                   **{name: limit + SIGNATURE_ROOM for name, limit in BLOB_MAX_BYTES.items()}}


LATE_HEARTBEATS = 2.0  # our live record outlives this many of our slowest recent heartbeat intervals
HEARTBEAT_WINDOW = 8  # the heartbeat intervals record_lifetime looks at


def record_lifetime(peer_ttl: float, intervals: Iterable[float]) -> float:
    """How long our live record lives from its store: ``peer_ttl``, or longer when our own last heartbeats came
    further apart than half of it (``intervals``: seconds between the last :data:`HEARTBEAT_WINDOW` stores).

    Why: a starved host's heartbeats come late. With 16 peers on 2 cores (benchmarks/chaos.py, 2026-12-08) they
    came 4-8 s apart (1 s configured); with ``peer_ttl`` 6 s each peer then saw 3-15 of its 15 round-mates (10.7 on
    average), a different few at each read, and no round committed in 420 s. Only the publisher knows its
    heartbeats are late, so it is the one to say how long its record stays valid. At most ``TTL_SLACK_FACTOR x
    peer_ttl``: what every DHT node with the same ``peer_ttl`` accepts (:func:`ttl_cap`) with the clock-skew slack
    left whole. A peer whose heartbeats are on time keeps ``peer_ttl``, so its death is seen as soon as before.
    (Measured there, it raised the records a view held from 10.7 to 13.9-14.3 of 15: docs/scale.md.)"""
    slowest = max(intervals, default=0.0)
    return min(TTL_SLACK_FACTOR * peer_ttl, max(peer_ttl, LATE_HEARTBEATS * slowest))


def ttl_cap(peer_ttl: float) -> float:
    """The longest lifetime (seconds from now) a DHT node with this ``peer_ttl`` accepts for a record of lifetime
    factor 1 (:data:`LIFETIMES`)."""
    return TTL_SLACK_FACTOR * peer_ttl + TTL_SLACK_S


class RecordLimitsValidator(RecordValidatorBase):
    """DHT validator: a record of the run expires at most ``LIFETIMES[key] * ttl_cap(peer_ttl)`` seconds after the
    node's current DHT time, and its serialized value is at most ``MAX_VALUE_BYTES[key]`` bytes.

    Checked on every store this node receives (and its own), and on every record in a reply to our reads; hivemind
    drops a dictionary reply if any of its entries fails. A remaining lifetime only shrinks, so a record that passed
    once keeps passing when it is re-served or replicated later. Other keys (hivemind's own) pass.

    Its priority (20) is above ``RSASignatureValidator``'s (10): these cheap checks run first, on the signed value as
    stored (before the RSA verification, the signature regex and the schema's msgpack/pydantic parsing of a possibly
    huge value), and its ``strip_value`` is the identity, so the order of stripping is unchanged.

    Args:
        run_id: the run whose keys are limited.
        peer_ttl: this node's ``swarm.peer_ttl`` (see :data:`TTL_SLACK_FACTOR` about peers that use another one).
    """

    def __init__(self, run_id: str, peer_ttl: float):
        cap = ttl_cap(peer_ttl)
        self._limits = {DHTID.generate(source=f"{run_id}.{name}").to_bytes(): (LIFETIMES[name] * cap,
                                                                                MAX_VALUE_BYTES[name])
                        for name in RUN_KEYS}

    @property
    def priority(self) -> int:
        return 20

    def validate(self, record: DHTRecord) -> bool:
        limits = self._limits.get(record.key)
        if limits is None:
            return True
        max_lifetime, max_bytes = limits
        return len(record.value) <= max_bytes and record.expiration_time - get_dht_time() <= max_lifetime

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Another run's limits add its keys (a node in two runs)."""
        if not isinstance(other, RecordLimitsValidator):
            return False
        self._limits.update(other._limits)
        return True


def record_validators(identity: Identity, run_id: str, peer_ttl: float) -> list:
    """The DHT validators of a peer of ``run_id``: its signature (identity.py), owned subkeys, the schemas and the
    expiration/size limits of every key of the run (schema.py). Every DHT node of the run enforces them on store."""
    keys = [f"{run_id}.{name}" for name in RUN_KEYS]
    return [identity.validator, OwnedRecordsValidator(keys), RunRecordsValidator(run_id),
            RecordLimitsValidator(run_id, peer_ttl)]
