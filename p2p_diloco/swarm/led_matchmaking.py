"""Matchmaking led by one agreed member: every member asks the same leader, which gathers the group until it is full.

hivemind's matchmaking (1.1.12) elects leaders by declared expiration: each peer declares "matchmaking time from
now" when it starts looking, the one that started first leads, and it gathers followers only until its own
declaration expires; a group that is not full then is disbanded, and everyone starts over at a different moment.
Our groups must be exactly the round's members, and on 2 cores 16 peers start looking up to 7 s apart: measured
(``chaos --no-faults --sizes 16``, 2026-12-05), whoever started more than the matchmaking window after the first
one missed every group, the attempts drifted apart, and round 2 failed 79 attempts in 180 s (one member's attempts
started 38–40 s after the first of the others' three times in a row, about a whole attempt behind).

The round rules already name the group (``AllReduce.members``) and one leader among them
(:func:`p2p_diloco.protocol.consensus.matchmaking_leader`, the same on every member whose view agrees). So when the
host names a leader for an attempt:

* the leader never asks anyone: its search waits out its declaration, when hivemind's own loop assembles a full
  group or sends the incomplete one away and declares again, until the step's deadline;
* a follower asks only the leader, again after a refusal (the leader not looking yet, or expecting another group)
  or a disbanded group, :data:`RETRY` seconds later, then twice as long each time up to :data:`MAX_RETRY`, until
  its step's deadline (at a steady 0.2 s, 15 followers whose views name another group would send one leader 75
  requests a second for the whole attempt); its request carries that deadline as its expiration. A follower
  whose attempt ends first starts the next one at once and joins again: the leader's attempt is the clock, and
  the group forms once every member is in it;
* a follower waits for the leader's answer to its request until its step's deadline, not hivemind's
  ``request_timeout``: the leader assembles the group the moment it has sent ACCEPTED to the member that fills
  it, so a follower that gave up on an answer still in flight was counted in a group it never heard of, and the
  others waited out the data plane's timeout for its parts (CI, 2026-12-07: round 1 of a 3-peer swarm lost 20 s
  and an attempt). hivemind's short wait breaks request cycles (A asks B while B asks A); a follower asks only
  its leader, which asks nobody, so there is none to break;
* the leader takes a follower whatever its expiration (hivemind refuses one that expires before the leader's own
  declaration: a leader that started later than its followers would refuse them all);
* a group assembles the moment the last member joins (hivemind's ``target_group_size``).

So members starting apart wait for each other until the deadline instead of missing each other's window. A member
whose view names another leader finds no group and retries, as before; a leader that died fails the attempt (the
probe names it a suspect and the next attempt leaves it out).

**A follower whose view is not its leader's** (``regroup``): the group size is in the group key, so a leader that
expects another group answers ``BAD_GROUP_KEY``. One member that had not yet read a round-mate's record (CI: the
other xdist worker compiling) used to ask its leader with the wrong size until its step's deadline, and the whole
group's attempt failed with it (about 10 s). With ``regroup``, after :data:`MISMATCHES` such answers from the
leader the follower ends its attempt with :class:`ViewMismatch`; its host reads the records again and starts the
next attempt at once, which joins the leader's attempt still running if the fresh view agrees. Nothing is decided
from the leader's answer: it only makes the follower look again. A follower that leads followers of its own
(views naming different leaders) does not end its attempt.

**A leader whose view is not its followers'**: its followers look again, find the same group and would wait out
the leader's attempt (16 peers on 2 cores, 2026-12-08: a leader whose view missed one member expected 15, its 15
followers asked for 16, and all lost its 43 s attempt). With ``regroup`` the leader counts the distinct followers
it refused with ``BAD_GROUP_KEY``; once they are half of those it expects, and at least :data:`MISMATCHES`
(:func:`followers_to_regroup`), it ends its attempt with :class:`ViewMismatch` too, and its host reads the records
again. Again nothing is decided from the answers. The host asks for ``regroup`` once per decision
(peer/syncer.py), so neither side regroups twice in a row.

Without a leader (sharded groups, tests), hivemind's matchmaking runs unchanged.
"""

from __future__ import annotations

import asyncio
import math
import time

from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

# RETRY: seconds between a follower's first two requests to its leader, doubled after each up to MAX_RETRY;
# MISMATCHES: BAD_GROUP_KEY answers that end a regroup attempt; VIEW_MISMATCH: in a ViewMismatch's text, how the
# host tells it apart (shared with the fake swarm, which has no hivemind: port.py)
from .port import (FOLLOWERS_MISMATCH, LEADER_RETRY as RETRY, REGROUP_REFUSALS as MISMATCHES, SIZE_BITS,
                   VIEW_MISMATCH, followers_to_regroup)

MAX_RETRY = 1.0  # a follower whose view names another group asks again at most this often (the leader's load)
LEADER_POLL = 0.05  # seconds; the shortest sleep of the leader's search (its declaration is being renewed)


class ViewMismatch(MatchmakingException):
    """Our designated leader answered :data:`MISMATCHES` times that it looks for a group of another key (another
    size or round): our view of the round's members, or the leader's, is out of date."""


def install(mm) -> None:
    """Let ``mm`` (a hivemind ``Matchmaking``) follow :func:`designate`; idempotent. Averager process only."""
    if getattr(mm, "designated_leader", False) is not False:
        return
    potential = mm.potential_leaders
    pop_next_leader, request_expiration = potential.pop_next_leader, mm.get_request_expiration_time
    mm.designated_leader, mm.last_request, mm.retry = None, -math.inf, RETRY
    mm.regroup, mm.mismatches, mm.refused = False, 0, set()

    async def led_pop_next_leader() -> PeerID:
        leader = mm.designated_leader
        if leader is None:
            return await pop_next_leader()
        if leader == mm.peer_id:
            await _lead(mm)
        await asyncio.sleep(max(0.0, mm.last_request + mm.retry - time.monotonic()))
        if mm.regroup and mm.mismatches >= MISMATCHES and not getattr(mm, "current_followers", None):
            raise ViewMismatch(f"{VIEW_MISMATCH} (it answered BAD_GROUP_KEY {mm.mismatches} times)")
        if math.isfinite(mm.last_request):
            mm.retry = min(2 * mm.retry, MAX_RETRY)
        mm.last_request = time.monotonic()
        return leader

    def led_request_expiration() -> float:
        if mm.designated_leader is None or not math.isfinite(potential.search_end_time):
            return request_expiration()
        return potential.search_end_time  # we wait for the leader until our step's deadline

    request_join_group = mm._request_join_group

    async def led_request_join_group(leader: PeerID):
        deadline = potential.search_end_time
        if mm.designated_leader is None or leader != mm.designated_leader or not math.isfinite(deadline):
            return await request_join_group(leader)
        usual = mm.request_timeout  # (read only by _request_join_group: its wait for the leader's answers)
        servicer = mm._servicer_type  # (read only by _request_join_group: the leader's stub)
        mm.request_timeout = max(usual, deadline - get_dht_time())
        mm._servicer_type = _FirstAnswers(servicer, lambda code: _answered(mm, code))
        try:
            return await request_join_group(leader)
        finally:
            mm.request_timeout, mm._servicer_type = usual, servicer

    check = mm._check_reasons_to_reject

    def led_check(request: averaging_pb2.JoinRequest, context):
        ours = potential.declared_expiration_time
        if mm.designated_leader == mm.peer_id and math.isfinite(ours) and request.expiration < ours:
            request = averaging_pb2.JoinRequest(schema_hash=request.schema_hash, expiration=ours,
                                                client_mode=request.client_mode, gather=request.gather,
                                                group_key=request.group_key)
        reason = check(request, context)
        if (reason is not None and reason.code == averaging_pb2.BAD_GROUP_KEY and mm.designated_leader == mm.peer_id
                and _same_round(request.group_key, mm.group_key_manager.current_key)):
            mm.refused.add(context.remote_id)  # a round-mate that expects another group size
        return reason

    potential.pop_next_leader, mm.get_request_expiration_time = led_pop_next_leader, led_request_expiration
    mm._request_join_group = led_request_join_group
    mm._check_reasons_to_reject = led_check


def designate(mm, leader: str | None, regroup: bool = False) -> None:
    """The leader of ``mm``'s next attempt (a base58 peer id, ours or a round-mate's), or None for hivemind's own
    election. Call between attempts (the averager's ``_set_round_params``). ``regroup``: a follower ends the
    attempt with :class:`ViewMismatch` once its leader has answered that it expects another group (module
    docstring)."""
    install(mm)
    mm.designated_leader = PeerID.from_base58(leader) if leader else None
    mm.last_request, mm.retry = -math.inf, RETRY
    mm.regroup, mm.mismatches, mm.refused = regroup, 0, set()


async def _lead(mm) -> None:
    """As the designated leader we ask nobody: wait out our declaration's window, when hivemind assembles a full
    group or disbands (TimeoutError), or end the attempt once enough of our followers asked for another group."""
    potential = mm.potential_leaders
    while not math.isfinite(potential.declared_expiration_time):
        await asyncio.sleep(LEADER_POLL)
    while (left := potential.declared_expiration_time - get_dht_time()) > 0:
        if mm.regroup and len(mm.refused) >= followers_to_regroup(mm.target_group_size):
            raise ViewMismatch(f"{FOLLOWERS_MISMATCH} ({len(mm.refused)} asked for another group size)")
        await asyncio.sleep(max(LEADER_POLL, min(left, RETRY)))
    raise asyncio.TimeoutError("the window of our declaration ended")


def _same_round(key: str, ours: str) -> bool:
    """Whether two attempts' group keys differ at most in the group size (their last ``SIZE_BITS`` bits)."""
    return isinstance(key, str) and len(key) == len(ours) and key[:-SIZE_BITS] == ours[:-SIZE_BITS]


def _answered(mm, code: int) -> None:
    """Our designated leader's first answer to a join request: count the refusals that name another group."""
    if code == averaging_pb2.BAD_GROUP_KEY:
        mm.mismatches += 1


class _FirstAnswers:
    """Stands for the averager class where hivemind's ``_request_join_group`` asks it for the leader's stub, and
    reports the code of the leader's first answer to ``on_code`` (hivemind keeps it to itself)."""

    def __init__(self, servicer, on_code):
        self.servicer, self.on_code = servicer, on_code

    def get_stub(self, *args, **kwargs):
        stub = self.servicer.get_stub(*args, **kwargs)
        join, on_code = stub.rpc_join_group, self.on_code

        async def rpc_join_group(*a, **k):
            return _Peek(await join(*a, **k), on_code)
        stub.rpc_join_group = rpc_join_group
        return stub


class _Peek:
    """A leader's answer stream, unchanged, whose first message's code goes to ``on_code``."""

    def __init__(self, stream, on_code):
        self.stream, self.on_code = stream, on_code

    def __aiter__(self):
        return self

    async def __anext__(self):
        message = await self.stream.__anext__()
        if self.on_code is not None:
            self.on_code(message.code)
            self.on_code = None
        return message

    async def aclose(self):
        await self.stream.aclose()
