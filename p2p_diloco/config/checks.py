"""Checks of a whole :class:`~p2p_diloco.config.Config`: values that would only fail later, deep inside a run.

Every check raises :class:`ConfigError` with one line that names the setting. The choices of ``Literal`` settings
are checked generically (:func:`check_choices`); the other checks are grouped by theme.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError
from .schema import Config, choices, field_types


def validate(cfg: Config) -> None:
    """Reject values that would only fail later, deep inside a run.

    Args:
        cfg: The configuration to check; it is not modified.

    Raises:
        ConfigError: The first bad value, on one line.
    """
    check_choices(cfg)
    check_positive(cfg)
    check_ranges(cfg)
    check_swarm(cfg)
    check_modes(cfg)
    check_security(cfg)
    check_codec(cfg)


def one_of(allowed: tuple[str, ...]) -> str:
    """``"a or b"`` for two choices, ``"one of a, b, c"`` for more (the wording of the messages tests match)."""
    return " or ".join(allowed) if len(allowed) == 2 else "one of " + ", ".join(allowed)


def check_choices(cfg: Config) -> None:
    """Every ``Literal[...]`` setting holds one of its values, e.g. ``round.mode must be fixed_steps or swarm_target,
    got 'fast'``."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for key, annotation in field_types(type(obj)).items():
            allowed, value = choices(annotation), getattr(obj, key)
            if allowed and value not in allowed:
                raise ConfigError(f"{section.name}.{key} must be {one_of(allowed)}, got {value!r}")


def check_positive(cfg: Config) -> None:
    """Counts, sizes and timeouts that must be > 0 (or >= 1 / >= 0 where zero has a meaning)."""
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
    if not 0 <= cfg.swarm.initial_peers_wait < float("inf"):  # (NaN too)
        raise ConfigError(f"swarm.initial_peers_wait must be >= 0 and finite (0 = fail at once), "
                          f"got {cfg.swarm.initial_peers_wait}")
    if cfg.swarm.min_peers < 1:
        raise ConfigError(f"swarm.min_peers must be >= 1, got {cfg.swarm.min_peers}")
    if cfg.run.max_rounds < 0:
        raise ConfigError(f"run.max_rounds must be >= 0, got {cfg.run.max_rounds}")
    if cfg.train.total_steps < 0:
        raise ConfigError(f"train.total_steps must be >= 0 (0 = constant lr after warmup), got {cfg.train.total_steps}")
    if cfg.debug.step_delay < 0:
        raise ConfigError(f"debug.step_delay must be >= 0, got {cfg.debug.step_delay}")
    if not cfg.train.peak_tflops >= 0:  # (NaN too)
        raise ConfigError(f"train.peak_tflops must be >= 0 (0 = a known GPU's peak), got {cfg.train.peak_tflops}")


def check_ranges(cfg: Config) -> None:
    """The run id's characters, learning rates and fractions."""
    if not cfg.run.run_id or not all(c.isalnum() or c in "-_" for c in cfg.run.run_id):
        raise ConfigError(f"run.run_id must be non-empty letters, digits, '-' or '_', got {cfg.run.run_id!r}")
    if not 0.0 <= cfg.outer.momentum < 1.0:
        raise ConfigError(f"outer.momentum must be in [0, 1), got {cfg.outer.momentum}")
    if cfg.outer.lr <= 0 or cfg.train.lr <= 0:
        raise ConfigError("outer.lr and train.lr must be > 0")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")


def check_swarm(cfg: Config) -> None:
    """Timeouts that only work in a given order, and ``--resume`` without a checkpoint directory."""
    if cfg.swarm.request_timeout >= cfg.swarm.matchmaking_time:
        raise ConfigError("swarm.request_timeout must be smaller than swarm.matchmaking_time")
    if cfg.swarm.peer_ttl <= cfg.swarm.heartbeat_period:
        raise ConfigError("swarm.peer_ttl must be larger than swarm.heartbeat_period")
    if cfg.checkpoint.resume and not cfg.checkpoint.dir:
        raise ConfigError("--resume needs --checkpoint-dir (checkpoint.dir)")


def check_modes(cfg: Config) -> None:
    """Sharding and round modes, and the two combinations with ``outer.overlap`` that would need a design of their
    own (not a restructuring): a sharded state's all-reduce is a collective of the peer's local ranks, which cannot
    run in the background while the inner steps use the same ranks; and ``swarm_target`` progress records describe
    the round being trained while the previous round's sync is still in flight."""
    if cfg.outer.shards < 1:
        raise ConfigError(f"outer.shards must be >= 1, got {cfg.outer.shards}")
    if cfg.outer.sharding == "sharded" and cfg.outer.overlap:
        raise ConfigError("outer.sharding = sharded does not work with outer.overlap (the shards' all-reduce is a "
                          "collective of the local ranks: it cannot run behind their inner steps)")
    check_fragments(cfg)
    if cfg.round.target_tokens < 0 or cfg.round.progress_period <= 0:
        raise ConfigError("round.target_tokens must be >= 0 and round.progress_period > 0")
    if cfg.round.mode == "swarm_target" and cfg.outer.overlap:
        raise ConfigError("round.mode = swarm_target does not work with outer.overlap (the progress records would "
                          "mix the round in training with the one being averaged)")


def check_fragments(cfg: Config) -> None:
    """``outer.fragments``: a fragment's sync steps its part of the whole theta kept in one process (``rank0``).
    (With topk, the error feedback is kept per fragment: outer/error_feedback.py.)"""
    o = cfg.outer
    if o.fragments < 1:
        raise ConfigError(f"outer.fragments must be >= 1, got {o.fragments}")
    if not 0.0 <= o.fragment_alpha < 1.0:
        raise ConfigError(f"outer.fragment_alpha must be in [0, 1), got {o.fragment_alpha}")
    if o.fragments == 1:
        return
    if o.sharding != "rank0":
        raise ConfigError("outer.fragments > 1 needs outer.sharding = rank0 (a fragment is a part of the whole theta)")


def check_codec(cfg: Config) -> None:
    """``outer.compression = "topk"`` and its settings. Its error feedback sums the whole model's pseudo-gradient in
    one process, so it needs the whole state (``rank0``); and a trimmed mean of sparse contributions cuts every
    position that fewer than a quarter of the members sent (most of them), so it needs ``mean`` or
    ``centered_clip``."""
    o = cfg.outer
    if not 0.0 < o.topk_density <= 0.5:
        raise ConfigError(f"outer.topk_density must be in (0, 0.5], got {o.topk_density}")
    if o.topk_bits not in (2, 4, 8):
        raise ConfigError(f"outer.topk_bits must be 2, 4 or 8, got {o.topk_bits}")
    if not 0.0 < o.topk_error_decay <= 1.0:
        raise ConfigError(f"outer.topk_error_decay must be in (0, 1], got {o.topk_error_decay}")
    if o.compression != "topk":
        return
    if o.sharding != "rank0":
        raise ConfigError("outer.compression = topk needs outer.sharding = rank0 (its error feedback holds the "
                          "whole pseudo-gradient)")
    if o.aggregation == "trimmed_mean":
        raise ConfigError("outer.compression = topk does not work with outer.aggregation = trimmed_mean (it would "
                          "cut the positions few members sent, most of them): set outer.aggregation = mean or "
                          "centered_clip")


def check_security(cfg: Config) -> None:
    """``outer.norm_bound``, ``outer.trim`` (the aggregation method is a choice) and
    ``debug.corrupt_pseudo_gradient``."""
    o = cfg.outer
    if not (math.isfinite(o.norm_bound) and o.norm_bound >= 0) or (0 < o.norm_bound <= 1):
        raise ConfigError(f"outer.norm_bound must be 0 (off) or > 1, got {o.norm_bound}")
    if not 0.0 <= o.trim < 0.5:
        raise ConfigError(f"outer.trim must be in [0, 0.5), got {o.trim}")
    if cfg.debug.corrupt_pseudo_gradient:
        # Imported here, only when the debug hook is set: outer.aggregation imports torch (~2 s), and reading a
        # config must stay fast so that bad input fails within a tenth of a second.
        from ..outer.aggregation import parse_corruption

        try:
            parse_corruption(cfg.debug.corrupt_pseudo_gradient)
        except ValueError as e:
            raise ConfigError(f"debug.corrupt_pseudo_gradient: {e}") from None
