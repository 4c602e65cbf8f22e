"""The closed forms of ``python -m benchmarks.protocol_sim --scale N`` (issue 20): the figures docs/scale.md
projects to N = 100 and 1,000 come from them, so they are checked against numbers worked out by hand and against
a Monte Carlo of the process they describe."""

import math
import random

import pytest

from benchmarks._protocol_sim_scale import (DAY, GBIT, death_times, expected, lost_work, members_cap,
                                            p_death_during, sync_seconds)

pytestmark = pytest.mark.unit


def test_sync_seconds_is_the_butterfly_formula_of_docs_scale():
    # docs/scale.md: 30B int8 (1.031 B/param) at N = 4 sends 46.4 GB per peer, 371 s at 1 Gbit/s
    assert sync_seconds(30e9, 1.031, GBIT, 4) == pytest.approx(371.2, abs=0.5)
    # uncompressed 30B at N = 1,000: 2 x 0.999 x 120 GB = 239.8 GB, 32 minutes: the "30-minute sync"
    assert sync_seconds(30e9, 4.0, GBIT, 1000) == pytest.approx(1918.1, abs=0.5)
    assert sync_seconds(30e9, 4.0, GBIT, 1) == 0.0
    with pytest.raises(ValueError):
        sync_seconds(1e9, 4.0, 0.0, 4)


def test_a_death_during_a_30_minute_sync_at_1000_peers_is_certain():
    p = p_death_during(1000, 1.0, 1800.0)
    assert 1 - p == pytest.approx(math.exp(-1000 * 0.5 / 24))  # e^-20.8
    assert p_death_during(1, 1.0, DAY) == pytest.approx(1 - math.exp(-1))
    assert p_death_during(100, 0.0, 1800.0) == 0.0


def test_restart_from_zero_matches_a_monte_carlo():
    # N = 100, 1 death per peer-day, S = 1800 s, D = 12 s: simulate "restart the transfer from zero after each
    # death, D seconds later" and compare the mean completion time with the closed form
    n, s, d = 100, 1800.0, 12.0
    e = expected(n, s, 1.0, d, 3600.0)
    lam = n / DAY
    rng, total, runs = random.Random(7), 0.0, 20000
    for _ in range(runs):
        t = 0.0
        while True:
            x = rng.expovariate(lam)
            if x >= s:
                t += s
                break
            t += x + d
        total += t
    assert e.attempts_restart == pytest.approx(math.exp(lam * s))
    # (e^{lam S} - 1)(1/lam + D) is the whole time, the last (clean) attempt included: S when lam -> 0
    assert total / runs == pytest.approx(e.sync_restart_s, rel=0.03)


def test_with_the_goal_a_sync_grows_by_each_deaths_share():
    e = expected(1000, 1800.0, 1.0, 12.0, 3600.0)
    assert e.lam_s == pytest.approx(20.83, abs=0.01)
    assert e.sync_share_s == pytest.approx(1800 + 20.833 * (12 + 1.8), abs=0.5)
    assert expected(1000, 1800.0, 24.0, 12.0, 3600.0).sync_restart_s > 1e200  # e^500: never, in practice
    assert math.isinf(expected(1000, 1800.0, 48.0, 12.0, 3600.0).sync_restart_s)  # e^1000 overflows: never
    assert expected(10, 60.0, 0.0, 12.0, 3600.0).sync_restart_s == 60.0  # no churn: the sync itself


def test_lost_work_is_about_rate_times_half_a_round_plus_the_sync():
    r = 1.0 / DAY
    assert lost_work(r, 3600.0, 1800.0) == pytest.approx(r * (1800 + 1800), rel=0.05)
    assert lost_work(0.0, 3600.0, 1800.0) == 0.0
    assert lost_work(r, 3600.0, math.inf) == 1.0
    # Monte Carlo of one peer-round: die at T ~ Exp(r); steps run min(T, C)/C; lost all of them if T < C + S
    rng, run, lost, r = random.Random(3), 0.0, 0.0, 4.0 / DAY
    for _ in range(200000):
        t = rng.expovariate(r)
        steps = min(t, 3600.0) / 3600.0
        run += steps
        lost += steps if t < 3600.0 + 1800.0 else 0.0
    assert lost_work(r, 3600.0, 1800.0) == pytest.approx(lost / run, rel=0.03)


def test_death_times_are_poisson_and_replayable():
    a = death_times(1000, 1.0, 3600.0, seed=5)
    assert a == death_times(1000, 1.0, 3600.0, seed=5)
    assert a == sorted(a) and len({i for _, i in a}) == len(a)
    # expected 1000 x (1 - e^{-1/24}) = 40.8 deaths in the first hour
    counts = [len(death_times(1000, 1.0, 3600.0, seed=s)) for s in range(200)]
    assert sum(counts) / len(counts) == pytest.approx(1000 * -math.expm1(-1 / 24), rel=0.05)
    assert death_times(10, 0.0, 3600.0, seed=1) == []


def test_members_cap_is_lifted_only_inside_the_block():
    from p2p_diloco.protocol import certificate, commit
    from p2p_diloco.swarm import port

    before = certificate.MAX_MEMBERS, commit.MAX_MEMBERS, certificate.MAX_BYTES, port.BLOB_MAX_BYTES["cert"]
    with members_cap(1000):
        assert certificate.MAX_MEMBERS == commit.MAX_MEMBERS == 1000
        assert certificate.MAX_BYTES == port.BLOB_MAX_BYTES["cert"] >= before[2] * 1000 // 64
    with members_cap(None):
        assert certificate.MAX_MEMBERS == before[0]
    assert (certificate.MAX_MEMBERS, commit.MAX_MEMBERS, certificate.MAX_BYTES,
            port.BLOB_MAX_BYTES["cert"]) == before


def test_merge_sums_runs_of_other_seeds():
    from benchmarks._protocol_sim_scale import Measured, merge

    a = Measured(64, 2, 3, 100, 90, 1, 4, group_sizes=[60, 59], forks=0, commits=110, solo=0,
                 round_ends=[5400.0, 10800.0], end_s=10800.0, finished=True, wall_s=10.0, cpu_s=9.0, peak_rss_mib=500.0)
    b = Measured(64, 1, 5, 60, 30, 2, 0, group_sizes=[58], forks=1, commits=3, solo=2, round_ends=[7000.0],
                 end_s=20000.0, finished=False, wall_s=20.0, cpu_s=19.0, peak_rss_mib=600.0)
    m = merge([a, b])
    assert (m.rounds, m.deaths, m.steps_run, m.steps_reached, m.failed_transfers, m.failed_matchmaking) == \
        (3, 8, 160, 120, 3, 4)
    assert m.group_sizes == [60, 59, 58] and m.end_s == 30800.0 and not m.finished
    assert (m.forks, m.commits, m.solo) == (1, 113, 2)
    assert m.peak_rss_mib == 600.0 and m.lost_work == pytest.approx(0.25) and m.restarts_per_round == 1.0


def test_the_command_line_runs_a_small_scale_profile(capsys):
    from benchmarks.protocol_sim import main

    assert main(["--scale", "1"]) == 2
    assert "--scale needs N >= 2" in capsys.readouterr().err
    assert main(["--scale", "3", "--rounds", "1", "--compute-s", "60", "--sync-s", "5",
                 "--deaths-per-day", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "n=3 rounds=1 lost_work=0.000 restarts_per_round=0.00"
    assert any("committed group sizes [3]" in line for line in lines)
    assert any("forks) 0" in line for line in lines)
