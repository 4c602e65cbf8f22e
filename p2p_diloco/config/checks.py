"""Checks of a whole :class:`~p2p_diloco.config.Config`: values that would only fail later, deep inside a run."""

from __future__ import annotations

import math

from ..outer.aggregation import METHODS, parse_corruption
from ..outer.codecs import CODECS
from . import Config
from ..errors import ConfigError


def validate(cfg: Config) -> None:
    """Reject values that would only fail later, deep inside a run (:class:`ConfigError`, one line)."""
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
    if cfg.debug.step_delay < 0:
        raise ConfigError(f"debug.step_delay must be >= 0, got {cfg.debug.step_delay}")
    check_security(cfg)


def check_security(cfg: Config) -> None:
    """``outer.aggregation`` and its bounds, ``debug.corrupt_pseudo_gradient``."""
    o = cfg.outer
    if o.aggregation not in METHODS:
        raise ConfigError(f"outer.aggregation must be one of {', '.join(METHODS)}, got {o.aggregation!r}")
    if not (math.isfinite(o.norm_bound) and o.norm_bound >= 0) or (0 < o.norm_bound <= 1):
        raise ConfigError(f"outer.norm_bound must be 0 (off) or > 1, got {o.norm_bound}")
    if not 0.0 <= o.trim < 0.5:
        raise ConfigError(f"outer.trim must be in [0, 0.5), got {o.trim}")
    if cfg.debug.corrupt_pseudo_gradient:
        try:
            parse_corruption(cfg.debug.corrupt_pseudo_gradient)
        except ValueError as e:
            raise ConfigError(f"debug.corrupt_pseudo_gradient: {e}") from None
