"""The decisions every peer takes alone from the live records: they must agree without a coordinator."""

import random

import pytest
import torch

from p2p_diloco.outer.optimizer import digest as digest_of
from p2p_diloco.outer.state import check_donated_state
from p2p_diloco.protocol import consensus
from p2p_diloco.protocol.records import PeerRecord

pytestmark = pytest.mark.unit


def rec(round_, digest, phase="train", inner_step=0):
    return PeerRecord.from_wire({"round": round_, "digest": digest, "phase": phase, "inner_step": inner_step})


def test_majority_digest_counts_and_breaks_ties_the_same_way_everywhere():
    assert consensus.majority_digest(["b", "a", "b"]) == "b"
    assert consensus.majority_digest(["b", "a"]) == "a"  # tie: the smallest wins, whatever the order
    assert consensus.majority_digest(["a", "b"]) == "a"
    assert consensus.majority_digest([]) is None
    assert consensus.majority_digest(["", ""]) is None


def test_needs_repair_only_for_the_minority_of_our_round():
    peers = {"p1": rec(3, "good"), "p2": rec(3, "good"), "p3": rec(2, "old"), "p4": rec(3, "bad", "join")}
    assert consensus.needs_repair(peers, 3, "bad") == "good"
    assert consensus.needs_repair(peers, 3, "good") is None
    # peers of other rounds and peers still joining do not vote
    assert consensus.needs_repair({"p3": rec(2, "old"), "p4": rec(3, "x", "join")}, 3, "mine") is None
    # two peers that disagree: exactly one of them repairs
    two = [consensus.needs_repair({"q": rec(1, other)}, 1, mine) for mine, other in (("aa", "bb"), ("bb", "aa"))]
    assert two == [None, "aa"]


def test_pick_donors_takes_the_majority_of_the_highest_round_only():
    peers = {"a": rec(5, "x"), "b": rec(5, "x"), "c": rec(5, "y"), "d": rec(4, "z"), "e": rec(6, "w", "repair")}
    assert consensus.swarm_round(peers) == 5  # "repair" records do not count
    digest, donors = consensus.pick_donors(peers, 5, random.Random(0))
    assert digest == "x" and sorted(donors) == ["a", "b"]
    assert consensus.pick_donors({}, 5, random.Random(0)) == (None, [])
    assert consensus.swarm_round({}) == -1


def test_round_well_under_way():
    H = 100
    one = lambda step, phase="train": {"a": rec(2, "x", phase, inner_step=step)}  # noqa: E731
    assert not consensus.round_well_under_way(one(49), 2, H)  # N=1: worth joining up to H/2 late
    assert consensus.round_well_under_way(one(51), 2, H)
    three = {k: rec(2, "x", inner_step=s) for k, s in (("a", 10), ("b", 24), ("c", 3))}
    assert not consensus.round_well_under_way(three, 2, H)  # N=3: up to H/4
    three["b"] = rec(2, "x", inner_step=26)
    assert consensus.round_well_under_way(three, 2, H)
    assert consensus.round_well_under_way(one(0, "sync"), 2, H)  # someone already syncing: too late
    assert not consensus.round_well_under_way({"a": rec(1, "x", "sync")}, 2, H)  # other rounds do not matter
    assert not consensus.round_well_under_way(one(H, "done"), 2, H)  # a finished swarm: nothing to wait for


def test_check_donated_state_refuses_everything_but_what_we_asked_for():
    import torch

    from p2p_diloco.outer.optimizer import digest

    theta = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(3), torch.zeros(2, 2)]  # ours: theta and momentum
    state = [torch.ones(3), torch.ones(2, 2), torch.zeros(3), torch.zeros(2, 2)]
    meta = {"fp": "fp1", "round": 4, "digest": digest(state)}
    check = check_donated_state
    assert check(meta, state, theta, "fp1", 4, meta["digest"]) is None
    assert check(meta, state, theta, "fp1", 3, None) is None  # a donor already further along is fine...
    assert "round" in check(meta, state, theta, "fp1", 3, None, exact_round=True)  # ...except for a repair
    assert "round" in check(meta, state, theta, "fp1", 5, None)
    assert "fingerprint" in check(meta, state, theta, "other", 4, None)
    assert "majority" in check(meta, state, theta, "fp1", 4, "someone-else")
    assert "expected 4 outer-state tensors" in check(meta, state[:3], theta, "fp1", 4, None)
    assert "tensor 0: (4,)" in check(meta, [torch.ones(4), *state[1:]], theta, "fp1", 4, None)
    # a momentum of another shape is refused before anything is taken (it used to pass, then fail mid-load)
    assert "tensor 3: (4,)" in check(meta, [*state[:3], torch.zeros(4)], theta, "fp1", 4, None)
    moved = [t.clone() for t in state]
    moved[2][0] = 1.0  # the momentum is in the digest too
    assert "digest" in check(meta, moved, theta, "fp1", 4, None)
    flipped = [t.clone() for t in state]
    flipped[0][0] = 2.0
    assert "digest" in check(meta, flipped, theta, "fp1", 4, None)


def test_swarm_round_needs_two_peers_once_there_are_three_others():
    # one or two others: a straggler follows whoever went ahead (nobody else to ask)
    assert consensus.swarm_round({"a": rec(7, "x")}) == 7
    assert consensus.swarm_round({"a": rec(7, "x"), "b": rec(3, "y")}) == 7
    # three or more: two of them must have reached the round; one liar claiming round 1000 is not followed
    assert consensus.swarm_round({"liar": rec(1000, "z"), "b": rec(3, "y"), "c": rec(3, "y")}) == 3
    assert consensus.swarm_round({"liar": rec(1000, "z"), "b": rec(4, "y"), "c": rec(3, "y")}) == 4
    assert consensus.swarm_round({"l": rec(9, "z"), "m": rec(9, "z"), "b": rec(3, "y"), "c": rec(3, "y")}) == 9
    assert consensus.swarm_round({"l": rec(9, "z"), "b": rec(3, "y"), "c": rec(3, "y"), "d": rec(3, "y")}) == 3
    # a group that went ahead (two peers at least) is followed however many stayed behind
    behind = {f"s{i}": rec(3, "y") for i in range(6)}
    assert consensus.swarm_round({**behind, "a": rec(4, "x"), "b": rec(4, "x")}) == 4


def test_a_peer_alone_ahead_of_three_or_more_goes_back():
    three = {"b": rec(3, "y"), "c": rec(3, "y"), "d": rec(2, "w")}
    assert consensus.alone_ahead(three, 5)  # nobody will follow us: we must go back to round 3
    assert not consensus.alone_ahead({**three, "e": rec(5, "x")}, 5)  # another peer is with us: they follow
    assert not consensus.alone_ahead({"b": rec(3, "y"), "c": rec(3, "y")}, 5)  # two others follow us anyway
    assert not consensus.alone_ahead(three, 3)
    assert not consensus.alone_ahead({**three, "d": rec(2, "w", "repair")}, 5)  # only synced peers count


def test_donated_state_with_non_finite_values_is_refused():
    theta = [torch.zeros(3), torch.zeros(3)]
    bad = [torch.tensor([0.0, float("nan"), 0.0]), torch.zeros(3)]
    meta = {"fp": "f", "round": 2, "digest": digest_of(bad)}
    assert check_donated_state(meta, bad, theta, "f", 2, meta["digest"]) == "it holds non-finite values"
    good = [torch.ones(3), torch.zeros(3)]
    meta = {"fp": "f", "round": 2, "digest": digest_of(good)}
    assert check_donated_state(meta, good, theta, "f", 2, meta["digest"]) is None
