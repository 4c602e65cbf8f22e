"""Run configuration: dataclasses loaded from TOML, with ``--set section.key=value`` overrides.

Precedence (lowest to highest): dataclass defaults < TOML file < ``--set`` overrides < explicit CLI flags; a
``join`` into a live run puts the run's published config between the defaults and the file (:mod:`.adoption`).

The package is layered without cycles: :mod:`.schema` (the dataclasses and the fingerprint) < :mod:`.checks`
(:func:`~p2p_diloco.config.checks.validate`, whole-config checks) < :mod:`.loading` (TOML and ``--set``) <
:mod:`.sharing` (every setting's class: fingerprinted, shared, per-peer or local; the published config) <
:mod:`.adoption` (which published configs a joiner trusts, what it adopts, what it refuses).
"""

from __future__ import annotations

from ..errors import ConfigError
from .loading import apply_overrides, load_config, parse_set
from .schema import (
    OMITTED_AT_DEFAULT,
    SHARDED_ONLY,
    CheckpointConfig,
    Config,
    DataConfig,
    DebugConfig,
    EvalConfig,
    ModelConfig,
    OuterConfig,
    RoundConfig,
    RunConfig,
    SwarmConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "OMITTED_AT_DEFAULT",
    "SHARDED_ONLY",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "EvalConfig",
    "ModelConfig",
    "OuterConfig",
    "RoundConfig",
    "RunConfig",
    "SwarmConfig",
    "TokenizerConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
    "parse_set",
]
