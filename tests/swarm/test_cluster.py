"""A peer that is a cluster (issue 8, p2p_diloco/cluster.py): torchrun with K local ranks on CPU (gloo), DDP or
FSDP2 inside the peer, hivemind between peers, ``outer.sharding = "rank0"``.

* 2 peers x 2 ranks complete rounds with bit-identical global weights, and only rank 0 speaks (one join line).
* A 2-rank peer and a 1-rank peer average together.
* That mixed run matches the same run with 1 rank per peer up to float tolerance: the 2-rank peer computes each
  gradient as the mean of its two ranks' halves of the batch (DDP's all-reduce, FSDP's reduce-scatter) instead of
  the mean over the whole batch, so the sums are taken in another order; FSDP also computes the gradient norm
  for clipping and the AdamW update on shards. Nothing else differs (same data order, same rows, same tokens).
"""

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.launcher import parse_join_line
from tests.swarm.helpers import FAULT, Proc, events_of, load_json, start_peers, torchrun_args

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
ROUNDS = 3


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def _run(tmp_path, reap, run_id: str, ranks: dict[int, int], sets: dict[int, list[str]] | None = None):
    """Two peers with fixed data orders (seeds 1 and 2), ``ranks[i]`` local ranks and ``sets[i]`` more arguments
    for peer i. Returns their summaries, final theta, the theta of the round before (peer 0's) and the processes."""
    extra = {i: ["--set", f"data.seed={i + 1}", "--checkpoint-dir", str(tmp_path / f"ckpt{i}"),
                 "--set", "checkpoint.keep=5", *(sets or {}).get(i, [])] for i in range(2)}
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
    """One peer's ranks use DDP, the other's FSDP: how a peer trains inside is its own choice."""
    sets = {0: ["--set", "train.parallelism=ddp"], 1: ["--set", "train.parallelism=fsdp"]}
    _check_synced(tmp_path, *_run(tmp_path, reap, "t-cluster-2x2", {0: 2, 1: 2}, sets))


@pytest.mark.timeout(600)  # three swarm runs
def test_mixed_rank_counts_match_one_rank_per_peer(tmp_path, reap):
    """A 2-rank peer (DDP, then FSDP) with a 1-rank peer, against the same run with 1 rank per peer."""
    single = _run(tmp_path / "single", reap, "t-cluster-single", {0: 1, 1: 1})
    _check_synced(tmp_path / "single", *single)
    want = _flat(single[1][0])
    last_round = float((want - _flat(single[2])).norm() / want.norm())  # how far the last outer step moved theta
    for parallelism in ("ddp", "fsdp"):
        out = tmp_path / parallelism
        mixed = _run(out, reap, f"t-cluster-mixed-{parallelism}", {0: 2, 1: 1},
                     {0: ["--set", f"train.parallelism={parallelism}"]})
        _check_synced(out, *mixed)
        # the same tokens and the same rows on each peer: the rank layout only changes the order of float sums
        assert [s["tokens_trained"] for s in mixed[0]] == [s["tokens_trained"] for s in single[0]]
        differ = float((_flat(mixed[1][0]) - want).norm() / want.norm())
        print(f"theta: 2 ranks ({parallelism}) + 1 rank vs 1 + 1 ranks differ by {differ:.2e} (relative L2); "
              f"the last round moved it {last_round:.2e}")
        assert differ < 0.01 * last_round, (parallelism, differ, last_round)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_cluster_peer_resumes_bit_identically(tmp_path, reap, parallelism):
    """A lone 2-rank peer run for 3 rounds == the same peer run for 2 rounds and resumed from its checkpoint to 3:
    the inner optimizer (gathered from the shards under FSDP), the data cursor and the weights reach every rank
    (the STATE command). The lr horizon is fixed (train.total_steps) so that --max-rounds does not change it."""
    common = ["--run-id", f"t-cluster-resume-{parallelism}", "--data-seed", "7", *FAULT, "--set",
              "train.total_steps=60", "--set", f"train.parallelism={parallelism}"]
    python_args = torchrun_args(2)

    def lone(name: str, rounds: int, *more: str) -> Proc:
        return Proc(["join", *common, "--max-rounds", str(rounds), "--log-dir", str(tmp_path / name),
                     "--summary-json", str(tmp_path / f"{name}.json"), *more], reap, python_args=python_args)

    ckpt = str(tmp_path / "ckpt")
    straight, first = lone("straight", 3), lone("first", 2, "--checkpoint-dir", ckpt)
    assert first.wait(240) == 0, first.stderr_tail()
    resumed = lone("resumed", 3, "--checkpoint-dir", ckpt, "--resume")
    assert resumed.wait(240) == 0, resumed.stderr_tail()
    assert straight.wait(240) == 0, straight.stderr_tail()
    a, b = load_json(tmp_path / "straight.json"), load_json(tmp_path / "resumed.json")
    assert a["rounds_completed"] == b["rounds_completed"] == 3
    assert a["global_digest"] == b["global_digest"], "resume did not continue exactly"
    assert a["tokens_trained"] == b["tokens_trained"]
    assert [e["round"] for e in events_of(tmp_path / "resumed", resumed) if e["event"] == "resumed"] == [2]
