"""The convergence benchmarks' own arithmetic: the in-process DiLoCo simulator used for outer-step sweeps must be
DiLoCo (checked against the cases where DiLoCo reduces to something simpler), or its sweeps mean nothing."""

import pytest

from benchmarks.convergence import local_arm
from benchmarks.outer_sweep import parse_outer, simulate
from p2p_diloco.config import load_config

pytestmark = pytest.mark.unit

MICRO = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
         "model.intermediate_size=64", "data.seq_len=32", "data.batch_size=2", "data.max_bytes=400000",
         "data.eval_fraction=0.2", "eval.batches=2", "train.warmup_steps=2"]


def test_one_worker_fedavg_is_plain_training():
    # N = 1 and outer lr 1, no momentum: theta(t) = the worker's weights, and the worker keeps its AdamW state
    # across rounds, so 3 rounds of H = 2 must be exactly 6 steps of one uninterrupted AdamW run.
    cfg = load_config(None, MICRO)
    curve = simulate(cfg, peers=1, steps=6, h=2, lr=1.0, momentum=0.0)
    single = local_arm("single", cfg, 1, 6, eval_every=2)
    assert len(curve) == 4
    assert curve == pytest.approx([loss for _, loss in single.curve], rel=0, abs=1e-5)


def test_the_outer_step_matters_and_momentum_is_applied():
    # Same data and inner steps, different outer steps: the trajectories must differ after round 1 (Nesterov's
    # first step is 1.9 x lr x delta, FedAvg's 1 x delta), and equal outer settings must give equal trajectories.
    cfg = load_config(None, MICRO)
    fedavg = simulate(cfg, peers=2, steps=4, h=2, lr=1.0, momentum=0.0)
    nesterov = simulate(cfg, peers=2, steps=4, h=2, lr=0.7, momentum=0.9)
    assert fedavg[0] == nesterov[0] and fedavg[1] != nesterov[1]
    assert simulate(cfg, peers=2, steps=4, h=2, lr=0.7, momentum=0.9) == nesterov


def test_parse_outer():
    assert parse_outer("0.7:0.9") == (0.7, 0.9) and parse_outer("1.0") == (1.0, 0.0)


def test_the_simulator_sends_through_the_codec():
    # fp32 "none" changes nothing; int4 changes the trajectory, a little; topk (error feedback) much more
    from p2p_diloco.outer.codecs import get_codec

    cfg = load_config(None, MICRO)
    plain = simulate(cfg, peers=2, steps=4, h=2, lr=1.0, momentum=0.0)
    assert simulate(cfg, peers=2, steps=4, h=2, lr=1.0, momentum=0.0, codec=get_codec("none")) == plain
    int4 = simulate(cfg, peers=2, steps=4, h=2, lr=1.0, momentum=0.0, codec=get_codec("int4"))
    topk = simulate(cfg, peers=2, steps=4, h=2, lr=1.0, momentum=0.0, codec=get_codec("topk"))
    assert int4[1] != plain[1] and int4 == pytest.approx(plain, abs=0.05)
    assert abs(topk[-1] - plain[-1]) > abs(int4[-1] - plain[-1])


def test_the_quick_run_has_the_h5_int4_arm():
    from benchmarks.convergence import swarm_arms

    arms = {name: (h, extra) for name, h, extra in swarm_arms(20, 100, paper=False)}
    assert arms["diloco-h5-int4"] == (5, ["outer.compression=int4"])


def test_overlap_with_one_worker_and_fedavg_is_plain_training():
    # N = 1, outer lr 1, no momentum: the look-ahead of theta(r) with the worker's own pseudo-gradient is the
    # worker's own weights, so it trains on uninterrupted, and theta(R), landed last, is where it ended
    from benchmarks.outer_sweep import simulate_overlap

    cfg = load_config(None, MICRO)
    single = local_arm("single", cfg, 1, 6, eval_every=2)
    for start in ("own", "eager"):
        curve = simulate_overlap(cfg, peers=1, steps=6, h=2, lr=1.0, momentum=0.0, start=start)
        assert len(curve) == 4 and curve[-1] == pytest.approx(single.curve[-1][1], rel=0, abs=1e-5)
    stale = simulate_overlap(cfg, peers=1, steps=6, h=2, lr=1.0, momentum=0.0, start="stale")
    assert stale[-1] != pytest.approx(single.curve[-1][1], rel=0, abs=1e-5)  # restarting from theta(r) loses a round


def test_streaming_with_one_fragment_no_delay_and_no_merge_is_blocking_diloco():
    # F = 1, alpha = 0, delay 0: every H steps the whole model is synced and the workers restart from theta: the
    # blocking simulator's trajectory exactly; F = 2 is another trajectory
    from benchmarks.outer_sweep import simulate_streaming

    cfg = load_config(None, MICRO)
    blocking = simulate(cfg, peers=2, steps=4, h=2, lr=0.7, momentum=0.9)
    assert simulate_streaming(cfg, 2, 4, 2, 0.7, 0.9, fragments=1, alpha=0.0, delay=0) == blocking
    streaming = simulate_streaming(cfg, 2, 4, 2, 0.7, 0.9, fragments=2, alpha=0.5, delay=1)
    assert len(streaming) == len(blocking) and streaming[-1] != blocking[-1]
    with pytest.raises(ValueError, match="multiple of F"):
        simulate_streaming(cfg, 2, 4, 2, 0.7, 0.9, fragments=2, alpha=0.5, delay=2)


def test_streaming_with_one_fragment_and_topk_is_the_blocking_topk_simulation():
    # the same with a codec: each fragment's error feedback, with F = 1, is the blocking simulator's one
    from benchmarks.outer_sweep import simulate_streaming
    from p2p_diloco.outer.codecs import get_codec

    cfg = load_config(None, MICRO)
    codec = get_codec("topk", 1 / 64, 2)
    blocking = simulate(cfg, peers=2, steps=6, h=2, lr=4.0, momentum=0.0, codec=codec, decay=0.95)
    assert simulate_streaming(cfg, 2, 6, 2, 4.0, 0.0, fragments=1, alpha=0.0, delay=0, codec=codec,
                              decay=0.95) == blocking
    assert blocking != simulate(cfg, peers=2, steps=6, h=2, lr=4.0, momentum=0.0)


def test_overlap_benchmark_arms_and_verdict():
    from benchmarks.overlap import arms_of, verdict

    arms = {name: (f, sets) for name, f, sets in arms_of([2, 4], (0.7, 0.9))}
    assert list(arms) == ["blocking", "eager", "streaming-f2", "streaming-f4"]
    assert arms["blocking"] == (1, []) and arms["eager"] == (1, ["outer.overlap=true"])
    assert arms["streaming-f4"] == (4, ["outer.overlap=true", "outer.fragments=4", "outer.lr=0.7",
                                        "outer.momentum=0.9"])
    rows = [{"arm": "blocking", "loss": 2.0, "utilization": 0.7}, {"arm": "eager", "loss": 2.2, "utilization": 0.9},
            {"arm": "streaming-f2", "error": "x"}, {"arm": "streaming-f4", "loss": 2.01, "utilization": 0.96}]
    assert verdict(rows) == (pytest.approx(1.005), 0.96, "streaming-f4")
    y, _, name = verdict(rows[1:])
    assert name == "-" and y != y  # no blocking arm: nan


def test_compression_benchmark_topk_arms_take_sparselocos_outer_step():
    from benchmarks.compression import arms_of

    from p2p_diloco.config import load_config

    arms = dict(arms_of([1 / 64, 1 / 32], 2, ["outer.lr=2"]))
    assert list(arms) == ["fp32", "int8", "int4", "topk-0.0156-2bit", "topk-0.0312-2bit"]
    fine = load_config(None, arms["topk-0.0156-2bit"][:-1])  # without the --topk-set item
    assert (fine.outer.lr, fine.outer.momentum, fine.outer.topk_error_decay) == (8.0, 0.0, 0.95)
    assert load_config(None, arms["topk-0.0312-2bit"]).outer.lr == 2.0  # a --topk-set item comes last: it wins
    assert load_config(None, arms["int4"]).outer == load_config(None, ["outer.compression='int4'"]).outer
