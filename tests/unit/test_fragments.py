"""Streaming DiLoCo's fragments (outer/fragments.py) and the state that syncs one per round
(outer/fragment_state.py): the partition, the landing rule as a table, the merge, and the outer step on one
fragment only."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.errors import ConfigError
from p2p_diloco.outer import optimizer as opt
from p2p_diloco.outer.fragment_state import FragmentState
from p2p_diloco.outer.fragments import fragment_of_round, landing, mix_into, partition
from p2p_diloco.outer.state import WholeState
from p2p_diloco.peer.build import build_state
from p2p_diloco.protocol.certificate import Certificate, Statement
from p2p_diloco.testing.fake_training import FakeReplica

pytestmark = pytest.mark.unit
SIZES = [32, 16, 16, 16, 44, 44, 44, 1, 1, 16, 16, 16, 16, 44, 44, 44, 1, 1, 1, 32]


@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 7, len(SIZES)])
def test_partition_is_contiguous_complete_and_balanced(fragments):
    tensors = [torch.zeros(n) for n in SIZES]
    runs = partition(tensors, fragments)
    assert len(runs) == fragments and all(runs)
    assert [i for run in runs for i in run] == list(range(len(SIZES)))  # contiguous, in order, each tensor once
    sums = [sum(SIZES[i] for i in run) for run in runs]
    if fragments <= 4:  # a run is within the largest tensor of its fair share
        assert max(abs(s - sum(SIZES) / fragments) for s in sums) <= max(SIZES), sums


def test_partition_refuses_more_fragments_than_tensors():
    with pytest.raises(ValueError, match="only 3 parameter tensors"):
        partition([torch.zeros(4)] * 3, 4)
    with pytest.raises(ValueError, match=">= 1"):
        partition([torch.zeros(4)], 0)
    assert partition([torch.zeros(1), torch.zeros(1), torch.zeros(100)], 3) == [[0], [1], [2]]


@pytest.mark.parametrize("local_round, round_, fragments, expected", [
    (None, 0, 2, None),  # a fresh peer: theta whole, whatever round it joins at
    (None, 5, 4, None),
    (3, 3, 2, []),  # nothing changed (a failed round, or a resume): the local weights stay
    (3, 4, 2, [1]),  # our round committed: its fragment is merged
    (4, 5, 2, [0]),
    (2, 4, 4, [2, 3]),  # a catch-up of two rounds: both fragments they moved
    (2, 6, 4, None),  # F rounds or more: every fragment moved, the local weights are too stale
    (5, 4, 2, None),  # theta went back (a repair to an earlier round)
])
def test_landing_table(local_round, round_, fragments, expected):
    assert landing(local_round, round_, fragments) == expected


def test_fragment_of_round_visits_each_fragment_in_turn():
    assert [fragment_of_round(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_mix_into_weights_local_by_alpha_and_keeps_its_dtype():
    local, theta = [torch.full((3,), 4.0, dtype=torch.bfloat16)], [torch.full((3,), 2.0)]
    mix_into(local, theta, 0.5)
    assert local[0].dtype == torch.bfloat16 and local[0].tolist() == [3.0] * 3
    mix_into(local, theta, 0.0)
    assert local[0].tolist() == [2.0] * 3


def _state(alpha=0.5, fragments=2):
    params = [torch.arange(16.0), torch.arange(16.0).view(4, 4) * 2]
    return params, FragmentState(params, 0.7, 0.9, True, "fp", fragments, alpha)


def _certificate(state, after: str) -> Certificate:
    statement = Statement(run_id="r", fingerprint="fp", round=state.round, members=("a",), weights=(1.0,),
                          before=state.digest, after=after, prev="")
    return Certificate(statement, {})


def test_a_round_steps_only_its_fragment_and_the_digest_covers_the_whole_state():
    params, state = _state()
    replica = FakeReplica([p.clone() for p in params])
    replica.params[0].sub_(1.0)
    replica.params[1].sub_(3.0)
    assert state.tensors_like()[0].shape == (16,)  # one flat buffer, the largest fragment
    buffer = state.new_buffer()
    state.pseudo_gradient(replica, buffer)  # round 0: fragment 0 (tensor 0)
    assert torch.equal(buffer[0], torch.ones(16))
    after = state.prepare(buffer)
    state.commit(_certificate(state, after))
    whole = WholeState(params, 0.7, 0.9, True, "fp")
    whole_after = whole.prepare([torch.ones(16), torch.zeros(4, 4)])  # the same step, on the whole state
    whole.commit(_certificate(whole, whole_after))
    assert after == whole_after == opt.digest(whole.optimizer.state_tensors()) == state.digest
    assert torch.equal(state.theta[1], params[1]) and not torch.equal(state.theta[0], params[0])
    assert torch.equal(state.optimizer.momentum_buffers[1], torch.zeros(4, 4))
    assert state.round == 1 and state.fragment() == 1


def test_load_into_merges_the_committed_fragment_and_keeps_the_others():
    params, state = _state(alpha=0.25)
    replica = FakeReplica([p.clone() for p in params])
    state.load_into(replica)  # the first boundary: theta(0) whole (local_round unknown)
    assert state.local_round == 0
    replica.params[0].add_(8.0)
    replica.params[1].add_(4.0)
    trained = [p.clone() for p in replica.params]
    buffer = state.new_buffer()
    state.pseudo_gradient(replica, buffer)
    state.commit(_certificate(state, state.prepare(buffer)))
    state.load_into(replica)
    assert torch.allclose(replica.params[0], 0.25 * trained[0] + 0.75 * state.theta[0])
    assert torch.equal(replica.params[1], trained[1])  # fragment 1 keeps training
    with state.theta_in_model(replica):  # evaluation sees theta
        assert all(torch.equal(p, t) for p, t in zip(replica.params, state.theta))
    assert torch.equal(replica.params[1], trained[1])  # and the local weights come back


def test_a_restored_state_keeps_the_checkpointed_local_weights():
    params, state = _state()

    class Saved:
        round, global_digest, certificate = 3, "d" * 64, None
        theta = [p.clone() for p in params]
        momentum = [torch.zeros_like(p) for p in params]

    state.restore(Saved, "")
    replica = FakeReplica([p + 1 for p in params])
    state.load_into(replica)
    assert all(torch.equal(p, q + 1) for p, q in zip(replica.params, params))


@pytest.mark.parametrize("sets, message", [
    (["outer.fragments=0"], "outer.fragments must be >= 1"),
    (["outer.fragments=2", "outer.fragment_alpha=1.0"], r"outer.fragment_alpha must be in \[0, 1\)"),
    (["outer.fragments=2", "outer.sharding='sharded'"], "rank0"),
])
def test_settings_that_fragments_refuse(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_build_state_refuses_a_cluster_and_too_many_fragments():
    params = [torch.zeros(4), torch.zeros(2)]
    assert isinstance(build_state(load_config(None, ["outer.fragments=2"]), None, params), FragmentState)
    with pytest.raises(ConfigError, match="torchrun with several ranks"):
        build_state(load_config(None, ["outer.fragments=2"]), object(), params)
    with pytest.raises(ConfigError, match="only 2 parameter tensors"):
        build_state(load_config(None, ["outer.fragments=3"]), None, params)


def test_fragments_change_the_fingerprint_only_when_set():
    base = load_config(None, []).fingerprint()
    assert load_config(None, ["outer.fragments=1", "outer.fragment_alpha=0.5"]).fingerprint() == base
    assert load_config(None, ["outer.fragments=2"]).fingerprint() != base
