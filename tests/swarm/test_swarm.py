"""Real swarms: subprocess peers on 127.0.0.1 (each in its own process group), real DHTs and all-reduces. (A late
joiner, and every other protocol scenario: tests/sim; a real state download: tests/swarm/test_cluster.py.)"""

import signal
import sys
import time

import psutil
import pytest

from p2p_diloco.metrics.events import Event
from tests.conftest import survivors, tagged_processes
from tests.swarm.helpers import FAST, Proc, eval_by_round, load_json, planned_first
from p2p_diloco.metrics import read_events

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(420)]


def test_three_peer_swarm_bit_identical_and_learning(tmp_path, reap):
    """`p2p-diloco swarm --peers 3`: every peer in every round, equal digests, eval loss falls each round."""
    summary = tmp_path / "summary.json"
    swarm = Proc(["swarm", "--peers", "3", "--max-rounds", "3", "--inner-steps", "20", "--log-dir",
                  str(tmp_path / "logs"), "--summary-json", str(summary), "--run-id", "t-three", *FAST], reap)
    assert swarm.wait(300) == 0, swarm.stderr_tail() + "".join(swarm.lines[-20:])
    result = load_json(summary)
    assert result["all_digests_equal"] is True
    assert len(result["peers"]) == 3
    assert len({p["global_digest"] for p in result["peers"]}) == 1
    heads = {p["chain_head"] for p in result["peers"]}  # one certified history, signed over the real DHT
    assert len(heads) == 1 and "" not in heads, heads
    certificates = set()
    for peer in result["peers"]:
        assert peer["rounds_completed"] == 3 and peer["rounds_participated"] == 3
        assert peer["eval_loss_last"] < peer["eval_loss_first"]
        assert peer["bytes_sent"] > 0 and peer["bytes_received"] > 0
        events = read_events(tmp_path / "logs" / peer["peer_id"] / "events.jsonl")
        losses = eval_by_round(events)
        assert [r for r in sorted(losses)] == [0, 1, 2, 3]
        assert all(losses[r + 1] < losses[r] for r in range(3)), losses
        done = [e for e in events if e["event"] == Event.ALLREDUCE_DONE]
        assert [e["group_size"] for e in done] == [3, 3, 3]
        assert all(e["bytes_sent"] > 0 and e["seconds"] >= 0 for e in done)
        steps = [e for e in events if e["event"] == Event.OUTER_STEP]
        assert [e["round"] for e in steps] == [1, 2, 3]
        assert [e["signers"] for e in steps] == [3, 3, 3]
        certificates.add(tuple(e["certificate"] for e in steps))
        for e in events:
            assert {"t", "event", "round"} <= set(e)
    assert len(certificates) == 1 and heads == {certificates.pop()[-1]}
    # the same global weights after every round on every peer
    per_round = {}
    for peer in result["peers"]:
        for e in read_events(tmp_path / "logs" / peer["peer_id"] / "events.jsonl"):
            if e["event"] == Event.OUTER_STEP:
                per_round.setdefault(e["round"], set()).add(e["digest"])
    assert all(len(d) == 1 for d in per_round.values()), per_round
    assert "all digests agree: yes" in "".join(swarm.lines)
    for err in [swarm.stderr_tail(10**6), *((tmp_path / "logs" / f"peer{i}.stderr.log").read_text() for i in range(3))]:
        assert "Traceback" not in err and "ERROR" not in err, err  # a healthy run: hivemind's retries are not errors
    assert not survivors(reap), "processes survived a finished swarm"


@pytest.mark.light
def test_mismatched_config_is_refused(tmp_path, reap):
    first = Proc(["join", "--run-id", "t-mismatch", *FAST], reap)
    maddrs = first.wait_joined()
    t0 = time.monotonic()
    other = Proc(["join", "--initial-peers", *maddrs, "--run-id", "t-mismatch", "--set", "model.num_layers=3",
                  *FAST], reap)
    assert other.wait(60) == 2
    assert time.monotonic() - t0 < 60
    err = other.stderr_tail()
    assert "model.num_layers: ours 3, theirs 2" in err and "different config" in err
    assert len([line for line in other.err_lines if line.strip()]) == 1, err
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143  # 128 + SIGTERM, after a clean stop
    assert not survivors(reap)


@pytest.mark.light
def test_unreachable_initial_peer_fails_fast(reap):
    t0 = time.monotonic()
    unreachable = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"
    proc = Proc(["join", "--initial-peers", unreachable], reap)
    assert proc.wait(60) == 2
    assert time.monotonic() - t0 < 45
    assert len([line for line in proc.err_lines if line.strip()]) == 1, proc.stderr_tail()
    assert "could not start or join the swarm" in proc.stderr_tail()
    assert f"no initial peer answered (tried {unreachable})" in proc.stderr_tail()  # the address, and what to check
    assert not survivors(reap)


@pytest.mark.light
def test_a_joiner_started_before_its_initial_peer_waits_for_it(tmp_path, reap):
    """``--initial-peers-wait``: the joiner's first tries find nothing listening (its p2pd came and went at least
    once before the initial peer is even started); it keeps trying, joins, and the two average their round. (Its
    failed tries end their DHT process without leaving hivemind's shared lock held: before, the next try hung.)"""
    first_args, joining = planned_first(tmp_path)
    common = ["--run-id", "t-wait", "--max-rounds", "1", "--log-dir", str(tmp_path), "--set", "swarm.min_peers=2",
              *FAST, "--inner-steps", "10"]
    joiner = Proc(["join", *joining, *common, "--summary-json", str(tmp_path / "p1.json")], reap)
    deadline = time.monotonic() + 90
    while not _runs_p2pd(joiner.pid):  # a try under way: it will fail
        assert time.monotonic() < deadline and joiner.poll() is None, joiner.stderr_tail()
        time.sleep(0.02)
    while _runs_p2pd(joiner.pid):  # ... and it did
        assert time.monotonic() < deadline and joiner.poll() is None, joiner.stderr_tail()
        time.sleep(0.02)
    first = Proc(["join", *first_args, *common, "--summary-json", str(tmp_path / "p0.json")], reap)
    for p in (first, joiner):
        assert p.wait(120) == 0, p.stderr_tail()
    summaries = [load_json(tmp_path / f"p{i}.json") for i in range(2)]
    assert [s["rounds_participated"] for s in summaries] == [1, 1]
    assert summaries[0]["global_digest"] == summaries[1]["global_digest"] != ""
    assert not survivors(reap)


def _runs_p2pd(pid: int) -> bool:
    """Whether a p2pd runs under ``pid`` now."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return False
    for child in children:
        try:
            if child.name() == "p2pd":
                return True
        except psutil.Error:  # ended meanwhile
            pass
    return False


# Starts a command with SIGINT ignored, as a non-interactive shell starts a background job (`cmd &`).
IGNORE_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                 "os.execvp(sys.argv[1], sys.argv[1:])"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_swarm_leaves_no_process(tmp_path, reap, sig):
    """Ctrl-C (or SIGTERM) on `p2p-diloco swarm` stops every peer; no python, DHT, averager or p2pd process
    survives. The launcher is started with SIGINT ignored, as `p2p-diloco swarm &` from a script would be: it
    failed then (CI, started in the background: the SIGINT did nothing), and SIGTERM killed it without stopping
    the peers."""
    swarm = Proc(["swarm", "--peers", "2", "--inner-steps", "10", "--log-dir", str(tmp_path), "--run-id", "t-int",
                  *FAST], reap, prefix=IGNORE_SIGINT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
            e["event"] == Event.OUTER_STEP for f in tmp_path.glob("*/events.jsonl") for e in read_events(f)):
        time.sleep(0.5)
    procs = tagged_processes(reap)
    assert sum("p2pd" in " ".join(p.cmdline()) for p in procs) >= 2, [p.cmdline() for p in procs]
    swarm.signal(sig)
    assert swarm.wait(90) == 128 + sig  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
    assert not survivors(reap)


def test_a_topk_swarm_is_bit_identical_and_sends_what_the_codec_says(tmp_path, reap):
    """outer.compression = topk over the TCP data plane (3 real peers): one digest per round on every peer, and each
    all-reduce moves what the codec's format says, 2(N-1)/N of the encoded model, within 10 %."""
    from p2p_diloco.config import load_config
    from p2p_diloco.outer.codecs import codec_for
    from p2p_diloco.training.model import build_model, count_parameters
    from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

    sets = ["outer.compression='topk'", "outer.aggregation='mean'"]
    summary = tmp_path / "summary.json"
    swarm = Proc(["swarm", "--peers", "3", "--max-rounds", "2", "--inner-steps", "10", "--log-dir",
                  str(tmp_path / "logs"), "--summary-json", str(summary), "--run-id", "t-topk", *FAST,
                  *(a for s in sets for a in ("--set", s))], reap)
    assert swarm.wait(300) == 0, swarm.stderr_tail() + "".join(swarm.lines[-20:])
    result = load_json(summary)
    assert result["all_digests_equal"] is True and len(result["peers"]) == 3
    cfg = load_config(None, sets)
    params = count_parameters(build_model(cfg.model, vocab_size(build_tokenizer(cfg.tokenizer)), 0))
    expected = 2 * (3 - 1) / 3 * codec_for(cfg.outer).payload_bytes(params)
    assert expected < params * 4 / 100  # the encoded model is over 100x smaller than fp32
    _assert_rounds_and_bytes(tmp_path, result, 2, expected)
    assert not survivors(reap), "processes survived a finished swarm"


def test_a_streaming_swarm_is_bit_identical_and_sends_one_fragment_a_round(tmp_path, reap):
    """outer.fragments = 2 with outer.overlap (Streaming DiLoCo, 3 real peers): one digest per round on every peer,
    every round committed by the whole group, and each all-reduce moves 2(N-1)/N of the largest fragment in fp32
    (about half the model), within 10 %."""
    from p2p_diloco.config import load_config
    from p2p_diloco.outer.fragments import partition
    from p2p_diloco.training.model import build_model
    from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

    sets = ["outer.fragments=2", "outer.overlap=true"]
    summary = tmp_path / "summary.json"
    swarm = Proc(["swarm", "--peers", "3", "--max-rounds", "3", "--inner-steps", "10", "--log-dir",
                  str(tmp_path / "logs"), "--summary-json", str(summary), "--run-id", "t-fragments", *FAST,
                  *(a for s in sets for a in ("--set", s))], reap)
    assert swarm.wait(300) == 0, swarm.stderr_tail() + "".join(swarm.lines[-20:])
    result = load_json(summary)
    assert result["all_digests_equal"] is True and len(result["peers"]) == 3
    cfg = load_config(None, sets)
    params = list(build_model(cfg.model, vocab_size(build_tokenizer(cfg.tokenizer)), 0).parameters())
    largest = max(sum(params[i].numel() for i in run) for run in partition(params, 2))
    assert largest < 0.51 * sum(p.numel() for p in params)
    expected = 2 * (3 - 1) / 3 * 4 * largest
    _assert_rounds_and_bytes(tmp_path, result, 3, expected)
    assert not survivors(reap), "processes survived a finished swarm"


def _assert_rounds_and_bytes(tmp_path, result: dict, rounds: int, expected: float) -> None:
    """Every peer of a 3-peer run did rounds 1..``rounds`` with the whole group, each all-reduce sent and received
    ``expected`` bytes within 10 %, and every round has one digest on every peer."""
    per_round = {}
    for peer in result["peers"]:
        assert peer["rounds_completed"] == peer["rounds_participated"] == rounds
        events = read_events(tmp_path / "logs" / peer["peer_id"] / "events.jsonl")
        done = [e for e in events if e["event"] == Event.ALLREDUCE_DONE]
        assert [e["group_size"] for e in done] == [3] * rounds
        for e in done:
            for key in ("bytes_sent", "bytes_received"):
                assert abs(e[key] - expected) < 0.1 * expected, (key, e[key], expected)
        for e in events:
            if e["event"] == Event.OUTER_STEP:
                per_round.setdefault(e["round"], set()).add(e["digest"])
    assert sorted(per_round) == list(range(1, rounds + 1)), per_round
    assert all(len(d) == 1 for d in per_round.values()), per_round
