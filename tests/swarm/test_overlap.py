"""outer.overlap: the all-reduce of round r runs while the peers train round r+1; theta stays bit-identical, and
the fault rules still hold (a joiner, a peer killed while its all-reduce runs in the background)."""

import pytest

from tests.conftest import survivors
from tests.swarm.helpers import (FAST, FAULT, Proc, digests_by_round, eval_by_round, events_of, load_json,
                                 start_peers, wait_for_event)
from p2p_diloco.metrics import read_events

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]
OVERLAP = ["--set", "outer.overlap=true"]


def _overlapped(events: list[dict], r: int) -> bool:
    """Round r's all-reduce finished after this peer had started training round r+1."""
    started = [e["t"] for e in events if e["event"] == "round_start" and e["round"] == r + 1]
    done = [e["t"] for e in events if e["event"] == "allreduce_done" and e["round"] == r]
    return bool(started and done) and done[-1] > started[0]


def test_overlapped_swarm_is_bit_identical_and_hides_the_sync(tmp_path, reap):
    summary = tmp_path / "summary.json"
    swarm = Proc(["swarm", "--peers", "3", "--max-rounds", "4", "--log-dir", str(tmp_path / "logs"),
                  "--summary-json", str(summary), "--run-id", "t-overlap", *FAST, *OVERLAP,
                  "--set", "outer.compression=int8"], reap)
    assert swarm.wait(300) == 0, swarm.stderr_tail() + "".join(swarm.lines[-20:])
    result = load_json(summary)
    assert result["all_digests_equal"] is True and len(result["peers"]) == 3
    per_round: dict[int, set[str]] = {}
    for peer in result["peers"]:
        assert peer["rounds_completed"] == 4 and peer["rounds_participated"] == 4
        assert peer["eval_loss_last"] < peer["eval_loss_first"]
        events = read_events(tmp_path / "logs" / peer["peer_id"] / "events.jsonl")
        steps = [e for e in events if e["event"] == "outer_step"]
        assert [e["round"] for e in steps] == [1, 2, 3, 4]
        for e in steps:
            per_round.setdefault(e["round"], set()).add(e["digest"])
        assert [e["group_size"] for e in events if e["event"] == "allreduce_done"] == [3, 3, 3, 3]
        # Inner steps for the last round are not trained (theta(4) is the last one): 4 rounds of training.
        assert len([e for e in events if e["event"] == "round_start"]) == 4
        assert any(_overlapped(events, r) for r in (1, 2, 3)), "no all-reduce ran behind inner steps"
        assert sorted(eval_by_round(events)) == [0, 1, 2, 3, 4]
    assert all(len(d) == 1 for d in per_round.values()), per_round
    assert not survivors(reap)


def test_overlap_survives_a_joiner_and_a_kill(tmp_path, reap):
    """Two overlapped peers; a third joins mid-run and averages with them; then one of the first two is killed
    while its all-reduce runs in the background. The other two finish with one digest and no solo step."""
    rounds = 10
    # Rounds of a few seconds (H = 50): a newcomer needs a moment (download, eval) to fall in step with them.
    slower = [*OVERLAP, "--inner-steps", "50"]
    a, b = start_peers(2, tmp_path, reap, "t-overlap-faults", rounds=rounds, extra={0: slower, 1: slower})
    wait_for_event(tmp_path / a.peer_id / "events.jsonl", lambda e: e["event"] == "outer_step" and e["round"] >= 2,
                   240, a)
    c = Proc(["join", "--initial-peers", *a.wait_joined(), "--run-id", "t-overlap-faults", "--max-rounds",
              str(rounds), "--log-dir", str(tmp_path), "--summary-json", str(tmp_path / "p2.json"),
              *FAULT, *slower], reap)
    c.wait_joined()
    wait_for_event(tmp_path / c.peer_id / "events.jsonl",
                   lambda e: e["event"] == "allreduce_done" and e["group_size"] == 3, 240, c)
    wait_for_event(tmp_path / b.peer_id / "events.jsonl",
                   lambda e: e["event"] == "allreduce_start" and e["expected_group_size"] == 3, 240, b)
    b.kill_group()
    for p in (a, c):
        assert p.wait(300) == 0, p.stderr_tail()
    sa, sc = load_json(tmp_path / "p0.json"), load_json(tmp_path / "p2.json")
    assert sa["rounds_completed"] == sc["rounds_completed"] == rounds
    assert sa["global_digest"] == sc["global_digest"]
    assert any(e["event"] == "state_loaded" for e in events_of(tmp_path, c))
    per_round = digests_by_round(tmp_path, [a, c])
    assert all(len(d) == 1 for d in per_round.values()), per_round
    for p in (a, c):
        lone = [e for e in events_of(tmp_path, p) if e["event"] == "allreduce_done" and e.get("lone")]
        assert not lone, lone
    assert not survivors(reap)
