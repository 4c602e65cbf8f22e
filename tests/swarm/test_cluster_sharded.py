"""Sharded outer state across peers of different rank layouts (``outer.sharding = "sharded"``, torchrun on CPU):
each rank keeps, averages and downloads its own logical shards (p2p_diloco/local/sharded_ranks.py)."""

import pytest

from p2p_diloco.cli.launcher import parse_join_line
from p2p_diloco.metrics.events import Event
from tests.swarm.helpers import (FAULT, Proc, digests_by_round, events_of, load_json, planned_first, torchrun_args,
                                 wait_for_event)

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(420)]


SHARDED = ["--set", "outer.sharding=sharded", "--set", "outer.shards=3"]  # 3: shards cut inside parameters


@pytest.mark.timeout(420)
def test_sharded_peers_of_any_layout_average_and_catch_up(tmp_path, reap):
    """Sharded outer state: a 1-rank peer (keeps all 3 shards) and a 2-rank FSDP peer (rank 0 keeps shards 0 and 2,
    rank 1 shard 1) train together; a 2-rank DDP peer joins late and downloads the state shard by shard (each of
    its ranks from the process of the donor that keeps the shard), then the three average. Every outer step leaves
    every peer with the same global digest, and only rank 0 speaks."""
    rounds = 6  # slow enough rounds (6 s) that the late peer, started after round 1, still has rounds to average
    common = ["--run-id", "t-sharded", "--max-rounds", str(rounds), "--log-dir", str(tmp_path), *FAULT, *SHARDED,
              "--set", "debug.step_delay=0.3"]
    first_args, joining = planned_first(tmp_path)
    first = Proc(["join", *first_args, *common, "--set", "swarm.min_peers=2", "--summary-json",
                  str(tmp_path / "p0.json")], reap)
    second = Proc(["join", *joining, *common, "--set", "swarm.min_peers=2", "--set", "train.parallelism=fsdp",
                   "--summary-json", str(tmp_path / "p1.json")], reap, python_args=torchrun_args(2))
    maddrs = first.wait_joined()
    second.wait_joined()
    wait_for_event(tmp_path / first.peer_id / "events.jsonl",
                   lambda e: e["event"] == Event.OUTER_STEP and e["round"] >= 1, 150, first)
    late = Proc(["join", "--initial-peers", *maddrs, *second.join_maddrs, *common, "--set", "train.parallelism=ddp",
                 "--summary-json", str(tmp_path / "p2.json")], reap, python_args=torchrun_args(2))
    procs = [first, second, late]
    for p in procs:
        assert p.wait(300) == 0, p.stderr_tail(400)
    summaries = [load_json(tmp_path / f"p{i}.json") for i in range(3)]
    assert [s["rounds_completed"] for s in summaries] == [rounds] * 3
    assert len({s["global_digest"] for s in summaries}) == 1
    by_round = digests_by_round(tmp_path, procs)
    assert all(len(d) == 1 for d in by_round.values()), by_round
    late_events = events_of(tmp_path, late)
    loaded = [e for e in late_events if e["event"] == Event.STATE_LOADED]
    assert loaded and loaded[0]["round"] >= 1, late_events  # caught up by download, not by training from scratch
    groups = [e["group_size"] for e in late_events if e["event"] == Event.ALLREDUCE_DONE]
    assert groups and all(g == 3 for g in groups), groups  # after the download: every round with all three
    for p in procs:
        assert sum(parse_join_line(line) is not None for line in p.lines) == 1, p.lines
