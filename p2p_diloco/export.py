"""Use what a run produced: evaluate a checkpoint's global weights, or export them as a Hugging Face model.

Both start from a checkpoint written by ``p2p-diloco join --checkpoint-dir DIR`` and always use the *global*
weights theta (what every peer agreed on), never a peer's local weights, which are mid-round and peer-specific.
The run's config is stored in the checkpoint, so ``--config``/``--set`` are only needed to change something, e.g.
``--set data.path=...`` to evaluate on another dataset. The model's shape must stay the checkpoint's.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from .artifacts import given_checkpoint, new_output_dir
from .checkpoint import CheckpointStore, PeerState, ShardFiles
from .config import Config, ConfigError, apply_overrides, load_config
from .errors import UsageError


@dataclass
class Trained:
    """A checkpoint's global weights, loaded into the model its config describes."""

    cfg: Config
    state: PeerState
    path: Path
    model: torch.nn.Module
    tokenizer: object


def checkpoint_path(path: str | Path) -> Path:
    """A checkpoint file, or the newest checkpoint of a ``--checkpoint-dir``."""
    p = given_checkpoint(path)
    if p.is_dir():
        newest = CheckpointStore(p).latest()
        if newest is None:
            raise UsageError(f"no checkpoint in {p}")
        return newest
    return p


_RUN_SECTIONS = ("run", "model", "tokenizer", "data", "train", "outer", "eval")  # what eval/export inherit


def _config(state: PeerState, config_path: str | None, sets: Iterable[str]) -> Config:
    """The run's own config (saved in the checkpoint), then ``--config``, then ``--set``."""
    base = Config()
    saved = state.extra.get("config")
    if isinstance(saved, dict):  # older checkpoints have none: then the caller's config must describe the run
        apply_overrides(base, {k: v for k, v in saved.items() if k in _RUN_SECTIONS})
    return load_config(config_path, sets, base=base)


def load_trained(checkpoint: str | Path, config_path: str | None = None, sets: Iterable[str] = ()) -> Trained:
    """Load a checkpoint (verified: theta must match its digest) into a fresh model of the run's shape.

    Raises:
        UsageError: (one line) no checkpoint, a corrupt one, a config that cannot be built, or a model whose
            shape differs from the checkpoint's.
    """
    from .training.model import build_model
    from .outer.optimizer import load_into
    from .training.tokenizer import build_tokenizer, vocab_size

    path = checkpoint_path(checkpoint)
    state = CheckpointStore(path.parent).load(path)
    cfg = _config(state, config_path, sets)
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, vocab_size(tokenizer), cfg.run.seed)
    params = list(model.parameters())
    if state.extra.get("shard_digests") is not None:  # outer.sharding = sharded: theta is in the shard files
        state.theta = _theta_from_shards(state, path, params, cfg)
    shapes = [tuple(p.shape) for p in params]
    saved = [tuple(t.shape) for t in state.theta]
    if shapes != saved:
        raise ConfigError(_model_mismatch(path, state, cfg, f"{len(saved)} tensors of other shapes than this "
                                                            f"config's model ({len(shapes)} tensors)"))
    load_into(params, state.theta)
    return Trained(cfg, state, path, model.eval(), tokenizer)


_SHAPE_SECTIONS = ("model", "tokenizer")  # what decides the model's tensors and their shapes


def _model_mismatch(path: Path, state: PeerState, cfg: Config, what: str) -> str:
    """One line: the checkpoint's weights do not fit the model ``cfg`` describes, and which settings differ from the
    run's own (kept in the checkpoint), or, for a checkpoint that kept none, which config to pass."""
    saved = state.extra.get("config")
    if not isinstance(saved, dict):
        return f"checkpoint {path} holds {what}, and keeps no config of its run: pass that run's --config"
    ours = cfg.to_dict()
    diffs = [f"{section}.{key}={value!r} (the run's: {saved[section].get(key)!r})"
             for section in _SHAPE_SECTIONS if isinstance(saved.get(section), dict)
             for key, value in ours[section].items() if saved[section].get(key) != value]
    if not diffs:
        return f"checkpoint {path} holds {what}"
    return (f"checkpoint {path} was trained with another model shape: {', '.join(diffs)}; its weights do not fit "
            f"(leave these settings out: eval and export take the run's model from the checkpoint)")


def _theta_from_shards(state: PeerState, path: Path, params, cfg: Config) -> list:
    """theta whole, from the checkpoint's shard files (each verified against the digest the checkpoint recorded)."""
    files, digests = ShardFiles(path.parent), state.extra["shard_digests"]
    flat = torch.cat([files.load(j, state.round, state.fingerprint, d)[0] for j, d in enumerate(digests)])
    sizes = [p.numel() for p in params]
    if flat.numel() != sum(sizes):
        raise ConfigError(_model_mismatch(path, state, cfg, f"{flat.numel()} values, this config's model "
                                                            f"{sum(sizes)}"))
    return [t.view(p.shape).clone() for t, p in zip(flat.split(sizes), params)]


def evaluate_trained(trained: Trained) -> dict:
    """Eval loss and perplexity of the global weights on ``cfg.data``'s held-out split (``eval.batches``)."""
    from .training.data import eval_batches
    from .training.inner import evaluate

    batches = eval_batches(trained.tokenizer, trained.cfg.data, trained.cfg.eval.batches)
    if not batches:
        raise ConfigError("eval.batches must be at least 1")
    loss = evaluate(trained.model, batches, torch.device("cpu"))
    return {"checkpoint": str(trained.path), "round": trained.state.round,
            "global_digest": trained.state.global_digest, "eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "eval_tokens": sum(b.numel() for b in batches), "data_path": trained.cfg.data.path or "(built-in)"}


def export_trained(trained: Trained, out: str | Path) -> Path:
    """Write ``save_pretrained`` model + tokenizer to ``out`` (which must not exist, or be an empty directory).

    The files are written to a temporary sibling directory that is renamed to ``out`` at the end: an
    interrupted export leaves no half-written model behind.
    """
    out = new_output_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok, model = trained.tokenizer, trained.model
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):  # so that generate() stops and pads sensibly
        value = getattr(tok, name)
        setattr(model.config, name, value)
        if model.generation_config is not None:
            setattr(model.generation_config, name, value)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of output, not a progress bar per shard
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the export is an ordinary directory
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    return out
