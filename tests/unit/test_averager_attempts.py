"""One all-reduce attempt of ExactAverager / Averagers without processes (issue 20): the group size in the group
key, hivemind's key rotation made harmless, and a failed attempt's byte counts reaching RoundFailed. The methods
run on stand-ins for the averager process's state; the real matchmaking is in tests/swarm/test_averager.py."""

import asyncio
import concurrent.futures
import pickle
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager, is_valid_group
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import PeerID

from p2p_diloco.errors import RoundFailed
from p2p_diloco.swarm.averagers import Averagers, round_bits
from p2p_diloco.swarm.exact_averager import ExactAverager, attempt_key_bits

pytestmark = pytest.mark.unit
PEERS = [PeerID(bytes([i]) * 8) for i in range(4)]


def _in_averager(me: PeerID = PEERS[0], target: int = 2):
    """The averager process's matchmaking state as ``_set_round_params`` sees it (hivemind's own key manager)."""
    keys = GroupKeyManager(SimpleNamespace(peer_id=me), "run_fp", "", target)
    mm = SimpleNamespace(group_key_manager=keys, potential_leaders=PotentialLeaders(me, 5.0, target),
                         target_group_size=target, min_group_size=target, peer_id=me,
                         get_request_expiration_time=lambda: 0.0,
                         _check_reasons_to_reject=lambda request, context: None, _request_join_group=None)
    return SimpleNamespace(_matchmaking=mm, _guard_matchmaking=lambda mm: None, allowed=None,
                           _is_allowed=lambda peer: True, _attempt_runners=("a runner of the last attempt",))


def _set_round_params(av, bits: str, size: int) -> None:
    done = concurrent.futures.Future()
    asyncio.run(ExactAverager._set_round_params(av, bits, size, done))
    done.result(timeout=1)


def test_peers_asking_for_different_group_sizes_use_different_keys():
    keys = set()
    for size in (2, 3, 16):
        av = _in_averager()
        _set_round_params(av, round_bits(7), size)
        key = av._matchmaking.group_key_manager.current_key
        assert is_valid_group(key) and av._matchmaking.target_group_size == size
        keys.add(key)
    assert len(keys) == 3  # hivemind's leaders accept only joiners of their own key: no group of another size
    assert attempt_key_bits(round_bits(7), 3) != attempt_key_bits(round_bits(8), 3)
    with pytest.raises(ValueError):
        attempt_key_bits(round_bits(7), 0)


def test_a_follower_sent_a_larger_group_keeps_its_key_and_does_not_fail():
    """hivemind 1.1.12 rotates the key once a group assembles with ``rng.sample(range(target_group_size),
    group_size)``: a follower asking for 2 and sent a group of 3 raised "Sample larger than population", its step
    failed, and the others waited for its parts (seen 38 times in one 16-peer chaos run). Ours keeps the key."""
    av = _in_averager(me=PEERS[2], target=2)
    _set_round_params(av, round_bits(7), 2)
    keys = av._matchmaking.group_key_manager
    before = keys.current_key
    for group in (PEERS[:3], PEERS[1:3]):  # larger than asked for, and as asked for
        asyncio.run(keys.update_key_on_group_assembled(GroupInfo(b"gid", tuple(group), (b"",) * len(group))))
        assert keys.current_key == before
    assert av._attempt_runners == ()  # a new attempt counts its bytes from 0


def test_a_group_of_another_size_is_refused_before_any_byte_moves():
    """A leader that breaks the protocol could still send a group of another size: the follower refuses it before
    the all-reduce, not after the whole transfer (commit.group_problem)."""
    av = _in_averager(me=PEERS[1], target=2)
    _set_round_params(av, round_bits(7), 2)
    group = GroupInfo(b"gid", tuple(PEERS[:3]), (b"",) * 3)
    with pytest.raises(AllreduceException, match="has 3 members, we asked for 2"):
        asyncio.run(ExactAverager._aggregate_with_group(av, group, 0))


def test_round_failed_carries_byte_counts():
    assert (RoundFailed("x").bytes_sent, RoundFailed("x").bytes_received, str(RoundFailed("x"))) == (0, 0, "x")
    e = pickle.loads(pickle.dumps(RoundFailed("lost", bytes_sent=5, bytes_received=7)))
    assert (str(e), e.bytes_sent, e.bytes_received) == ("lost", 5, 7)


class _Control:
    """A failed step's control, as hivemind's StepControl looks to the host."""

    began_allreduce, stage = True, AveragingStage.FINISHED

    def __init__(self, error):
        self.error, self.cancelled = error, False

    def done(self):
        return True

    def cancel(self):
        self.cancelled = True

    def result(self, timeout=None):
        if self.error:
            raise self.error
        return None


class _Averager:
    """The host side of one averager whose step fails (or, with ``error=None``, would find no group)."""

    def __init__(self, counts, error=None, alive=True):
        self.counts, self.error, self.alive, self.tensors = counts, error, alive, [torch.zeros(3)]
        self.source_channel = SimpleNamespace(set_inputs=lambda tensors: None)  # (source_channel.py's host side)

    def set_round_params(self, *args, **kwargs):
        pass

    def get_tensors(self):
        import contextlib

        return contextlib.nullcontext(self.tensors)

    def step(self, **kwargs):
        return _Control(self.error)

    def is_alive(self):
        return self.alive

    def attempt_bytes(self, timeout):
        if self.counts is None:
            raise TimeoutError("no answer")
        return self.counts


def _averagers(*members):
    av = Averagers.__new__(Averagers)
    av.cfg = SimpleNamespace(debug=SimpleNamespace(corrupt_pseudo_gradient=0.0))
    av.list, av.adverts, av.p2p_only_round = list(members), [None] * len(members), -1
    av.sources, av.shapes = [m.source_channel for m in members], [[torch.Size([3])] for _ in members]
    return av


def _all_reduce(av, value=1.0):
    return av.all_reduce(3, [[torch.full((3,), value)] for _ in av.list], 1.0, 2, {"round": 3}, lambda: False,
                         lambda: None, 1.0, 1.0, 1.0)


def test_a_failed_all_reduce_reports_what_every_averager_moved():
    """The failing step's averager, a shard's averager whose step was cancelled, one that cannot answer (counted
    as 0) and a dead one: RoundFailed carries the sum of what the averager processes counted."""
    failing = _Averager((1000, 800), AllreduceException("reducer X failed"))
    av = _averagers(failing, _Averager((300, 200)), _Averager(None), _Averager((5, 5), alive=False))
    with pytest.raises(RoundFailed, match="reducer X failed") as e:
        _all_reduce(av)
    assert (e.value.bytes_sent, e.value.bytes_received) == (1300, 1000)


def test_an_attempt_that_found_no_group_reports_zero_bytes():
    with pytest.raises(RoundFailed, match="could not find a group") as e:
        _all_reduce(_averagers(_Averager((0, 0))))
    assert (e.value.bytes_sent, e.value.bytes_received) == (0, 0)


def test_a_completed_all_reduce_refused_as_non_finite_reports_its_bytes():
    done = {"gathered": {}, "group_size": 2, "bytes_sent": 70, "bytes_received": 60}
    averager = _Averager((0, 0))
    averager.step = lambda **kwargs: SimpleNamespace(began_allreduce=True, result=lambda timeout=None: done)
    with pytest.raises(RoundFailed, match="non-finite") as e:  # (the buffers hold what the step averaged)
        _all_reduce(_averagers(averager), value=float("nan"))
    assert (e.value.bytes_sent, e.value.bytes_received) == (70, 60)


def test_the_host_offers_an_attempts_input_to_its_averager_only_while_it_runs():
    """source_channel.py: during the step, the averager can read back the caller's own tensors (a repair); once
    the attempt is over, failed or not, nothing (the caller may free or reuse its buffer)."""
    offered = []
    averager = _Averager((0, 0))
    averager.source_channel = SimpleNamespace(set_inputs=offered.append)
    done = {"gathered": {}, "group_size": 2, "bytes_sent": 0, "bytes_received": 0}
    for step in (lambda **kwargs: _Control(AllreduceException("reducer X failed")),
                 lambda **kwargs: SimpleNamespace(began_allreduce=True, result=lambda timeout=None: done)):
        averager.step, offered[:] = step, []
        mine = [torch.full((3,), 2.0)]
        try:
            _averagers(averager).all_reduce(3, [mine], 1.0, 2, {"round": 3}, lambda: False, lambda: None, 1.0, 1.0,
                                            1.0)
        except RoundFailed:
            pass
        assert len(offered) == 2 and offered[0] is mine and offered[1] is None
        assert torch.equal(averager.tensors[0], torch.full((3,), 2.0))  # (what the step averaged in place)
