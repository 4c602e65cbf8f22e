"""Run configuration: dataclasses loaded from TOML, with `--set section.key=value` overrides.

Precedence (lowest to highest): dataclass defaults < TOML file < ``--set`` overrides < explicit CLI flags.
The CLI applies flags through :func:`apply_overrides` last, so they win.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping


from ..errors import ConfigError

__all__ = ["Config", "ConfigError", "apply_overrides", "load_config", "parse_set"]


# Settings of the fingerprinted sections that are fingerprinted only in sharded mode: the logical shards decide the
# averagers' keys and the digest, so every peer of a run must use the same mode and shard count (any rank layout:
# a 1-rank and an 8-rank peer average together in either mode). A rank0-mode fingerprint is as it always was.
SHARDED_ONLY = frozenset({"outer.sharding", "outer.shards"})
# Settings added after runs were made: fingerprinted only when not at their default, so a run (and its checkpoints)
# made before they existed keeps its fingerprint, while peers that set them differently still cannot average.
OMITTED_AT_DEFAULT = frozenset({"outer.aggregation", "outer.norm_bound", "outer.trim"})


@dataclass
class RunConfig:
    """Identity of the run: peers with the same ``run_id`` and fingerprint train one model together."""

    run_id: str = "p2p-diloco-tiny"
    seed: int = 0  # initial weights come from this seed, so every peer starts from the same theta(0)
    max_rounds: int = 0  # 0 = run until stopped


@dataclass
class ModelConfig:
    """A causal LM that transformers can build: a preset, a config JSON, or a local/hub ``name_or_path``."""

    preset: str = "tiny-llama"  # used when name_or_path and config_json are empty
    name_or_path: str = ""  # from_pretrained (works offline from a local directory)
    config_json: str = ""  # path to a transformers config.json (random init)
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 344
    max_seq_len: int = 256


@dataclass
class TokenizerConfig:
    """``name_or_path = "byte"`` is the built-in byte-level tokenizer; anything else goes to AutoTokenizer."""

    name_or_path: str = "byte"


@dataclass
class DataConfig:
    """Where text comes from. ``path = "builtin:stdlib"`` is the offline default corpus."""

    path: str = "builtin:stdlib"  # hub dataset name, local directory, or a glob of text/json/jsonl/parquet files
    name: str = ""  # hub dataset config name (e.g. "en" for allenai/c4)
    text_column: str = "text"
    train_split: str = "train"
    eval_split: str = ""  # a separate split for eval; empty = hold out documents by hash
    eval_fraction: float = 0.02  # fraction of documents held out (by a hash of the document) when eval_split is empty
    streaming: str = "auto"  # "auto" (stream hub datasets, load local ones), "true", "false"
    seq_len: int = 128
    batch_size: int = 8
    seed: int = -1  # this peer's data order; -1 = derived from the peer id
    max_bytes: int = 8_000_000  # cap on the built-in corpus (the whole stdlib is ~30 MB)
    shuffle_buffer: int = 10_000  # streaming shuffle buffer


@dataclass
class TrainConfig:
    """Inner optimisation (AdamW), run by every peer on its own data for ``inner_steps`` per round."""

    inner_steps: int = 50  # H
    lr: float = 1e-3
    warmup_steps: int = 20
    total_steps: int = 0  # cosine horizon in global inner steps; 0 = max_rounds * inner_steps (or constant)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    autocast: str = "auto"  # "auto" = bf16 where the device supports it (CUDA), "bf16", "off"
    device: str = "cpu"  # "cpu", "cuda", "auto"
    threads: int = 0  # torch CPU threads; 0 = leave torch's default
    parallelism: str = "ddp"  # local ranks of a torchrun peer (p2p_diloco/local/cluster.py): ddp | fsdp (FSDP2)


@dataclass
class OuterConfig:
    """The outer optimiser: SGD with Nesterov momentum on the averaged pseudo-gradient.

    The defaults are for the tiny CPU default; the DiLoCo paper's lr 0.7 / momentum 0.9 (tuned at 150M+, ~180
    rounds) is in the hub configs. At tiny scale the outer step does best when ``lr / (1 - momentum)``, the
    multiple of the averaged pseudo-gradient applied once momentum has built up, is about 1 (FedAvg's); the
    paper's 7 ends ~20 % worse in eval loss (measured: ``docs/results.md``).
    """

    lr: float = 0.7
    momentum: float = 0.3  # lr / (1 - momentum) = 1.0
    nesterov: bool = True
    compression: str = "none"  # wire codec of pseudo-gradients: none | fp16 | bf16 | int8 | int4 (see codecs.py)
    overlap: bool = False  # average round r in the background while training round r+1 (outer step one round late)
    # where theta and the outer momentum live (p2p_diloco/outer/shards.py): "rank0" = whole, on one process (rank 0 of a
    # torchrun peer); "sharded" = cut into `shards` logical shards, each rank keeping its own, one averager each
    sharding: str = "rank0"
    shards: int = 8
    # How each reducer combines the contributions to its slice (p2p_diloco/outer/aggregation.py; docs/security.md):
    # mean | trimmed_mean | centered_clip. Every method first leaves out non-finite contributions and those whose
    # RMS exceeds norm_bound x the median (or the swarm's recent RMS); norm_bound also caps a peer's weight at
    # norm_bound x the median weight. norm_bound = 0 turns both off.
    aggregation: str = "mean"
    norm_bound: float = 10.0
    trim: float = 0.25  # trimmed_mean: the fraction of contributions cut at each end of every coordinate


@dataclass
class RoundConfig:
    """When a round's inner training ends.

    ``fixed_steps``: every peer does ``train.inner_steps`` (H) steps; with peers of different speeds the fast ones
    wait for the slow ones. ``swarm_target``: the round ends for everyone once the swarm's combined progress,
    counted in tokens, reaches a target (by default H steps of every live peer), so a fast peer does more steps
    and a slow one fewer, and all of them enter the all-reduce together; the average is weighted by tokens.
    """

    mode: str = "fixed_steps"  # fixed_steps | swarm_target
    target_tokens: int = 0  # swarm_target: tokens per round for the whole swarm; 0 = H x each live peer's batch
    progress_period: float = 0.5  # swarm_target: seconds between reads of the peers' progress records


@dataclass
class EvalConfig:
    every_rounds: int = 1
    batches: int = 8


@dataclass
class SwarmConfig:
    """Networking and timeouts. Every wait in the round protocol is bounded by one of these."""

    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])  # every interface
    announce_maddrs: list[str] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)
    # RSA key file (hivemind's format) that fixes this peer's id across restarts; created if missing.
    # Empty: a fresh identity per run. The same key signs the peer's DHT records (swarm/identity.py).
    identity_path: str = ""
    startup_timeout: float = 30.0  # p2pd start
    # No inbound connections (behind NAT): the peer dials out only, reduces no slice, serves no state, and
    # still contributes its pseudo-gradient. Its DHT node stores nothing for others.
    client_mode: bool = False
    use_relay: bool = True  # libp2p circuit relay: reach (and be reached through) relaying peers
    use_auto_relay: bool = False  # look for relays and advertise addresses through them (peers behind NAT)
    min_peers: int = 1  # before the first round, wait (up to min_peers_timeout) until this many peers are live
    min_peers_timeout: float = 120.0
    heartbeat_period: float = 1.0  # how often a peer refreshes its live record
    peer_ttl: float = 6.0  # a live record expires after this long without a refresh
    matchmaking_time: float = 8.0  # how long a leader waits for the whole group before giving up
    request_timeout: float = 3.0  # must stay below matchmaking_time (hivemind)
    allreduce_timeout: float = 60.0
    next_chunk_timeout: float = 10.0
    round_timeout: float = 600.0  # give up waiting for stragglers of one round after this long
    # "adaptive": the straggler wait, the all-reduce timeout and the matchmaking window follow observed times
    # (deadlines.py); the three constants above are their caps. "fixed": the constants themselves.
    deadlines: str = "adaptive"
    straggler_floor: float = 30.0  # an adaptive straggler wait is never shorter than this
    state_timeout: float = 60.0  # downloading state from a donor
    part_size_bytes: int = 2**20
    transport: str = "tcp"  # all-reduce bytes: "tcp" = direct sockets (fast, unencrypted), "p2p" = libp2p streams
    data_port: int = 0  # TCP port of the direct data plane (0 = any free port)
    # A private run: only these peers (base58 peer ids, or files of them, one per line, '#' comments) may match
    # with us, download our state, or count as live peers; empty = an open swarm. See docs/security.md.
    allowed_peers: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    """Round-boundary checkpoints (``--checkpoint-dir``, ``--resume``). Empty ``dir`` = no checkpoints."""

    dir: str = ""
    keep: int = 3  # the newest ``keep`` checkpoints are kept
    every_rounds: int = 1  # save after every N-th round (and always on a graceful stop)
    resume: bool = False  # continue from the newest checkpoint in ``dir`` (an error if there is none)


@dataclass
class DebugConfig:
    """Hooks the project's benchmarks need in real peer processes (``--debug-*`` flags). Never set them in a real
    run. (The fault hooks of the tests live in the tests and in :mod:`p2p_diloco.testing`.)"""

    step_delay: float = 0.0  # seconds slept after every inner step: a slow peer for tests and benchmarks
    # A malicious peer for the security tests and benchmarks: send a corrupted pseudo-gradient every round
    # ("nan", "scale:<k>" or "random"; see outer.aggregation.corrupt_).
    corrupt_pseudo_gradient: str = ""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint_fields(self) -> dict[str, Any]:
        """The settings that must agree for peers to average together (flattened ``section.key`` -> value)."""
        out: dict[str, Any] = {"run.seed": self.run.seed, "round.mode": self.round.mode}
        for section in ("model", "tokenizer", "outer"):
            for key, value in dataclasses.asdict(getattr(self, section)).items():
                name = f"{section}.{key}"
                if name in SHARDED_ONLY and self.outer.sharding != "sharded":
                    continue
                if name in OMITTED_AT_DEFAULT and value == getattr(type(getattr(self, section))(), key):
                    continue
                out[name] = value
        return out

    def fingerprint(self) -> str:
        """Short hash of :meth:`fingerprint_fields`; part of the matchmaking key."""
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)}  # type: ignore[misc]


def _coerce(section: str, key: str, current: Any, value: Any) -> Any:
    """Check ``value`` against the type of the default, converting where it is lossless."""
    where = f"{section}.{key}"
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if isinstance(current, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if isinstance(current, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if isinstance(current, list):
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    if isinstance(current, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported type")  # pragma: no cover - all fields are covered above


def apply_overrides(cfg: Config, overrides: Mapping[str, Mapping[str, Any]]) -> Config:
    """Apply ``{section: {key: value}}`` onto ``cfg`` in place, rejecting unknown sections/keys."""
    for section, values in overrides.items():
        if not hasattr(cfg, section) or not dataclasses.is_dataclass(getattr(cfg, section)):
            known = ", ".join(f.name for f in dataclasses.fields(Config))
            raise ConfigError(f"unknown config section [{section}] (known: {known})")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section}] must be a table")
        obj = getattr(cfg, section)
        names = {f.name for f in dataclasses.fields(obj)}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(f"unknown config key {section}.{key} (known: {', '.join(sorted(names))})")
            setattr(obj, key, _coerce(section, key, getattr(obj, key), value))
    from .checks import validate  # (imports this module)

    validate(cfg)
    return cfg


def parse_set(item: str) -> tuple[str, str, Any]:
    """Parse one ``section.key=value``; the value is read as TOML when it parses, else kept as a string."""
    if "=" not in item:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts[0], parts[1], value


def load_config(path: str | Path | None = None, sets: Iterable[str] = (), base: Config | None = None) -> Config:
    """Build a :class:`Config`: defaults (or ``base``), then the TOML file at ``path``, then ``--set`` items."""
    cfg = base if base is not None else Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot parse {p}: {e}") from None
        apply_overrides(cfg, data)
    nested: dict[str, dict[str, Any]] = {}
    for item in sets:
        section, key, value = parse_set(item)
        nested.setdefault(section, {})[key] = value
    return apply_overrides(cfg, nested)
