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


from .codecs import CODECS
from .errors import UsageError


class ConfigError(UsageError):
    """Bad configuration input (missing file, unknown key, bad value). The CLI turns it into exit code 2."""


# Settings of the fingerprinted sections that are fingerprinted only in sharded mode: the logical shards decide the
# averagers' keys and the digest, so every peer of a run must use the same mode and shard count (any rank layout:
# a 1-rank and an 8-rank peer average together in either mode). A rank0-mode fingerprint is as it always was.
SHARDED_ONLY = frozenset({"outer.sharding", "outer.shards"})


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
    parallelism: str = "ddp"  # local ranks of a torchrun peer (p2p_diloco/cluster.py): ddp | fsdp (FSDP2)


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
    # where theta and the outer momentum live (p2p_diloco/shards.py): "rank0" = whole, on one process (rank 0 of a
    # torchrun peer); "sharded" = cut into `shards` logical shards, each rank keeping its own, one averager each
    sharding: str = "rank0"
    shards: int = 8


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


@dataclass
class CheckpointConfig:
    """Round-boundary checkpoints (``--checkpoint-dir``, ``--resume``). Empty ``dir`` = no checkpoints."""

    dir: str = ""
    keep: int = 3  # the newest ``keep`` checkpoints are kept
    every_rounds: int = 1  # save after every N-th round (and always on a graceful stop)
    resume: bool = False  # continue from the newest checkpoint in ``dir`` (an error if there is none)


@dataclass
class DebugConfig:
    """Fault-injection hooks for the project's own tests and benchmarks. Never set them in a real run."""

    corrupt_theta_at_round: int = 0  # after the outer step of this round, perturb theta (desync-repair test)
    part_delay: float = 0.0  # seconds slept before sending each all-reduce part (to aim signals mid-transfer)
    state_delay: float = 0.0  # seconds slept before sending each chunk of a state download (to kill a donor mid-way)
    sync_delay: float = 0.0  # seconds slept before the first all-reduce attempt of round ``sync_delay_round``
    sync_delay_round: int = 0  # (holds the others back so that a test can kill a peer waiting in matchmaking)
    step_delay: float = 0.0  # seconds slept after every inner step: a slow peer for tests and benchmarks
    stall: float = 0.0  # seconds slept before the inner steps of round ``stall_round`` (a stuck but live peer)
    stall_round: int = 0


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
                if f"{section}.{key}" not in SHARDED_ONLY or self.outer.sharding == "sharded":
                    out[f"{section}.{key}"] = value
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


def validate(cfg: Config) -> None:
    """Reject values that would only fail later, deep inside a run."""
    positive = {
        "train.inner_steps": cfg.train.inner_steps,
        "train.grad_accum": cfg.train.grad_accum,
        "data.seq_len": cfg.data.seq_len,
        "data.batch_size": cfg.data.batch_size,
        "model.num_layers": cfg.model.num_layers,
        "eval.batches": cfg.eval.batches,
        "eval.every_rounds": cfg.eval.every_rounds,
        "swarm.matchmaking_time": cfg.swarm.matchmaking_time,
        "swarm.allreduce_timeout": cfg.swarm.allreduce_timeout,
        "swarm.peer_ttl": cfg.swarm.peer_ttl,
        "swarm.heartbeat_period": cfg.swarm.heartbeat_period,
        "swarm.round_timeout": cfg.swarm.round_timeout,
        "swarm.straggler_floor": cfg.swarm.straggler_floor,
        "swarm.next_chunk_timeout": cfg.swarm.next_chunk_timeout,
        "swarm.startup_timeout": cfg.swarm.startup_timeout,
        "checkpoint.keep": cfg.checkpoint.keep,
        "checkpoint.every_rounds": cfg.checkpoint.every_rounds,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if cfg.swarm.min_peers < 1:
        raise ConfigError(f"swarm.min_peers must be >= 1, got {cfg.swarm.min_peers}")
    if cfg.run.max_rounds < 0:
        raise ConfigError(f"run.max_rounds must be >= 0, got {cfg.run.max_rounds}")
    if not cfg.run.run_id or not all(c.isalnum() or c in "-_" for c in cfg.run.run_id):
        raise ConfigError(f"run.run_id must be non-empty letters, digits, '-' or '_', got {cfg.run.run_id!r}")
    if not 0.0 <= cfg.outer.momentum < 1.0:
        raise ConfigError(f"outer.momentum must be in [0, 1), got {cfg.outer.momentum}")
    if cfg.outer.lr <= 0 or cfg.train.lr <= 0:
        raise ConfigError("outer.lr and train.lr must be > 0")
    if cfg.outer.compression not in CODECS:
        raise ConfigError(f"outer.compression must be one of {', '.join(CODECS)}, got {cfg.outer.compression!r}")
    if cfg.train.autocast not in ("auto", "bf16", "off"):
        raise ConfigError(f"train.autocast must be auto, bf16 or off, got {cfg.train.autocast!r}")
    if cfg.train.device not in ("cpu", "cuda", "auto"):
        raise ConfigError(f"train.device must be cpu, cuda or auto, got {cfg.train.device!r}")
    if cfg.data.streaming not in ("auto", "true", "false"):
        raise ConfigError(f"data.streaming must be auto, true or false, got {cfg.data.streaming!r}")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    if cfg.swarm.request_timeout >= cfg.swarm.matchmaking_time:
        raise ConfigError("swarm.request_timeout must be smaller than swarm.matchmaking_time")
    if cfg.swarm.peer_ttl <= cfg.swarm.heartbeat_period:
        raise ConfigError("swarm.peer_ttl must be larger than swarm.heartbeat_period")
    if cfg.swarm.transport not in ("tcp", "p2p"):
        raise ConfigError(f"swarm.transport must be tcp or p2p, got {cfg.swarm.transport!r}")
    if cfg.swarm.deadlines not in ("adaptive", "fixed"):
        raise ConfigError(f"swarm.deadlines must be adaptive or fixed, got {cfg.swarm.deadlines!r}")
    if cfg.checkpoint.resume and not cfg.checkpoint.dir:
        raise ConfigError("--resume needs --checkpoint-dir (checkpoint.dir)")
    if cfg.train.parallelism not in ("ddp", "fsdp"):
        raise ConfigError(f"train.parallelism must be ddp or fsdp, got {cfg.train.parallelism!r}")
    if cfg.outer.sharding not in ("rank0", "sharded"):
        raise ConfigError(f"outer.sharding must be rank0 or sharded, got {cfg.outer.sharding!r}")
    if cfg.outer.shards < 1:
        raise ConfigError(f"outer.shards must be >= 1, got {cfg.outer.shards}")
    if cfg.outer.sharding == "sharded" and cfg.outer.overlap:
        raise ConfigError("outer.sharding = sharded does not work with outer.overlap yet")
    if cfg.round.mode not in ("fixed_steps", "swarm_target"):
        raise ConfigError(f"round.mode must be fixed_steps or swarm_target, got {cfg.round.mode!r}")
    if cfg.round.target_tokens < 0 or cfg.round.progress_period <= 0:
        raise ConfigError("round.target_tokens must be >= 0 and round.progress_period > 0")
    if cfg.round.mode == "swarm_target" and cfg.outer.overlap:
        raise ConfigError("round.mode = swarm_target does not work with outer.overlap yet")
    d = cfg.debug
    if min(d.part_delay, d.state_delay, d.corrupt_theta_at_round, d.sync_delay, d.sync_delay_round, d.step_delay,
           d.stall, d.stall_round) < 0:
        raise ConfigError("debug.part_delay, debug.state_delay, debug.sync_delay, debug.sync_delay_round, "
                          "debug.step_delay, debug.stall, debug.stall_round and debug.corrupt_theta_at_round "
                          "must be >= 0")
