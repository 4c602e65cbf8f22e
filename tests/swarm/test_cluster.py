"""A peer that is a cluster (issue 8, p2p_diloco/cluster.py): torchrun with K local ranks on CPU (gloo), DDP
inside the peer, hivemind between peers, ``outer.sharding = "rank0"``.

* 2 peers x 2 ranks complete rounds with bit-identical global weights, and only rank 0 speaks (one join line).
* A 2-rank peer and a 1-rank peer average together.
* That mixed run matches the same run with 1 rank per peer up to float tolerance: the 2-rank peer computes each
  gradient as the mean of its two ranks' halves of the batch (DDP's all-reduce) instead of the mean over the whole
  batch, so the sums are taken in another order; nothing else differs (same data order, same rows, same tokens).
"""

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.launcher import parse_join_line
from tests.swarm.helpers import events_of, load_json, start_peers

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
ROUNDS = 3


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def _run(tmp_path, reap, run_id: str, ranks: dict[int, int]):
    """Two peers with fixed data orders (seeds 1 and 2). Returns their summaries, final theta, the theta of the
    round before (peer 0's) and the processes."""
    extra = {i: ["--set", f"data.seed={i + 1}", "--checkpoint-dir", str(tmp_path / f"ckpt{i}"),
                 "--set", "checkpoint.keep=5"] for i in range(2)}
    procs = start_peers(2, tmp_path, reap, run_id, rounds=ROUNDS, extra=extra, ranks=ranks)
    for p in procs:
        assert p.wait(240) == 0, p.stderr_tail()
    summaries = [load_json(tmp_path / f"p{i}.json") for i in range(2)]
    stores = [CheckpointStore(tmp_path / f"ckpt{i}", 5) for i in range(2)]
    thetas = [store.load().theta for store in stores]
    before = stores[0].load(stores[0].paths()[-2]).theta
    assert stores[0].load().round == ROUNDS and stores[0].load(stores[0].paths()[-2]).round == ROUNDS - 1
    return summaries, thetas, before, procs


def _check_synced(tmp_path, summaries, thetas, before, procs) -> None:
    assert [s["rounds_completed"] for s in summaries] == [ROUNDS, ROUNDS]
    assert summaries[0]["global_digest"] == summaries[1]["global_digest"]
    assert all(torch.equal(a, b) for a, b in zip(*thetas))
    for p in procs:  # every round averaged by both peers
        groups = [e["group_size"] for e in events_of(tmp_path, p) if e["event"] == "allreduce_done"]
        assert groups == [2] * ROUNDS, groups
        # rank 0 alone prints the join line (followers write nothing to stdout)
        assert sum(parse_join_line(line) is not None for line in p.lines) == 1, p.lines


def test_two_peers_of_two_ranks(tmp_path, reap):
    _check_synced(tmp_path, *_run(tmp_path, reap, "t-cluster-2x2", {0: 2, 1: 2}))


def test_mixed_rank_counts_match_one_rank_per_peer(tmp_path, reap):
    mixed = _run(tmp_path / "mixed", reap, "t-cluster-mixed", {0: 2, 1: 1})
    _check_synced(tmp_path / "mixed", *mixed)
    single = _run(tmp_path / "single", reap, "t-cluster-single", {0: 1, 1: 1})
    _check_synced(tmp_path / "single", *single)
    # the same tokens and the same rows on each peer: the rank layout only changes the order of float sums
    assert [s["tokens_trained"] for s in mixed[0]] == [s["tokens_trained"] for s in single[0]]
    got, want = _flat(mixed[1][0]), _flat(single[1][0])
    differ = float((got - want).norm() / want.norm())
    last_round = float((want - _flat(single[2])).norm() / want.norm())  # how far the last outer step moved theta
    print(f"theta: 2+1 ranks vs 1+1 ranks differ by {differ:.2e} (relative L2); "
          f"the last round moved it {last_round:.2e}")
    assert differ < 0.01 * last_round, (differ, last_round)
