"""Schemas of the records peers publish in the DHT, enforced on store by every honest DHT node.

Every peer reads every other peer's live record and acts on it: the round it is in, its digest, its progress.
A signature (identity.py) proves who wrote a record, not that it makes sense: a buggy or hostile peer could
publish ``round="999"``, ``t=None`` or a megabyte of extra fields, and each reader would crash on it or be misled
by it. hivemind's ``SchemaValidator`` makes every honest DHT node refuse such a record on store (and drop a reply
that carries one), so readers only ever see records of the documented shape.

The schema is strict: hivemind refuses a record that pydantic would have to convert (``t=1`` for a float field),
so :func:`normalize_record` converts our own values first, and refuses loudly what it cannot fix: a record our
own code got wrong must fail at the publisher, not make the peer silently invisible to the swarm.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Literal, Optional, Union

import pydantic.v1 as pydantic
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from pydantic.v1 import StrictBool, StrictBytes, StrictFloat, StrictInt, StrictStr

from ..errors import SwarmError
from ..protocol.records import Phase, PeerRecord

Count = pydantic.conint(strict=True, ge=0)
Finite = pydantic.confloat(strict=True, allow_inf_nan=False)
Rate = pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)
Fingerprint = pydantic.constr(strict=True, regex=r"^[0-9a-f]{16}$")  # Config.fingerprint()
Digest = pydantic.constr(strict=True, regex=r"^[0-9a-f]{0,64}$")  # sha256 hexdigest (outer.optimizer.digest)
PhaseName = Literal[tuple(p.value for p in Phase)]  # type: ignore[valid-type]
ConfigValue = Union[StrictBool, StrictInt, StrictFloat, StrictStr, List[StrictStr]]
ConfigRecord = Dict[StrictStr, ConfigValue]  # Config.fingerprint_fields(): {"section.key": value}
# The wire type of each kind of field of the typed record (PeerRecord's ``wire`` metadata): one definition of the
# record's fields, in p2p_diloco/protocol/records.py, for the rules and for this schema.
WIRE_TYPES = {"fingerprint": Fingerprint, "count": Count, "phase": PhaseName, "bool": StrictBool, "finite": Finite,
              "rate": Rate, "digest": Digest, "str_list": List[StrictStr]}


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


class _RunRecords(pydantic.BaseModel):
    """The run's shared DHT keys (``{run_id}.live`` and ``{run_id}.config``) as SchemaValidator fields."""

    live: Optional[Dict[StrictBytes, LiveRecord]] = None
    config: Optional[Dict[StrictBytes, ConfigRecord]] = None

    class Config:  # our own, so that SchemaValidator's patch of ``schema.Config`` stays ours
        extra = pydantic.Extra.forbid


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
    """``fields`` (``Config.fingerprint_fields()``) if it is a valid :data:`ConfigRecord`; else :class:`SwarmError`."""
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
