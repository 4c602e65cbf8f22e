"""Adaptive deadlines (p2p_diloco/protocol/deadlines.py): pure arithmetic, no network."""

import pytest

from p2p_diloco.config import Config, ConfigError
from p2p_diloco.config.checks import validate
from p2p_diloco.protocol.deadlines import Deadlines, RollingDeadline, StragglerWait

pytestmark = pytest.mark.unit


def test_rolling_deadline_uses_before_until_enough_samples_then_median_and_mad():
    d = RollingDeadline(floor=1.0, cap=100.0, before=100.0)
    d.observe(4.0)
    d.observe(6.0)
    assert d.value == 100.0  # two samples: still the constant
    d.observe(5.0)
    # median 5, MAD 1 -> 2 * (5 + 3 * 1) = 16
    assert d.value == pytest.approx(16.0)


def test_rolling_deadline_is_robust_to_one_outlier_and_clamped():
    d = RollingDeadline(floor=10.0, cap=60.0, before=60.0)
    for x in (1.0, 1.0, 1.0, 1.0, 500.0):
        d.observe(x)
    assert d.value == 10.0  # the median ignores the one bad round; the floor keeps it sane
    d = RollingDeadline(floor=1.0, cap=60.0, before=60.0)
    for x in (50.0, 50.0, 50.0):
        d.observe(x)
    assert d.value == 60.0  # never longer than the configured constant


def test_backoff_doubles_until_the_next_success():
    d = RollingDeadline(floor=8.0, cap=32.0, before=8.0)
    assert d.value == 8.0
    d.backoff()
    assert d.value == 16.0
    d.backoff()
    d.backoff()
    assert d.value == 32.0  # capped
    d.observe(1.0)
    assert d.value == 8.0


def test_fixed_mode_returns_the_constants():
    cfg = Config()
    cfg.swarm.deadlines = "fixed"
    d = Deadlines(cfg.swarm)
    for _ in range(5):
        d.straggler.observe(1.0)
        d.allreduce.observe(0.1)
    assert d.get("straggler") == cfg.swarm.round_timeout
    assert d.get("allreduce") == cfg.swarm.allreduce_timeout
    assert d.get("matchmaking") == cfg.swarm.matchmaking_time


def test_adaptive_mode_tracks_observed_times_within_floor_and_cap():
    cfg = Config()
    d = Deadlines(cfg.swarm)
    assert d.snapshot() == {"straggler_s": cfg.swarm.round_timeout, "allreduce_s": cfg.swarm.allreduce_timeout,
                            "matchmaking_s": cfg.swarm.matchmaking_time}
    for x in (20.0, 22.0, 21.0):
        d.straggler.observe(x)
        d.allreduce.observe(x / 10)
        d.matchmaking.observe(x)
    assert d.get("straggler") == pytest.approx(2 * (21 + 3 * 1))
    assert d.get("allreduce") == cfg.swarm.next_chunk_timeout  # 2 s transfers: the floor
    assert d.get("matchmaking") == 4 * cfg.swarm.matchmaking_time  # slow assembly: grows to its cap


def test_straggler_wait_waits_then_gives_up_once_and_records_arrivals():
    cfg = Config()
    d = Deadlines(cfg.swarm)
    for _ in range(3):
        d.straggler.observe(1.0)
    assert d.get("straggler") == cfg.swarm.straggler_floor
    wait = StragglerWait(d, now=100.0)
    assert wait.observe(["slow"], now=110.0) is False
    assert wait.observe(["slow"], now=131.0) is True
    assert wait.observe(["slow"], now=132.0) is False  # given up once
    wait = StragglerWait(d, now=200.0)
    wait.observe(["slow"], now=202.0)
    wait.observe([], now=205.0)
    wait.observe([], now=209.0)
    assert list(d.straggler.samples)[-1] == 5.0  # the arrival offset, recorded once
    wait = StragglerWait(d, now=300.0)
    wait.observe(["fast"], now=300.5)  # the records lag: the group assembled before they showed everyone in sync
    wait.averaged(now=301.5)
    assert list(d.straggler.samples)[-1] == 1.5
    wait = StragglerWait(d, now=400.0)
    wait.observe(["stuck"], now=431.0)  # left out: its arrival is not an observation
    wait.averaged(now=432.0)
    assert list(d.straggler.samples)[-1] == 1.5


@pytest.mark.parametrize("field,value", [("deadlines", "sometimes"), ("straggler_floor", 0.0),
                                         ("round_timeout", -1.0), ("next_chunk_timeout", 0.0)])
def test_bad_deadline_config_is_refused(field, value):
    cfg = Config()
    setattr(cfg.swarm, field, value)
    with pytest.raises(ConfigError, match=f"swarm.{field}"):
        validate(cfg)
