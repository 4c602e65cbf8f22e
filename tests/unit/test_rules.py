"""The round protocol's decisions (p2p_diloco/protocol/rules.py), case by case: each table row is a moment of a
round, the records a peer sees, and the action it must take."""

from __future__ import annotations

import random

import pytest

from p2p_diloco.protocol import consensus, rules
from p2p_diloco.protocol.actions import (AllReduce, CatchUp, ConfirmAlone, Download, GiveUp, Leave, Repair, Solo,
                                         Start, Stay, TrainAhead, Wait)
from p2p_diloco.protocol.records import Phase, PeerRecord

pytestmark = pytest.mark.unit
T, S, J, D, R, L = Phase.TRAIN, Phase.SYNC, Phase.JOIN, Phase.DONE, Phase.REPAIR, Phase.LEFT


def rec(round_: int, phase: Phase = T, digest: str = "good", **more) -> PeerRecord:
    return PeerRecord(round=round_, phase=phase, digest=digest, **more)


def sync_state(**changes) -> rules.SyncState:
    base = dict(round=3, digest="good", straggler_deadline=100.0, alone_since=None, confirm_for=7.0, overlap=False)
    return rules.SyncState(**{**base, **changes})


# (case, our state, the view, now) -> (action type, the fields it must have)
SYNC_CASES = [
    ("every round-mate is ready: the group is all of us",
     sync_state(), {"a": rec(3, S), "b": rec(3, S)}, 1.0, AllReduce,
     {"group_size": 3, "all_in": True, "members": ("a", "b"), "charged": ("a", "b")}),
    ("a round-mate still training is waited for until the straggler deadline; a failure is charged to nobody",
     sync_state(), {"a": rec(3, S), "b": rec(3, T)}, 1.0, AllReduce,
     {"group_size": 3, "all_in": False, "give_up_at": 100.0, "members": ("a", "b"), "charged": ()}),
    ("after the deadline a training round-mate is left out of a group of the others",
     sync_state(), {"a": rec(3, S), "b": rec(3, T)}, 101.0, AllReduce,
     {"group_size": 2, "all_in": False, "give_up_at": None, "members": ("a",), "charged": ("a",)}),
    ("peers of other rounds, joining or repairing are not round-mates",
     sync_state(), {"a": rec(3, S), "j": rec(3, J), "r": rec(3, R, "bad"), "o": rec(2, T)}, 1.0, AllReduce,
     {"group_size": 2}),
    ("two synced peers ahead: we missed the round",
     sync_state(), {"a": rec(4), "b": rec(4), "c": rec(3, S)}, 1.0, CatchUp, {}),
    ("one peer ahead of two others (a liar?) is not followed",
     sync_state(), {"a": rec(9), "b": rec(3, S), "c": rec(3, S)}, 1.0, AllReduce, {"group_size": 3}),
    ("alone ahead of three synced peers: go back",
     sync_state(round=5), {"a": rec(3), "b": rec(3), "c": rec(3)}, 1.0, CatchUp, {}),
    ("the majority of our round holds another digest: repair from them",
     sync_state(digest="bad"), {"a": rec(3, S), "b": rec(3, T)}, 1.0, Repair,
     {"digest": "good", "donors": ("a", "b")}),
    ("two peers disagree: the smaller digest wins, the other repairs",
     sync_state(digest="bb"), {"a": rec(3, S, "aa")}, 1.0, Repair, {"digest": "aa"}),
    ("two peers disagree, and we hold the smaller digest: no repair",
     sync_state(digest="aa"), {"a": rec(3, S, "bb")}, 1.0, AllReduce, {"group_size": 2}),
    # Issue 17: a solo step only once no round-mate's record has shown for a record lifetime, whatever the size of
    # our last group (it used to be at once after a lone round), and never beside a round-mate still training.
    ("nobody else (alone last round or not): confirm first",
     sync_state(), {}, 1.0, ConfirmAlone, {}),
    ("still nobody, confirmation under way",
     sync_state(alone_since=1.0), {}, 5.0, ConfirmAlone, {}),
    ("nobody for a whole record lifetime: solo",
     sync_state(alone_since=1.0), {}, 8.0, Solo, {}),
    ("a round-mate ready while we confirm: the group",
     sync_state(alone_since=1.0), {"a": rec(3, S)}, 8.0, AllReduce, {"group_size": 2}),
    ("a round-mate training past the straggler deadline and none ready: wait for it, no solo step",
     sync_state(straggler_deadline=0.0), {"a": rec(3, T)}, 1.0, Wait, {"seconds": rules.TRAINING_POLL}),
    ("... even after a record lifetime of confirming",
     sync_state(alone_since=1.0, straggler_deadline=0.0), {"a": rec(3, T)}, 8.0, Wait, {}),
    ("a round-mate training past the round deadline no longer holds back a solo step (confirmed first)",
     sync_state(straggler_deadline=0.0, round_deadline=50.0), {"a": rec(3, T)}, 60.0, ConfirmAlone, {}),
    ("... and once confirmed: solo",
     sync_state(straggler_deadline=0.0, round_deadline=50.0, alone_since=52.0), {"a": rec(3, T)}, 60.0, Solo, {}),
    ("joining and repairing peers of our round sit it out waiting for us: they do not hold back a solo step",
     sync_state(alone_since=1.0), {"j": rec(3, J), "r": rec(3, R, "bad")}, 8.0, Solo, {}),
    ("a peer behind us does not hold back a solo step",
     sync_state(alone_since=1.0), {"o": rec(2, T)}, 8.0, Solo, {}),
    # Bounded liveness (protocol/liveness.py): a peer cooling down counts for nothing but the digest vote
    ("a round-mate cooling down is left out of the group",
     sync_state(cooling=frozenset({"b"})), {"a": rec(3, S), "b": rec(3, S)}, 1.0, AllReduce,
     {"group_size": 2, "all_in": True, "members": ("a",)}),
    ("a round-mate cooling down and still training is not waited for",
     sync_state(cooling=frozenset({"b"})), {"a": rec(3, S), "b": rec(3, T)}, 1.0, AllReduce,
     {"group_size": 2, "all_in": True, "give_up_at": None, "members": ("a",)}),
    ("a round-mate cooling down does not hold back a solo step",
     sync_state(cooling=frozenset({"a"}), alone_since=1.0), {"a": rec(3, S)}, 8.0, Solo, {}),
    ("... nor one cooling down while training",
     sync_state(cooling=frozenset({"a"}), straggler_deadline=0.0), {"a": rec(3, T)}, 1.0, ConfirmAlone, {}),
    ("peers cooling down still vote on digests",
     sync_state(digest="bad", cooling=frozenset({"a", "b"})), {"a": rec(3, S), "b": rec(3, T)}, 1.0, Repair,
     {"digest": "good"}),
    ("a peer cooling down ahead of us (a solo step) is not followed while a peer not cooling down is with us",
     sync_state(cooling=frozenset({"c"})), {"a": rec(3, S), "c": rec(4, T, "x")}, 1.0, AllReduce,
     {"group_size": 2, "members": ("a",)}),
    ("every other peer cooling down: they lead (we may be the broken one)",
     sync_state(cooling=frozenset({"c"})), {"c": rec(4, T, "x")}, 1.0, CatchUp, {}),
    ("overlap: round-mates still training are waited for",
     sync_state(overlap=True), {"a": rec(3, S), "b": rec(3, T)}, 1.0, Wait, {"seconds": rules.OVERLAP_POLL}),
    ("overlap: everyone ready",
     sync_state(overlap=True), {"a": rec(3, S), "b": rec(3, S)}, 1.0, AllReduce, {"group_size": 3}),
    ("a client-mode round-mate is a member like any other",
     sync_state(), {"a": rec(3, S, client=True)}, 1.0, AllReduce, {"group_size": 2}),
]


@pytest.mark.parametrize("case, state, view, now, kind, fields", SYNC_CASES, ids=[c[0] for c in SYNC_CASES])
def test_decide_sync(case, state, view, now, kind, fields):
    action = rules.decide_sync(state, view, now)
    assert isinstance(action, kind), (case, action)
    assert {k: getattr(action, k) for k in fields} == fields, (case, action)
    assert action.reason


JOIN = dict(inner_steps=100, overlap=False, waits_for_min_peers=False, finished=False, now=0.0, deadline=600.0)
JOIN_CASES = [
    ("an empty swarm: start at once", 0, {}, {}, Start, {"phase": T}),
    ("the swarm is ahead: catch up", 2, {"a": rec(5), "b": rec(5)}, {}, CatchUp, {}),
    ("the round has just begun: join it", 5, {"a": rec(5, T, inner_step=10)}, {}, Start, {"phase": T}),
    ("the round is well under way: wait for its end", 5, {"a": rec(5, T, inner_step=60)}, {}, Wait, {}),
    ("a peer of the round is syncing: wait", 5, {"a": rec(5, S)}, {}, Wait, {}),
    ("the first round of a swarm that waited for its peers: start whatever the progress", 0,
     {"a": rec(0, T, inner_step=90)}, {"waits_for_min_peers": True}, Start, {}),
    ("at the deadline: start anyway", 5, {"a": rec(5, S)}, {"now": 600.0}, Start, {}),
    ("the run is finished: nothing to wait for", 5, {"a": rec(5, S)}, {"finished": True}, Start, {}),
    ("overlap: announced as join, syncing peers do not block the start", 5, {"a": rec(5, S, inner_step=5)},
     {"overlap": True}, Start, {"phase": J}),
    ("a newcomer seeing peers ahead it cannot verify yet waits instead of starting a chain of its own", 0, {},
     {"unverified_ahead": 2}, Wait, {}),
    ("... bounded by the deadline", 0, {}, {"unverified_ahead": 2, "now": 600.0}, Start, {}),
    ("a peer with a certificate of its own is not held back by records it does not follow", 5, {},
     {"unverified_ahead": 2, "head_members": ("a", "b")}, Start, {}),
    ("we waited for this boundary and took its state: start, however far the round went on meanwhile", 5,
     {"a": rec(5, T, inner_step=60), "b": rec(5, T, inner_step=90)}, {"waited": True}, Start, {"phase": T}),
    ("... unless a peer of the round is syncing already: we would miss its group", 5,
     {"a": rec(5, T, inner_step=60), "b": rec(5, S)}, {"waited": True}, Wait, {}),
    ("... unless the swarm moved on again: catch up first", 5, {"a": rec(6), "b": rec(6)}, {"waited": True},
     CatchUp, {}),
]


@pytest.mark.parametrize("case, round_, view, changes, kind, fields", JOIN_CASES, ids=[c[0] for c in JOIN_CASES])
def test_decide_join(case, round_, view, changes, kind, fields):
    action = rules.decide_join(round_, view, **{**JOIN, **changes})
    assert isinstance(action, kind), (case, action)
    assert {k: getattr(action, k) for k in fields} == fields, (case, action)


CATCH_UP_CASES = [
    ("nobody: stay", 3, {}, Stay, {}),
    ("the swarm is in our round: stay", 3, {"a": rec(3), "b": rec(3)}, Stay, {}),
    ("behind: the majority of the swarm's round, never a minority donor", 1,
     {"a": rec(4, T, "x"), "b": rec(4, S, "x"), "c": rec(4, T, "y")}, Download,
     {"target": 4, "digest": "x", "exact_round": False}),
    ("client-mode peers vote, and donate last (by push)", 1,
     {"a": rec(4, T, "x", client=True), "b": rec(4, T, "x")}, Download, {"donors": ("b", "a")}),
    ("only client-mode peers hold the round: they are the donors", 1,
     {"a": rec(4, T, "x", client=True), "c": rec(4, S, "x", client=True)}, Download, {"donors": ("a", "c")}),
    ("repairing and joining peers neither vote nor donate", 1,
     {"a": rec(4, R, "y"), "b": rec(4, J, "y"), "c": rec(4, T, "x")}, Download, {"digest": "x", "donors": ("c",)}),
    ("alone ahead of three: back to their round exactly", 6, {"a": rec(4), "b": rec(4), "c": rec(4)}, Download,
     {"target": 4, "exact_round": True}),
]


@pytest.mark.parametrize("case, round_, view, kind, fields", CATCH_UP_CASES, ids=[c[0] for c in CATCH_UP_CASES])
def test_decide_catch_up(case, round_, view, kind, fields):
    action = rules.decide_catch_up(round_, view, random.Random(0))
    assert isinstance(action, kind), (case, action)
    assert {k: getattr(action, k) for k in fields} == fields, (case, action)


def test_donors_come_in_random_order_so_the_load_spreads():
    view = {p: rec(4) for p in "abcdef"}
    orders = {rules.decide_catch_up(0, view, random.Random(seed)).donors for seed in range(10)}
    assert len(orders) > 1 and all(sorted(o) == list("abcdef") for o in orders)


@pytest.mark.parametrize("case, round_, view, min_peers, now, kind", [
    ("alone and asked for one peer", 0, {}, 1, 0.0, Start),
    ("two of three ready: wait", 0, {"a": rec(0, J, ready=True), "b": rec(0, J)}, 3, 0.0, Wait),
    ("three of three ready", 0, {"a": rec(0, J, ready=True), "b": rec(0, J, ready=True)}, 3, 0.0, Start),
    ("the deadline: start with who is there", 0, {}, 3, 120.0, Start),
    ("the swarm is past our round (lingering at its end): join now", 0, {"a": rec(3, D), "b": rec(3, D)}, 4, 0.0,
     Start),
    ("a resumed peer at the swarm's round still waits", 3, {"a": rec(3, T, ready=True)}, 3, 0.0, Wait),
])
def test_decide_first_round(case, round_, view, min_peers, now, kind):
    assert isinstance(rules.decide_first_round(view, round_, min_peers, now, 120.0, 0.25), kind), case


@pytest.mark.parametrize("case, view, now, kind", [
    ("the swarm holds the next round: take it", {"a": rec(4), "b": rec(4)}, 0.0, CatchUp),
    ("the round is still running: wait", {"a": rec(3, S)}, 0.0, Wait),
    ("nobody of the round is left: stop waiting", {"a": rec(3, R)}, 0.0, Stay),
    ("the deadline", {"a": rec(3, S)}, 600.0, Stay),
])
def test_decide_round_end(case, view, now, kind):
    assert isinstance(rules.decide_round_end(3, view, now, 600.0, 1.0), kind), case


@pytest.mark.parametrize("case, view, now, kind", [
    ("nobody behind: leave", {"a": rec(5, D)}, 0.0, Leave),
    ("a peer still training an earlier round: stay a donor", {"a": rec(4, T)}, 0.0, Wait),
    ("a joiner still loading: stay", {"a": rec(0, J)}, 0.0, Wait),
    ("a repairing peer is not waited for", {"a": rec(4, R)}, 0.0, Leave),
    ("the deadline", {"a": rec(4, T)}, 60.0, Leave),
    ("the others of the last round hold another state: repair", {"a": rec(5, D, "x"), "b": rec(5, D, "x")}, 0.0,
     Repair),
])
def test_decide_linger(case, view, now, kind):
    assert isinstance(rules.decide_linger(5, view, now, 60.0, 1.0, digest="good"), kind), case


def test_linger_waits_for_a_peer_of_our_round_whose_state_we_could_not_verify():
    assert isinstance(rules.decide_linger(5, {}, 0.0, 60.0, 1.0, "ours", unverified=["x"]), Wait)
    assert isinstance(rules.decide_linger(5, {}, 60.0, 60.0, 1.0, "ours", unverified=["x"]), Leave)  # bounded


def test_decide_overlap_entry():
    assert isinstance(rules.decide_overlap_entry(3, {"a": rec(3, S)}), TrainAhead)
    assert isinstance(rules.decide_overlap_entry(3, {"a": rec(3, T), "b": rec(2, S)}), Start)


@pytest.mark.parametrize("case, got, view, exact, want", [
    ("the round asked for", 4, {}, False, (4, "m", None)),
    ("moved on, vouched for by the others", 5, {"d": rec(5, T, "x"), "a": rec(5, T, "y"), "b": rec(5, T, "y")},
     False, (5, "y", None)),
    ("moved on, and nobody else holds that round", 5, {"d": rec(5, T, "x"), "a": rec(4, T, "m")}, False,
     (5, None, "no other peer vouches for its round 5")),
    ("moved on, and it is the only synced peer: its own record", 5, {"d": rec(5, T, "x")}, False, (5, "x", None)),
    ("going back needs exactly the round", 5, {}, True, (4, "m", None)),
])
def test_donation_target(case, got, view, exact, want):
    assert rules.donation_target(4, "m", got, "d", lambda: view, exact) == want, case


def test_group_mismatch():
    assert rules.group_mismatch(3, "x", {"a": {"round": 3, "digest": "x"}}) is None
    assert rules.group_mismatch(3, "x", {"a": {"round": 3, "digest": "y"}}) == {"a": "y"}
    assert rules.group_mismatch(3, "x", {"a": {"round": 2, "digest": "x"}}) == {}


def test_no_solo_step_that_would_leave_our_certified_chain():
    """Found by benchmarks/protocol_sim.py: a peer cut off from the rest of its group (a partition, a freeze across
    the others' commit) stepped alone, certifying another state for a round the others certified. A peer now never
    certifies a round its own chain would not follow: it waits, tries cooling round-mates again, and gives up with
    an error after swarm.round_timeout rather than fork."""
    head = ("b", "c", "me")  # 1 of these 3 alone is not half
    alone = sync_state(alone_since=0.0, confirm_for=7.0, me="me", head_members=head, round_deadline=600.0)
    assert isinstance(rules.decide_sync(alone, {}, 100.0), Wait)
    assert isinstance(rules.decide_sync(alone, {}, 600.0), GiveUp)
    cooling = sync_state(me="me", head_members=head, cooling=frozenset({"b"}), round_deadline=600.0)
    action = rules.decide_sync(cooling, {"b": rec(3, S)}, 100.0)
    assert isinstance(action, AllReduce) and action.members == ("b",)
    assert isinstance(rules.decide_sync(sync_state(alone_since=0.0, confirm_for=7.0), {}, 100.0), Solo)
    pair = sync_state(alone_since=0.0, confirm_for=7.0, me="me", head_members=("b", "me"))
    assert isinstance(rules.decide_sync(pair, {}, 100.0), Solo)  # the survivor of a pair keeps half of it


def test_survivors_below_half_wait_for_their_restarted_members_instead_of_refusing_every_group():
    """Found by benchmarks/chaos.py: 3 of a group of 5 were killed and restarted from their checkpoints (same
    identities); the survivors formed groups of 2 and refused each one after its transfer ("only 2 of the 5 members
    would sign"), while the restarted members waited for the round to end: a livelock. Now the survivors wait for
    the members live in their round, and those start the round at once (decide_join)."""
    head = ("a", "b", "c", "d", "me")
    s = sync_state(me="me", head_members=head, round_deadline=600.0)
    view = {"a": rec(3, S), "b": rec(3, J, ""), "c": rec(3, J, "")}
    action = rules.decide_sync(s, view, 10.0)
    assert isinstance(action, Wait) and "waiting for 2 of them" in action.reason, action
    assert isinstance(rules.decide_sync(s, view, 600.0), GiveUp)
    view["b"] = rec(3, T)  # b restarted and trains: waited for like any round-mate, until the straggler deadline
    action = rules.decide_sync(s, view, 10.0)
    assert isinstance(action, AllReduce) and action.members == ("a", "b"), action
    action = rules.decide_sync(s, view, 101.0)  # after it, a group without b would not keep half: wait
    assert isinstance(action, Wait) and "waiting for 2 of them" in action.reason, action
    view["b"] = rec(3, S)
    action = rules.decide_sync(s, view, 101.0)
    assert isinstance(action, AllReduce) and action.members == ("a", "b"), action


@pytest.mark.parametrize("case, me, view, kind", [
    ("half of our group is left in the round: the hand-off needs us, start now", "me",
     {"a": rec(5, T, inner_step=60), "b": rec(5, T, inner_step=60)}, Start),
    ("enough of our group is left: wait for the round's end as any newcomer", "me",
     {"a": rec(5, T, inner_step=60), "b": rec(5, T, inner_step=60), "c": rec(5, T, inner_step=60)}, Wait),
    ("not a member of that group: wait", "x", {"a": rec(5, T, inner_step=60)}, Wait),
    ("nobody of our group is left: nothing to hand off to, wait", "me", {"z": rec(5, T, inner_step=60)}, Wait),
])
def test_a_restarted_member_starts_at_once_when_the_hand_off_needs_it(case, me, view, kind):
    head = ("a", "b", "c", "d", "e", "me")
    action = rules.decide_join(5, view, **JOIN, me=me, head_members=head)
    assert isinstance(action, kind), (case, action)


def test_peers_that_cooled_down_most_of_their_round_do_not_step_alone():
    """Found by benchmarks/protocol_sim.py --scale 70: when no group can form (every attempt failing for everyone:
    an outage, or a group above the certificate's cap), each peer cooled every other one down after
    swarm.round_timeout and stepped alone: as many states of the round as peers. A group (a solo step included)
    smaller than the round-mates cooling down is the minority, and gives them another chance instead."""
    view = {"a": rec(3, S), "b": rec(3, S)}
    action = rules.decide_sync(sync_state(cooling=frozenset({"a", "b"}), alone_since=1.0), view, 8.0)
    assert isinstance(action, AllReduce) and action.members == ("a", "b"), action
    view = {"a": rec(3, S), "b": rec(3, S), "c": rec(3, S)}
    action = rules.decide_sync(sync_state(cooling=frozenset({"c"})), view, 8.0)
    assert isinstance(action, AllReduce) and action.members == ("a", "b"), action  # the majority leaves c out


def test_above_the_certificate_cap_the_seated_peers_form_the_group_and_the_others_sit_the_round_out():
    from p2p_diloco.protocol.certificate import MAX_MEMBERS
    peers = [f"p{i:03d}" for i in range(MAX_MEMBERS + 6)]
    seated = set(consensus.seats(3, peers, None, MAX_MEMBERS))
    assert len(seated) == MAX_MEMBERS
    for me in peers[:12]:
        view = {pid: rec(3, S) for pid in peers if pid != me}
        action = rules.decide_sync(sync_state(me=me), view, 1.0)
        if me in seated:
            assert isinstance(action, AllReduce) and set(action.members) | {me} == seated, action
        else:
            assert isinstance(action, Wait) and "sitting this round out" in action.reason, action


def test_seats_rotate_with_the_round_and_keep_half_of_the_previous_group():
    peers = [f"p{i:03d}" for i in range(200)]
    previous = consensus.seats(3, peers, None, 64)
    nxt = consensus.seats(4, peers, previous, 64)
    assert len(nxt) == 64 and len(set(nxt) & set(previous)) >= 32  # the hand-off rule holds
    assert set(nxt) != set(previous)  # who sits out changes
    assert consensus.seats(4, list(reversed(peers)), previous, 64) == nxt  # every peer computes the same seats
    assert consensus.seats(4, peers[:10], previous, 64) == sorted(peers[:10])


def test_every_member_names_the_same_matchmaking_leader_and_the_lead_moves_with_the_round():
    peers = [f"p{i:02d}" for i in range(8)]
    leaders = set()
    for round_ in range(3, 13):
        named = set()
        for me in peers:
            view = {pid: rec(round_, S) for pid in peers if pid != me}
            action = rules.decide_sync(sync_state(round=round_, me=me), view, 1.0)
            assert isinstance(action, AllReduce) and len(action.members) == 7, action
            named.add(action.leader)
        assert len(named) == 1 and named <= set(peers), named  # one leader, whoever decides
        leaders |= named
    assert len(leaders) >= 4, leaders  # 10 rounds, 8 peers: the lead moves


@pytest.mark.parametrize("case, members, clients, me_client, want", [
    ("a client-mode member never leads (it accepts no connection), nor do we when we are one", "abc", "b", True, "c"),
    ("nobody able to lead: hivemind's own election", "ab", "b", True, None),
    ("a member whose record we lack is not known to accept connections", "az", "", True, None),
    ("we lead when the order drawn from the round puts us first", "ab", "", False, "a"),
])
def test_matchmaking_leader(case, members, clients, me_client, want):
    view = {pid: rec(3, S, client=pid in clients) for pid in "abc"}
    me = "a"
    assert consensus.matchmaking_leader(3, list(members), {k: v for k, v in view.items() if k != me}, me,
                                        me_client) == want, case
