"""Sharded mode: every shard of a round is averaged with the same peers (issue 17, point 11), whichever local rank
process of a peer keeps it (p2p_diloco/outer/shards.py ``shard_groups_problem``)."""

import pytest

from p2p_diloco.outer.shards import shard_groups_problem

pytestmark = pytest.mark.unit

# Peers A (1 process: keeps shards 0, 1, 2), B (2 ranks: B keeps 0 and 2, B1 keeps 1), C (3 ranks: C, C1, C2).
SAME = {0: {"A": "A", "B": "B", "C": "C"}, 1: {"A": "A", "B1": "B", "C1": "C"}, 2: {"A": "A", "B": "B", "C2": "C"}}


def _with(shard: int, members: dict) -> dict:
    return {**SAME, shard: members}


@pytest.mark.parametrize("members, problem", [
    (SAME, None),
    # shard 1 met D instead of C (its shard-1 process joined another group)
    (_with(1, {"A": "A", "B1": "B", "D1": "D"}),
     "shard 1 was averaged with other peers than shard 0 (only in shard 1: ['D'], only in shard 0: ['C'])"),
    # a smaller group for shard 2 (sizes are also checked by the averagers; members here)
    (_with(2, {"A": "A", "B": "B"}),
     "shard 2 was averaged with other peers than shard 0 (only in shard 2: [], only in shard 0: ['C'])"),
    # a member that gathered no peer (or not a string) fails the round
    (_with(1, {"A": "A", "B1": "B", "C1": None}), "member C1 of shard 1's group names no peer"),
    (_with(2, {"A": "A", "B": "B", "C2": 7}), "member C2 of shard 2's group names no peer"),
    (_with(1, {"A": "A", "B1": "B", "C1": ""}), "member C1 of shard 1's group names no peer"),
    # two processes averaging shard 1 for the same peer: the same peer set, but C would count twice
    (_with(1, {"A": "A", "B1": "B", "X1": "B"}), "shard 1's group has two members for peer B (B1, X1)"),
    # shard 0 is kept by every peer's rank 0: a member there naming another peer is not who it says
    (_with(0, {"A": "A", "B": "B", "C": "D"}), "member C of shard 0's group names another peer (D)"),
    # every shard must have a group
    ({0: SAME[0], 2: SAME[2]}, "no group for shards [1]"),
    ({}, "no group for shards [0, 1, 2]"),
])
def test_every_shard_is_averaged_with_the_same_peers(members, problem):
    assert shard_groups_problem(members, 3) == problem


def test_fewer_shards_and_any_order():
    assert shard_groups_problem({0: {"A": "A"}}, 1) is None  # one shard, alone
    assert shard_groups_problem({1: {"B1": "B", "A": "A"}, 0: {"B": "B", "A": "A"}}, 2) is None
