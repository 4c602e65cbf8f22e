"""A peer that is a cluster (issue 8, p2p_diloco/local/cluster.py): torchrun with K local ranks on CPU (gloo), DDP or
FSDP2 inside the peer, hivemind between peers, ``outer.sharding = "rank0"``.

* 2 peers x 2 ranks (one DDP, one FSDP) complete rounds with bit-identical global weights, and only rank 0 speaks
  (one join line); a 2-rank peer and a 1-rank peer average together (the sharded test below).
* That run matches the same run with 1 rank per peer up to float tolerance: a 2-rank peer computes each
  gradient as the mean of its two ranks' halves of the batch (DDP's all-reduce, FSDP's reduce-scatter) instead of
  the mean over the whole batch, so the sums are taken in another order; FSDP also computes the gradient norm
  for clipping and the AdamW update on shards. Nothing else differs (same data order, same rows, same tokens).
"""

import pytest
import torch

from p2p_diloco.metrics.events import Event
from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.cli.launcher import parse_join_line
from tests.swarm.helpers import (FAULT, LONE, Proc, events_of, load_json, start_peers, torchrun_args)

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300)]
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
        groups = [e["group_size"] for e in events_of(tmp_path, p) if e["event"] == Event.ALLREDUCE_DONE]
        assert groups == [2] * ROUNDS, groups
        # rank 0 alone prints the join line (followers write nothing to stdout)
        assert sum(parse_join_line(line) is not None for line in p.lines) == 1, p.lines


@pytest.mark.timeout(420)  # two swarm runs
def test_two_rank_peers_match_one_rank_per_peer(tmp_path, reap):
    """A 2-rank DDP peer and a 2-rank FSDP peer (how a peer trains inside is its own choice) average together with
    bit-identical global weights, and match the same run with 1 rank per peer up to float tolerance. Both runs use
    ``outer.overlap``: rank 0 averages and steps theta in a background thread while the ranks train the next round
    (the pseudo-gradient and the look-ahead reach the ranks through the replica, GATHER and PARAMS)."""
    overlap = ["--set", "outer.overlap=true"]
    single = _run(tmp_path / "single", reap, "t-cluster-single", {0: 1, 1: 1}, {0: overlap, 1: overlap})
    _check_synced(tmp_path / "single", *single)
    want = _flat(single[1][0])
    last_round = float((want - _flat(single[2])).norm() / want.norm())  # how far the last outer step moved theta
    out = tmp_path / "2x2"
    mixed = _run(out, reap, "t-cluster-2x2", {0: 2, 1: 2},
                 {0: [*overlap, "--set", "train.parallelism=ddp"], 1: [*overlap, "--set", "train.parallelism=fsdp"]})
    _check_synced(out, *mixed)
    # the same tokens and the same rows on each peer: the rank layout only changes the order of float sums
    assert [s["tokens_trained"] for s in mixed[0]] == [s["tokens_trained"] for s in single[0]]
    differ = float((_flat(mixed[1][0]) - want).norm() / want.norm())
    print(f"theta: 2 ranks (ddp) + 2 ranks (fsdp) vs 1 + 1 ranks differ by {differ:.2e} (relative L2); "
          f"the last round moved it {last_round:.2e}")
    assert differ < 0.01 * last_round, (differ, last_round)


@pytest.mark.parametrize("parallelism, sharding", [("ddp", "rank0"), ("fsdp", "rank0"), ("fsdp", "sharded")])
def test_cluster_peer_resumes_bit_identically(tmp_path, reap, parallelism, sharding):
    """A lone 2-rank peer run for 2 rounds == the same peer resumed from its round-1 checkpoint and run to round 2:
    the inner optimizer (gathered from the shards under FSDP), the data cursor and the weights reach every rank
    (the STATE command); in sharded mode each rank writes and reads its own shard files (SSAVE, SRESTORE). The lr
    horizon is fixed (train.total_steps) so that --max-rounds does not change it. (The round-2 checkpoint of the
    straight run is removed first: resuming from round 1 is what a peer stopped after round 1 would do.)"""
    common = ["--run-id", f"t-cluster-resume-{parallelism}-{sharding}", "--data-seed", "7", *FAULT, *LONE, "--set",
              "train.total_steps=40", "--set", f"train.parallelism={parallelism}", "--set",
              f"outer.sharding={sharding}", "--set", "outer.shards=3"]
    python_args = torchrun_args(2)

    def lone(name: str, rounds: int, *more: str) -> Proc:
        return Proc(["join", *common, "--max-rounds", str(rounds), "--log-dir", str(tmp_path / name),
                     "--summary-json", str(tmp_path / f"{name}.json"), *more], reap, python_args=python_args)

    ckpt = tmp_path / "ckpt"
    straight = lone("straight", 2, "--checkpoint-dir", str(ckpt))
    assert straight.wait(240) == 0, straight.stderr_tail()
    for stale in [ckpt / "round-00000002.pt", *ckpt.glob("shards/shard-*-round-00000002.pt")]:
        stale.unlink()
    resumed = lone("resumed", 2, "--checkpoint-dir", str(ckpt), "--resume")
    assert resumed.wait(240) == 0, resumed.stderr_tail()
    a, b = load_json(tmp_path / "straight.json"), load_json(tmp_path / "resumed.json")
    assert a["rounds_completed"] == b["rounds_completed"] == 2
    assert a["global_digest"] == b["global_digest"], "resume did not continue exactly"
    assert a["tokens_trained"] == b["tokens_trained"]
    assert [e["round"] for e in events_of(tmp_path / "resumed", resumed) if e["event"] == Event.RESUMED] == [1]
    if sharding == "sharded":  # rank 0 kept shards 0 and 2, rank 1 shard 1: files for the kept rounds only
        names = sorted(p.name for p in (tmp_path / "ckpt" / "shards").iterdir())
        assert names == [f"shard-{j:04d}-round-{r:08d}.pt" for j in range(3) for r in (0, 1, 2)], names
        # eval/export assemble theta from the shard files: the digest of what they load is the run's
        from p2p_diloco.checkpoint import ShardFiles
        from p2p_diloco.export import load_trained
        from p2p_diloco.outer.shards import ShardLayout, global_digest, shard_digest

        params = list(load_trained(tmp_path / "ckpt").model.parameters())
        flat, layout = torch.cat([p.detach().reshape(-1) for p in params]), ShardLayout.of(params, 3)
        shards = [flat[layout.bounds[j]:layout.bounds[j + 1]].clone() for j in range(3)]
        files = ShardFiles(tmp_path / "ckpt")  # the digest covers the momentum too: it is only in the shard files
        momenta = [torch.load(files.path(j, 2), weights_only=True)["momentum"] for j in range(3)]
        assert global_digest([shard_digest(t, m) for t, m in zip(shards, momenta)]) == b["global_digest"]
