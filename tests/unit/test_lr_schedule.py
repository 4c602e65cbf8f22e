"""The inner lr schedule is swarm-wide: its horizon is ``train.total_steps`` (fingerprinted), never a peer's own
``--max-rounds``, so peers with different ``--max-rounds`` train a round with the same lr and a run stopped and
resumed with a larger ``--max-rounds`` continues exactly (the end-to-end check: tests/swarm/test_checkpoints.py)."""

import pytest

from p2p_diloco.config import Config, ConfigError, load_config
from p2p_diloco.training.inner import lr_at, schedule_horizon

pytestmark = pytest.mark.unit


def _lrs(cfg: Config, steps: range) -> list[float]:
    """The lr at each schedule step, with the horizon a peer's Training builds (training/part.py)."""
    return [lr_at(s, cfg.train, schedule_horizon(cfg)) for s in steps]


@pytest.mark.parametrize("total_steps", [0, 200])
def test_lr_at_a_schedule_step_does_not_depend_on_max_rounds(total_steps):
    base = [f"train.total_steps={total_steps}", "train.inner_steps=20", "train.warmup_steps=5"]
    runs = [load_config(None, [*base, f"run.max_rounds={r}"]) for r in (0, 2, 4, 10)]
    steps = range(0, 240)
    reference = _lrs(runs[0], steps)
    for cfg in runs[1:]:
        assert schedule_horizon(cfg) == total_steps
        assert _lrs(cfg, steps) == reference, cfg.run.max_rounds


def test_default_horizon_is_constant_lr_after_warmup():
    cfg = load_config(None, ["run.max_rounds=4"])
    assert schedule_horizon(cfg) == 0
    w = cfg.train.warmup_steps
    assert _lrs(cfg, range(w, 4 * cfg.train.inner_steps + 50)) == [cfg.train.lr] * (4 * cfg.train.inner_steps + 50 - w)


def test_total_steps_decays_by_cosine_to_the_floor():
    cfg = load_config(None, ["train.total_steps=100", "train.warmup_steps=10"])
    lrs = _lrs(cfg, range(10, 101))
    assert lrs[0] == cfg.train.lr and all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[-1] == pytest.approx(cfg.train.lr * cfg.train.min_lr_ratio)


def test_total_steps_is_fingerprinted_and_the_default_fingerprint_is_unchanged():
    assert Config().fingerprint() == "54f7714b4f25631b"  # total_steps = 0 is left out: old runs keep theirs
    assert "train.total_steps" not in Config().fingerprint_fields()
    a, b = load_config(None, ["train.total_steps=200"]), load_config(None, ["train.total_steps=400"])
    assert a.fingerprint_fields()["train.total_steps"] == 200
    assert len({Config().fingerprint(), a.fingerprint(), b.fingerprint()}) == 3
    # max_rounds is each peer's own business: it changes neither the fingerprint nor the schedule
    assert load_config(None, ["train.total_steps=200", "run.max_rounds=7"]).fingerprint() == a.fingerprint()


def test_negative_total_steps_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.total_steps must be >= 0 .*got -1"):
        load_config(None, ["train.total_steps=-1"])
