"""Logical shards of the outer state (p2p_diloco/outer/shards.py), in one process (world 1). The multi-rank collectives
are exercised by tests/swarm/test_cluster.py (torchrun, gloo)."""

import pytest
import torch

from p2p_diloco.outer import optimizer as outer
from p2p_diloco.outer.shards import Ranks, ShardedOuter, ShardLayout, global_digest, shard_digest

pytestmark = pytest.mark.unit


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 30])
def test_layout_covers_every_element_once(num_shards):
    layout = ShardLayout([15, 7, 8], num_shards)
    assert sum(layout.size(j) for j in range(num_shards)) == 30
    seen = torch.zeros(30, dtype=torch.int64)
    starts = [0, 15, 22]
    for i, pieces in enumerate(layout.pieces):
        for j, lo, hi, at in pieces:
            assert 0 <= lo < hi and 0 <= at and at + hi - lo <= layout.size(j)
            assert layout.bounds[j] + at == starts[i] + lo  # the piece sits where the flat vector says
            seen[starts[i] + lo:starts[i] + hi] += 1
    assert bool((seen == 1).all())


def test_ownership_does_not_depend_on_anything_but_rank_and_world():
    layout = ShardLayout([15, 7, 8], 8)
    assert layout.owned(0, 1) == list(range(8))
    assert layout.owned(0, 3) == [0, 3, 6] and layout.owned(2, 3) == [2, 5]
    owned = sorted(j for k in range(3) for j in layout.owned(k, 3))
    assert owned == list(range(8))
    with pytest.raises(ValueError, match="outer.shards must be between 1 and the parameter count"):
        ShardLayout([3], 4)


def test_sharded_outer_matches_the_whole_outer_step_bit_for_bit():
    """Same theta, same averaged pseudo-gradient: the sharded step gives the same bits as OuterOptimizer."""
    params = _params()
    whole = outer.OuterOptimizer(outer.snapshot(params), lr=0.7, momentum=0.9, nesterov=True)
    sharded = ShardedOuter(ShardLayout.of(params, 4), Ranks(), params, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(3):
        local = [p - 0.01 * (step + 1) * torch.randn_like(p) for p in params]
        delta = [torch.empty_like(t) for t in whole.theta]
        outer.pseudo_gradient(whole.theta, local, delta)
        whole.step(delta)
        shard_delta = [torch.empty_like(t) for t in sharded.theta]
        sharded.pseudo_gradient(local, shard_delta)
        prepared = sharded.prepare(shard_delta)
        sharded.commit(step + 1, shard_delta)
        sharded.refresh_digests()
        assert [prepared[j] for j in range(4)] == sharded.digests  # prepare said what commit gives
        model = [torch.zeros_like(p) for p in params]
        sharded.load_into(model)
        assert all(torch.equal(a, b) for a, b in zip(model, whole.theta))
    flat = torch.cat([t.reshape(-1) for t in whole.theta])
    flat_m = torch.cat([t.reshape(-1) for t in whole.momentum_buffers])
    bounds = sharded.layout.bounds
    want = [shard_digest(flat[bounds[j]:bounds[j + 1]].clone(), flat_m[bounds[j]:bounds[j + 1]].clone())
            for j in range(4)]
    assert sharded.digest == global_digest(want) == sharded.local_digest()


def test_prepare_leaves_the_state_alone_and_commit_refuses_what_was_not_prepared():
    """The prepared step is not held aside: prepare only hashes it, and commit redoes it in place, from the same
    state only (a download between the two would step a theta that was not certified)."""
    params = _params(2)
    sharded = ShardedOuter(ShardLayout.of(params, 3), Ranks(), params, lr=0.7, momentum=0.9, nesterov=True)
    before = [t.clone() for t in sharded.theta + sharded.momentum_buffers]
    delta = [torch.full_like(t, 0.1) for t in sharded.theta]
    prepared = sharded.prepare(delta)
    assert all(torch.equal(a, b) for a, b in zip(before, sharded.theta + sharded.momentum_buffers))
    assert set(prepared) == {0, 1, 2} and all(prepared[j] != sharded.digests[j] for j in range(3))
    sharded.discard()
    with pytest.raises(RuntimeError, match="without prepare"):
        sharded.commit(1, delta)
    sharded.prepare(delta)
    sharded.load({0: [sharded.theta[0].clone(), sharded.momentum_buffers[0].clone()]}, 0, sharded.digests)
    with pytest.raises(RuntimeError, match="changed between prepare"):
        sharded.commit(1, delta)
    assert all(torch.equal(a, b) for a, b in zip(before, sharded.theta + sharded.momentum_buffers))


def test_global_digest_is_the_same_for_any_number_of_ranks():
    """The digest is a function of theta and L only: computed here from shards split as 1, 2 or 3 ranks would."""
    params = _params(1)
    layout = ShardLayout.of(params, 6)
    flat = torch.cat([p.reshape(-1) for p in params])
    digests = []
    for world in (1, 2, 3):
        by_shard = {}
        for rank in range(world):
            for j in layout.owned(rank, world):
                piece = flat[layout.bounds[j]:layout.bounds[j + 1]].clone()
                by_shard[j] = shard_digest(piece, torch.zeros_like(piece))
        digests.append(global_digest([by_shard[j] for j in range(6)]))
    assert len(set(digests)) == 1
    assert ShardedOuter(layout, Ranks(), params, 1.0, 0.0, False).digest == digests[0]


def test_a_downloaded_shard_is_checked_before_use():
    params = _params(2)
    layout = ShardLayout.of(params, 3)
    donor = ShardedOuter(layout, Ranks(), params, 1.0, 0.0, False)
    donor.round = 4
    meta, tensors = donor.donation(1, "fp")
    taker = ShardedOuter(layout, Ranks(), _params(3), 1.0, 0.0, False)
    assert taker.check_download(1, meta, tensors, "fp", 4, donor.digest, exact_round=True) is None
    assert "another config" in taker.check_download(1, meta, tensors, "other", 4, None, False)
    assert "wanted 5" in taker.check_download(1, meta, tensors, "fp", 5, None, exact_round=True)
    assert "majority" in taker.check_download(1, meta, tensors, "fp", 4, "0" * 64, False)
    bad = [tensors[0].clone(), tensors[1]]
    bad[0][0] += 1.0
    assert "does not match its digest" in taker.check_download(1, meta, bad, "fp", 4, None, False)
    bad[0][0] = float("nan")
    assert "non-finite" in taker.check_download(1, meta, bad, "fp", 4, None, False)
    assert "shapes" in taker.check_download(1, meta, [tensors[0][:-1], tensors[1]], "fp", 4, None, False)
    assert "shapes" in taker.check_download(1, meta, [tensors[0], "not a tensor"], "fp", 4, None, False)
    taker.load({j: donor.donation(j, "fp")[1] for j in range(3)}, 4, donor.digests)
    assert taker.digest == donor.digest == taker.refresh_digests() and taker.round == 4


def test_shard_files_round_trip_verify_and_prune(tmp_path):
    from p2p_diloco.checkpoint import CheckpointError, ShardFiles

    files = ShardFiles(tmp_path)
    theta, momentum = torch.randn(10), torch.randn(10)
    for r in (1, 2, 3):
        files.save(2, r, "fp", theta + r, momentum)
    got = files.load(2, 3, "fp", shard_digest(theta + 3, momentum))
    assert torch.equal(got[0], theta + 3) and torch.equal(got[1], momentum)
    with pytest.raises(CheckpointError, match="not the one the round's checkpoint recorded"):
        files.load(2, 3, "fp", shard_digest(theta, momentum))  # another round's bits
    with pytest.raises(CheckpointError, match="not the one"):
        files.load(2, 3, "other-fp", shard_digest(theta + 3, momentum))
    with pytest.raises(CheckpointError, match="cannot read shard checkpoint"):
        files.load(5, 3, "fp", shard_digest(theta + 3, momentum))
    files.path(2, 3).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read shard checkpoint"):
        files.load(2, 3, "fp", shard_digest(theta + 3, momentum))
    files.save(4, 1, "fp", theta, momentum)
    files.prune([2], {2, 3})  # only shard 2's files of other rounds go
    assert sorted(p.name for p in files.directory.iterdir()) == [
        "shard-0002-round-00000002.pt", "shard-0002-round-00000003.pt", "shard-0004-round-00000001.pt"]


def test_a_sharded_checkpoint_is_checked_against_its_shard_digests(tmp_path):
    from p2p_diloco.checkpoint import CheckpointError, CheckpointStore, PeerState

    store = CheckpointStore(tmp_path)
    digests = ["a" * 64, "b" * 64]

    def state(recorded: str) -> PeerState:
        return PeerState(round=1, fingerprint="fp", global_digest=recorded, theta=[], momentum=[], model={},
                         inner_optimizer={}, data={}, rng={}, extra={"shard_digests": digests})

    store.save(state(global_digest(digests)))
    assert store.load().extra["shard_digests"] == digests
    store.save(state("c" * 64))
    with pytest.raises(CheckpointError, match="shard digests do not match its recorded digest"):
        store.load()
