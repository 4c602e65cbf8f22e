"""Matchmaking led by one agreed member (p2p_diloco/swarm/led_matchmaking.py), on hivemind's own PotentialLeaders
and a stand-in for the rest of its Matchmaking: who a member asks, how often, with which expiration, and what the
leader accepts. The real matchmaking runs in tests/swarm (3–6 peers) and benchmarks/chaos.py (16)."""

import asyncio
import time
from types import MethodType, SimpleNamespace

import pytest
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.swarm.led_matchmaking import MAX_RETRY, MISMATCHES, RETRY, VIEW_MISMATCH, ViewMismatch, designate

pytestmark = pytest.mark.unit
ME, LEADER, OTHER = (PeerID(bytes([i]) * 8) for i in range(3))


def _matchmaking(me: PeerID = ME):
    potential = PotentialLeaders(me, 5.0, 3)
    seen = []

    async def hivemind_pop():
        return OTHER  # hivemind's election would answer from the DHT

    def check(request, context):
        seen.append(request.expiration)
        if potential.declared_expiration_time > request.expiration:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
        return None

    potential.pop_next_leader = hivemind_pop
    mm = SimpleNamespace(peer_id=me, potential_leaders=potential, get_request_expiration_time=lambda: 1.0,
                         _check_reasons_to_reject=check)
    mm._request_join_group = MethodType(Matchmaking._request_join_group, mm)  # hivemind's own, on this stand-in
    return mm, seen


def test_without_a_leader_hivemind_elects_as_before():
    mm, _ = _matchmaking()
    designate(mm, None)
    assert asyncio.run(mm.potential_leaders.pop_next_leader()) == OTHER
    assert mm.get_request_expiration_time() == 1.0


def test_a_follower_asks_only_its_leader_paced_and_until_its_deadline():
    mm, _ = _matchmaking()
    designate(mm, LEADER.to_base58())
    designate(mm, LEADER.to_base58())  # once per attempt: installs once

    async def asks(n: int) -> list[float]:
        times = []
        for _ in range(n):
            assert await mm.potential_leaders.pop_next_leader() == LEADER
            times.append(time.monotonic())
        return times
    times = asyncio.run(asks(6))
    gaps = [b - a for a, b in zip(times, times[1:])]
    wanted = [RETRY, 2 * RETRY, 4 * RETRY, MAX_RETRY, MAX_RETRY]  # a refused request is retried, not hammered
    assert all(gap >= want - 0.02 for gap, want in zip(gaps, wanted, strict=True)), gaps
    assert mm.retry == MAX_RETRY  # ... and never given up: the next waits MAX_RETRY again
    assert mm.get_request_expiration_time() == 1.0  # no search running: hivemind's own
    mm.potential_leaders.search_end_time = get_dht_time() + 30
    assert mm.get_request_expiration_time() == mm.potential_leaders.search_end_time  # waits until its deadline


def test_the_leader_asks_nobody_and_ends_each_window_of_its_declaration():
    mm, _ = _matchmaking()
    designate(mm, ME.to_base58())

    async def pop():
        task = asyncio.ensure_future(mm.potential_leaders.pop_next_leader())
        await asyncio.sleep(0.15)
        assert not task.done()  # not declared yet: waits
        mm.potential_leaders.declared_expiration_time = get_dht_time() + 0.2
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError, match="window of our declaration ended"):
            await asyncio.wait_for(task, 10)  # hivemind's loop then assembles a full group or sends the others away
        return time.monotonic() - started
    assert asyncio.run(pop()) > 0.1  # it waited out the declaration's window


def test_the_leader_takes_a_follower_whose_expiration_is_earlier_than_its_own_declaration():
    mm, seen = _matchmaking(LEADER)
    request = averaging_pb2.JoinRequest(schema_hash=b"s", expiration=get_dht_time() + 1, gather=b"g", group_key="k")
    mm.potential_leaders.declared_expiration_time = get_dht_time() + 5  # it started looking after the follower
    assert mm._check_reasons_to_reject(request, None).code == averaging_pb2.BAD_EXPIRATION_TIME  # hivemind's rule
    designate(mm, LEADER.to_base58())
    assert mm._check_reasons_to_reject(request, None) is None
    assert seen[-1] == mm.potential_leaders.declared_expiration_time and request.expiration < seen[-1]
    designate(mm, OTHER.to_base58())  # not the leader: hivemind's rule again
    assert mm._check_reasons_to_reject(request, None).code == averaging_pb2.BAD_EXPIRATION_TIME


class _Stream:
    """The follower's end of a join request: the leader's ACCEPTED arrives ``accepted_after`` s after the request
    (None: never), then BEGIN_ALLREDUCE at once."""

    def __init__(self, accepted_after: float | None):
        self.messages = [(accepted_after, averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)),
                         (0.0, averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE))]

    def __aiter__(self):
        return self

    async def __anext__(self):
        delay, message = self.messages.pop(0)
        await asyncio.sleep(3600 if delay is None else delay)
        return message

    async def aclose(self):
        pass


def _follower(accepted_after: float | None, leader: PeerID | None, deadline_in: float):
    """A follower on hivemind's own ``_request_join_group``, with a 0.2 s ``request_timeout``, asking LEADER."""
    mm, _ = _matchmaking()
    stub = SimpleNamespace(rpc_join_group=lambda request: asyncio.sleep(0, _Stream(accepted_after)))
    group = object()

    async def assembled(leader_, message):
        assert message.code == averaging_pb2.BEGIN_ALLREDUCE
        return group

    mm.__dict__.update(
        request_timeout=0.2, is_looking_for_group=True, current_leader=None, current_followers={}, client_mode=False,
        schema_hash=b"s", _servicer_type=SimpleNamespace(get_stub=lambda *a, **k: stub), _p2p=None, _prefix="p",
        step_control=SimpleNamespace(data_for_gather=b"g"), group_key_manager=SimpleNamespace(current_key="k"),
        follower_assemble_group=assembled)
    designate(mm, leader and leader.to_base58())

    async def ask():
        mm.lock_request_join_group, mm.was_accepted_to_group = asyncio.Lock(), asyncio.Event()
        mm.potential_leaders.search_end_time = get_dht_time() + deadline_in
        started = time.monotonic()
        return await mm._request_join_group(LEADER), time.monotonic() - started
    return mm, group, ask


def test_a_follower_waits_for_its_leaders_answer_until_its_deadline():
    """The leader assembles its group the moment it has sent ACCEPTED to the member that fills it: a follower that
    gives up on an answer still in flight is counted in a group it never hears of (CI, 2026-12-07)."""
    mm, group, ask = _follower(accepted_after=0.5, leader=LEADER, deadline_in=5.0)
    result, _ = asyncio.run(ask())
    assert result is group  # waited 0.5 s for its answer, more than hivemind's request_timeout of 0.2 s
    assert mm.request_timeout == 0.2  # hivemind's own again afterwards
    mm, _, ask = _follower(accepted_after=0.5, leader=None, deadline_in=5.0)
    assert asyncio.run(ask())[0] is None  # hivemind's election: gives up after request_timeout (the race above)


def test_a_followers_wait_for_an_answer_ends_at_its_deadline():
    mm, _, ask = _follower(accepted_after=None, leader=LEADER, deadline_in=0.6)
    result, waited = asyncio.run(ask())
    assert result is None and 0.5 < waited < 2.0, waited
    assert mm.request_timeout == 0.2


class _Refusal(_Stream):
    """A leader's stream that answers ``code`` at once and nothing more."""

    def __init__(self, code: int):
        self.messages = [(0.0, averaging_pb2.MessageFromLeader(code=code))]


def _refused_follower(code: int, regroup: bool):
    """A follower whose leader answers every request with ``code`` (hivemind's own ``_request_join_group``)."""
    mm, _, _ = _follower(accepted_after=None, leader=LEADER, deadline_in=5.0)
    mm._servicer_type = SimpleNamespace(get_stub=lambda *a, **k: SimpleNamespace(
        rpc_join_group=lambda request: asyncio.sleep(0, _Refusal(code))))
    designate(mm, LEADER.to_base58(), regroup=regroup)

    async def asks(n: int) -> None:
        mm.lock_request_join_group, mm.was_accepted_to_group = asyncio.Lock(), asyncio.Event()
        mm.potential_leaders.search_end_time = get_dht_time() + 5.0
        for _ in range(n):
            assert await mm.potential_leaders.pop_next_leader() == LEADER
            assert await mm._request_join_group(LEADER) is None
        return await mm.potential_leaders.pop_next_leader()
    return mm, asks


def test_a_follower_whose_leader_expects_another_group_ends_its_attempt():
    """CI, 2026-12-07: a member that had not read a round-mate's record asked for a group of 5 where its leader
    expected 6, and was refused (BAD_GROUP_KEY) until its deadline. With ``regroup`` it ends the attempt after
    MISMATCHES refusals, so that its host reads the records again."""
    mm, asks = _refused_follower(averaging_pb2.BAD_GROUP_KEY, regroup=True)
    servicer = mm._servicer_type
    with pytest.raises(ViewMismatch, match=VIEW_MISMATCH):
        asyncio.run(asks(MISMATCHES))
    assert mm._servicer_type is servicer  # the stand-in that reads the leader's answers is gone after each request
    mm, asks = _refused_follower(averaging_pb2.BAD_GROUP_KEY, regroup=True)
    assert asyncio.run(asks(MISMATCHES - 1)) == LEADER  # one refusal: the leader may be changing attempts


def test_other_refusals_and_a_follower_without_regroup_keep_asking():
    mm, asks = _refused_follower(averaging_pb2.BAD_GROUP_KEY, regroup=False)
    assert asyncio.run(asks(MISMATCHES + 1)) == LEADER and mm.mismatches == MISMATCHES + 1
    mm, asks = _refused_follower(averaging_pb2.NOT_LOOKING_FOR_GROUP, regroup=True)  # the leader not there yet
    assert asyncio.run(asks(MISMATCHES + 1)) == LEADER and mm.mismatches == 0
    mm, asks = _refused_follower(averaging_pb2.BAD_GROUP_KEY, regroup=True)
    mm.current_followers = {OTHER: "its request"}  # someone's view names us its leader: we are in a group attempt
    assert asyncio.run(asks(MISMATCHES)) == LEADER
    designate(mm, LEADER.to_base58(), regroup=True)  # the next attempt counts from 0
    assert mm.mismatches == 0


def test_a_leader_whose_followers_ask_for_another_group_ends_its_attempt():
    """16 peers on 2 cores (2026-12-08): a leader whose view missed a member expected 15 while its followers asked
    for 16, and all of them lost its whole attempt. With ``regroup`` it ends the attempt once half of the followers
    it expects (and at least MISMATCHES) asked it for another size of the same round; others do not count."""
    from p2p_diloco.swarm.led_matchmaking import FOLLOWERS_MISMATCH, followers_to_regroup

    round_bits = "0110"
    key = lambda size: f"run.0b{round_bits}{size:016b}"  # noqa: E731 (exact_averager.attempt_key_bits)

    def leader(expects: int, regroup: bool = True):
        mm, _ = _matchmaking()
        mm.target_group_size = expects
        mm.group_key_manager = SimpleNamespace(current_key=key(expects))
        check = mm._check_reasons_to_reject
        mm._check_reasons_to_reject = lambda request, context: (
            averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
            if request.group_key != mm.group_key_manager.current_key else check(request, context))
        designate(mm, ME.to_base58(), regroup=regroup)
        mm.potential_leaders.declared_expiration_time = get_dht_time() + 30
        return mm

    def ask(mm, peer: PeerID, group_key: str):
        request = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=get_dht_time() + 60, group_key=group_key)
        return mm._check_reasons_to_reject(request, SimpleNamespace(remote_id=peer))

    async def searching(mm, seconds: float):
        return await asyncio.wait_for(mm.potential_leaders.pop_next_leader(), seconds)

    assert [followers_to_regroup(n) for n in (2, 3, 5, 16)] == [2, 2, 2, 8]
    mm = leader(expects=15)
    followers = [PeerID(bytes([10 + i]) * 8) for i in range(15)]
    for peer in followers[:6]:  # 6 of the 14 followers it expects asked for 16
        assert ask(mm, peer, key(16)).code == averaging_pb2.BAD_GROUP_KEY
    ask(mm, followers[0], key(16))  # the same follower again counts once
    ask(mm, followers[7], "run.0b0111" + format(16, "016b"))  # another round's: not a round-mate
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(searching(mm, 0.5))
    ask(mm, followers[8], key(16))  # the 7th: half of the 14
    started = time.monotonic()
    with pytest.raises(ViewMismatch, match=FOLLOWERS_MISMATCH):
        asyncio.run(searching(mm, 5))
    assert time.monotonic() - started < 1.0  # not the 30 s of its declaration
    mm = leader(expects=15, regroup=False)  # the attempt after a regroup waits as before
    for peer in followers:
        ask(mm, peer, key(16))
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(searching(mm, 0.5))
