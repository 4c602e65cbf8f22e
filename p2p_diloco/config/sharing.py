"""Which settings a run shares: every setting of :class:`~p2p_diloco.config.Config` in exactly one class.

* ``fingerprinted``: must be equal for peers to average at all; hashed into :meth:`Config.fingerprint`, which is
  part of every matchmaking key and of every checkpoint (unchanged here: the fingerprint's own fields decide).
* ``shared``: every peer of the run must use the same value, or the run changes meaning without anyone noticing;
  not in the fingerprint (that would change every existing run's), so checked by comparing published configs.
* ``per_peer``: adopted from the run when this peer gives no value (so that a bare ``join`` trains like the
  others), but a peer may choose its own (a notice says so).
* ``local``: about this machine or this process only; never published, never adopted.

The run's published config (the signed ``<run_id>.config`` record, :func:`published_settings`) holds the
fingerprinted, shared and per-peer settings; :mod:`.adoption` decides what a joiner does with it. No network here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..errors import ConfigError
from .loading import apply_overrides
from .schema import FINGERPRINTED_SETTINGS, Config

FINGERPRINTED = "fingerprinted"
SHARED = "shared"
PER_PEER = "per_peer"
LOCAL = "local"

# The fingerprint's own settings (Config.fingerprint_fields): whole sections plus single settings of the others.
FINGERPRINTED_SECTIONS = ("model", "tokenizer", "outer")

# Shared. Why each group must agree on every peer:
SHARED_SETTINGS = frozenset({
    # The inner optimisation defines what a round is: H inner steps of AdamW under one lr schedule. A peer with
    # another H or lr computes pseudo-gradients of another size and direction, and the average mixes them silently
    # (the operator's H=20 and a joiner's H=50 were accepted together); every peer must see the same schedule step.
    "train.inner_steps", "train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.weight_decay",
    "train.beta1", "train.beta2", "train.grad_clip",
    # swarm_target rounds end when the swarm's combined progress reaches one target, read at one cadence: peers
    # with other targets would end the round at other times and miss each other's all-reduce.
    "round.target_tokens", "round.progress_period",
    # The round protocol's clocks: liveness (a record lives peer_ttl, refreshed every heartbeat_period; a DHT node
    # refuses records that live much longer than its own peer_ttl: swarm/schema.py), the matchmaking window and
    # the all-reduce and straggler deadlines that every member of a group must wait out alike, and the part size
    # every reducer of hivemind's all-reduce expects from every sender.
    "swarm.heartbeat_period", "swarm.peer_ttl", "swarm.matchmaking_time", "swarm.request_timeout",
    "swarm.allreduce_timeout", "swarm.next_chunk_timeout", "swarm.round_timeout", "swarm.deadlines",
    "swarm.straggler_floor", "swarm.part_size_bytes",
})

# Per-peer. Why a peer may differ (and why a bare join still adopts them):
PER_PEER_SETTINGS = frozenset({
    # How long the run goes on for this peer: a peer may leave earlier or stay longer (the lr horizon is
    # train.total_steps, fingerprinted, never max_rounds).
    "run.max_rounds",
    # The data: each peer trains on its own stream anyway; the run's source, split and sizes are the right default
    # for a joiner that knows nothing else, but a peer may read its own copy, its own path or another batch size
    # (swarm_target rounds and the token-weighted average count tokens, not steps).
    "data.path", "data.name", "data.text_column", "data.train_split", "data.eval_split", "data.eval_fraction",
    "data.streaming", "data.seq_len", "data.batch_size", "data.max_bytes", "data.shuffle_buffer",
    # How this peer runs a step: accumulation and precision. The pseudo-gradient's meaning does not change.
    "train.grad_accum", "train.autocast", "train.activation_checkpointing",
    # Evaluation is each peer's own report on its held-out data; no protocol decision reads it. Adopted so that
    # the eval losses the peers publish are comparable by default.
    "eval.every_rounds", "eval.batches",
    # Waits and choices of this peer alone: how many peers it waits for before its first round, how long a state
    # download may take over its link, the data plane it offers (a group falls back to libp2p streams when any
    # member offers none: exact_averager.py) and whether it asks for encryption (one member asking is enough).
    "swarm.min_peers", "swarm.min_peers_timeout", "swarm.state_timeout", "swarm.transport", "swarm.encrypt_data",
    # How often this peer saves and how many checkpoints it keeps (its own disk).
    "checkpoint.keep", "checkpoint.every_rounds",
})

# Local. Why never published or adopted: they name this machine, this process or this peer's identity, and
# another peer's value is meaningless (or harmful) here.
LOCAL_SETTINGS = frozenset({
    # The run id is the name the records are looked up under: given, never read from them.
    "run.run_id",
    # This peer's data order: equal orders would make peers train on the same batches.
    "data.seed",
    # Addresses, ports, identity, start-up wait, NAT and relay choices, and the private run's list (a joiner
    # must not widen or narrow who it trusts because a record said so).
    "swarm.host_maddrs", "swarm.announce_maddrs", "swarm.initial_peers", "swarm.identity_path",
    "swarm.startup_timeout", "swarm.initial_peers_wait", "swarm.client_mode", "swarm.use_relay",
    "swarm.use_auto_relay", "swarm.data_port", "swarm.allowed_peers",
    # This machine's hardware: the device, CPU threads and the layout of its local ranks (an operator's
    # threads = 1 of a shared laptop, or device = cuda, would be wrong or fatal on a joiner's machine).
    "train.device", "train.threads", "train.parallelism", "train.peak_tflops", "train.compile",
    # This peer's checkpoint directory and whether it resumes from it.
    "checkpoint.dir", "checkpoint.resume",
    # Test and benchmark hooks: a slow or malicious peer must never spread by adoption.
    "debug.step_delay", "debug.corrupt_pseudo_gradient",
})


def all_settings() -> list[str]:
    """Every setting of :class:`Config` as ``"section.key"``, in declaration order."""
    return [f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
            for f in dataclasses.fields(section.default_factory())]


def _fingerprinted() -> frozenset[str]:
    return frozenset({*FINGERPRINTED_SETTINGS, *(name for name in all_settings()
                                                  if name.split(".")[0] in FINGERPRINTED_SECTIONS)})


def setting_classes() -> dict[str, str]:
    """``{"section.key": class}`` for every setting; the explicit lists above, the fingerprint's for the rest.

    Raises:
        ConfigError: a setting in no class or in two (a new setting must be classified: tests/unit enforces it).
    """
    groups = {FINGERPRINTED: _fingerprinted(), SHARED: SHARED_SETTINGS, PER_PEER: PER_PEER_SETTINGS,
              LOCAL: LOCAL_SETTINGS}
    out: dict[str, str] = {}
    for name in all_settings():
        found = [kind for kind, names in groups.items() if name in names]
        if len(found) != 1:
            raise ConfigError(f"setting {name} is in {len(found)} classes ({', '.join(found) or 'none'}): "
                              f"classify it once in p2p_diloco/config/sharing.py")
        out[name] = found[0]
    unknown = set().union(*groups.values()) - set(out)
    if unknown:
        raise ConfigError(f"sharing.py classifies settings that do not exist: {sorted(unknown)}")
    return out


CLASSES = setting_classes()  # checked at import: an unclassified setting fails every command, and the unit tests
PUBLISHED = tuple(name for name, kind in CLASSES.items() if kind != LOCAL)


def get(cfg: Config, name: str) -> Any:
    """The value of setting ``"section.key"`` in ``cfg``."""
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


def published_settings(cfg: Config) -> dict[str, Any]:
    """The run's config as this peer publishes it: every fingerprinted, shared and per-peer setting (at its
    default too), flattened to ``{"section.key": value}``; lists are copied."""
    return {name: list(value) if isinstance(value, list) else value
            for name in PUBLISHED for value in [get(cfg, name)]}


def config_of(published: Mapping[str, Any]) -> Config:
    """The config a published record describes: the defaults, then every known, non-local setting it holds.

    Settings it lacks keep their defaults (a record of an older peer holds only the fingerprint's settings);
    settings this version does not know, and local ones, are ignored.

    Raises:
        ConfigError: a value of the wrong type, or a config that fails the checks.
    """
    nested: dict[str, dict[str, Any]] = {}
    for name, value in published.items():
        if CLASSES.get(name, LOCAL) != LOCAL:
            section, key = name.split(".")
            nested.setdefault(section, {})[key] = value
    return apply_overrides(Config(), nested)


def agreement_view(cfg: Config, shared: frozenset[str] | set[str] | None = None) -> dict[str, Any]:
    """What peers must agree on: :meth:`Config.fingerprint_fields` plus the shared settings (all of them, or
    only those in ``shared``: the ones a record actually published)."""
    names = SHARED_SETTINGS if shared is None else SHARED_SETTINGS & set(shared)
    return {**cfg.fingerprint_fields(), **{name: get(cfg, name) for name in sorted(names)}}
