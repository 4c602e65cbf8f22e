"""eval/export helpers without a swarm: the run's config comes from the checkpoint, overrides win, θ is loaded."""

import os

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointStore, PeerState, capture_rng
from p2p_diloco.config import Config, ConfigError, apply_overrides
from p2p_diloco.errors import UsageError
from p2p_diloco.export import checkpoint_path, export_trained, load_trained
from p2p_diloco.training.model import build_model
from p2p_diloco.outer.optimizer import digest
from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

pytestmark = pytest.mark.unit


def _save_run(directory, round_=3, **model_fields):
    """A checkpoint of a run whose model differs from the defaults; theta = its initial weights + 0.01."""
    cfg = apply_overrides(Config(), {"model": model_fields, "data": {"path": "builtin:stdlib", "max_bytes": 400_000}})
    model = build_model(cfg.model, vocab_size(build_tokenizer(cfg.tokenizer)), cfg.run.seed)
    theta = [p.detach().clone() + 0.01 for p in model.parameters()]
    momentum = [torch.zeros_like(t) for t in theta]
    state = PeerState(round=round_, fingerprint=cfg.fingerprint(), global_digest=digest(theta + momentum),
                      theta=theta, momentum=momentum, model=model.state_dict(), inner_optimizer={},
                      data={}, rng=capture_rng(), extra={"config": cfg.to_dict()})
    return CheckpointStore(directory).save(state), theta


def test_the_runs_saved_config_builds_the_model_and_theta_is_loaded(tmp_path):
    _save_run(tmp_path, round_=2, num_layers=1, hidden_size=64)
    newest, theta = _save_run(tmp_path, round_=3, num_layers=1, hidden_size=64)
    assert checkpoint_path(tmp_path) == newest  # a directory means its newest checkpoint
    trained = load_trained(tmp_path)  # no --config: a default-shaped model would not fit theta
    assert trained.cfg.model.num_layers == 1 and trained.state.round == 3
    assert all(torch.equal(p, t) for p, t in zip(trained.model.parameters(), theta))
    # --set wins over the saved config (here: the eval data), the model keeps the run's shape.
    trained = load_trained(tmp_path, sets=["data.eval_fraction=0.5"])
    assert trained.cfg.data.eval_fraction == 0.5 and trained.cfg.data.max_bytes == 400_000


def test_bad_inputs_are_one_line_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="checkpoint not found"):
        load_trained(tmp_path / "nope")
    with pytest.raises(UsageError, match="no checkpoint in"):
        load_trained(tmp_path)
    _save_run(tmp_path, num_layers=1, hidden_size=64)
    with pytest.raises(ConfigError, match=r"model.num_layers=2 \(the run's: 1\)"):
        load_trained(tmp_path, sets=["model.num_layers=2"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists"):
        export_trained(load_trained(tmp_path), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_writes_an_ordinary_directory(tmp_path):
    _save_run(tmp_path / "ckpt", num_layers=1, hidden_size=64)
    out = export_trained(load_trained(tmp_path / "ckpt"), tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()
    assert not list(tmp_path.glob(".tmp-*"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
