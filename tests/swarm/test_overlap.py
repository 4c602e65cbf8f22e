"""outer.overlap with real peers: the all-reduce of round r runs in a background thread (real DHT and averager
calls from two threads) while the peers train round r+1; theta stays bit-identical. (A joiner and a kill with
overlap: tests/sim/test_rounds.py.)"""

import pytest

from p2p_diloco.metrics.events import Event
from tests.conftest import survivors
from tests.swarm.helpers import FAST, Proc, eval_by_round, load_json
from p2p_diloco.metrics import read_events

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]
OVERLAP = ["--set", "outer.overlap=true"]


def _overlapped(events: list[dict], r: int) -> bool:
    """Round r's all-reduce finished after this peer had started training round r+1."""
    started = [e["t"] for e in events if e["event"] == Event.ROUND_START and e["round"] == r + 1]
    done = [e["t"] for e in events if e["event"] == Event.ALLREDUCE_DONE and e["round"] == r]
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
        steps = [e for e in events if e["event"] == Event.OUTER_STEP]
        assert [e["round"] for e in steps] == [1, 2, 3, 4]
        for e in steps:
            per_round.setdefault(e["round"], set()).add(e["digest"])
        assert [e["group_size"] for e in events if e["event"] == Event.ALLREDUCE_DONE] == [3, 3, 3, 3]
        # Inner steps for the last round are not trained (theta(4) is the last one): 4 rounds of training.
        assert len([e for e in events if e["event"] == Event.ROUND_START]) == 4
        assert any(_overlapped(events, r) for r in (1, 2, 3)), "no all-reduce ran behind inner steps"
        assert sorted(eval_by_round(events)) == [0, 1, 2, 3, 4]
    assert all(len(d) == 1 for d in per_round.values()), per_round
    assert not survivors(reap)
