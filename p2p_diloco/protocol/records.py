"""The live record every peer publishes, typed: the one definition the rules, the DHT schema and the fake share.

A peer's record is all the others know of it: which round it is in, which global weights it holds (their digest),
what it is doing (:class:`Phase`), and its progress. The rules of :mod:`p2p_diloco.protocol` decide from a *view*:
``{peer id: PeerRecord}`` of every other live peer. No network and no torch here; :mod:`p2p_diloco.swarm.schema`
turns the fields below into the strict schema every DHT node enforces (each field's ``wire`` kind says how).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any, Mapping


class Phase(StrEnum):
    """What a peer is doing, as its record says. Only ``TRAIN``, ``SYNC`` and ``DONE`` records are *synced*: they
    describe global weights the peer really holds, so only they are waited for, vote on digests and donate state."""

    JOIN = "join"  # not synced yet: downloading the swarm's state, or waiting for the next round boundary
    TRAIN = "train"  # inner steps of the round after its round
    SYNC = "sync"  # its pseudo-gradient is ready: looking for its group, or in the all-reduce
    REPAIR = "repair"  # replacing global weights the majority does not hold
    DONE = "done"  # finished the run's last round; still serving state to peers behind
    LEFT = "left"  # stopped; the record is about to expire


SYNCED = frozenset({Phase.TRAIN, Phase.SYNC, Phase.DONE})


def wire(kind: str) -> dict[str, str]:
    """Field metadata: the record's wire type (``swarm/schema.py`` maps each kind to a strict DHT schema type)."""
    return {"wire": kind}


@dataclass(frozen=True)
class PeerRecord:
    """One peer's live record (``<run_id>.live`` in the DHT). A field the record does not carry has its default.

    ``round`` is the index of the global weights the peer holds, theta(round): the number of rounds it has
    completed (-1 if the record does not say).
    """

    fp: str | None = field(default=None, metadata=wire("fingerprint"))  # Config.fingerprint()
    round: int = field(default=-1, metadata=wire("count"))
    phase: Phase | None = field(default=None, metadata=wire("phase"))
    client: bool = field(default=False, metadata=wire("bool"))  # client mode: accepts no inbound connection
    t: float | None = field(default=None, metadata=wire("finite"))  # the publisher's time.time()
    ready: bool = field(default=False, metadata=wire("bool"))  # data and model built: can start a round at once
    digest: str = field(default="", metadata=wire("digest"))  # of theta(round) and its momentum
    head: str = field(default="", metadata=wire("digest"))  # id of the round certificate of that state ("": none)
    inner_step: int | None = field(default=None, metadata=wire("count"))  # inner steps done in the round it trains
    tokens: int | None = field(default=None, metadata=wire("count"))  # tokens trained by this peer, all rounds
    round_tokens: int | None = field(default=None, metadata=wire("count"))  # tokens trained in this round
    step_tokens: int | None = field(default=None, metadata=wire("count"))  # tokens per inner step
    tokens_per_s: float | None = field(default=None, metadata=wire("rate"))
    eval_loss: float | None = field(default=None, metadata=wire("finite"))
    last_sync: float | None = field(default=None, metadata=wire("finite"))  # time.time() of its last all-reduce
    shard_peers: tuple[str, ...] | None = field(default=None, metadata=wire("str_list"))  # sharded: who keeps j
    # where the publisher listens (its libp2p multiaddrs, at most 4): the others' probes dial them (swarm/probe.py)
    maddrs: tuple[str, ...] | None = field(default=None, metadata=wire("str_list"))
    # A reachable peer catching up from a client-mode donor: the round it needs (``wants``) and the client it asks
    # to push it (``ask``, a peer id; "" or absent: no wish). See protocol/push.py.
    wants: int | None = field(default=None, metadata=wire("count"))
    ask: str = field(default="", metadata=wire("peer_id"))

    @property
    def synced(self) -> bool:
        return self.phase in SYNCED

    @classmethod
    def from_wire(cls, values: Mapping[str, Any]) -> PeerRecord:
        """A record read from the DHT (already schema-checked there); unknown keys are ignored."""
        known = {k: v for k, v in values.items() if k in FIELDS and v is not None}
        if "phase" in known:
            known["phase"] = Phase(known["phase"])
        for name in ("shard_peers", "maddrs"):
            if name in known:
                known[name] = tuple(known[name])
        return cls(**known)


FIELDS = frozenset(f.name for f in dataclasses.fields(PeerRecord))
View = Mapping[str, PeerRecord]  # every other live peer's record, by peer id: what the rules decide from


def wire_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Record fields as they go on the wire: enums as their values, tuples as lists. Raises KeyError on a field
    the record does not have (a bug of the caller)."""
    out = {}
    for name, value in fields.items():
        if name not in FIELDS:
            raise KeyError(f"a live record has no field {name!r}")
        out[name] = value.value if isinstance(value, Enum) else list(value) if isinstance(value, tuple) else value
    return out
