"""Matchmaking led by one agreed member (p2p_diloco/swarm/led_matchmaking.py), on hivemind's own PotentialLeaders
and a stand-in for the rest of its Matchmaking: who a member asks, how often, with which expiration, and what the
leader accepts. The real matchmaking runs in tests/swarm (3–6 peers) and benchmarks/chaos.py (16)."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.swarm.led_matchmaking import MAX_RETRY, RETRY, designate

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
