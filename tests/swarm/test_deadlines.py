"""Adaptive deadlines (issue 6, p2p_diloco/deadlines.py) with three real peers.

Peer 2 stalls for STALL seconds before the inner steps of round STALL_ROUND while its records stay live (a stuck
data loader, a GPU hiccup). With ``swarm.deadlines = adaptive`` the other two have seen every round-mate arrive
within a second or so in the earlier rounds, so their straggler deadline is the floor or a little above it;
the attempt in flight ends at the deadline or at the matchmaking window + 0.5 s (hivemind's minimum), whichever
is later, and they finish the round as a pair; the stalled peer catches up from them afterwards. The same run
with ``fixed`` deadlines is the control: the others wait for the straggler (``round_timeout`` is 600 s), which
shows that the test measures the wait it claims.
"""

import pytest

from tests.swarm.helpers import events_of, load_json, start_peers

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

STALL, STALL_ROUND, FLOOR, ROUNDS = 20.0, 4, 3.0, 5
MATCHMAKING = 5.0  # swarm.matchmaking_time in the peers' test config


def _wait_in(events: list[dict], r: int) -> float:
    """Seconds from this peer's inner_done to its allreduce_done in round r."""
    done = next(e["t"] for e in events if e["event"] == "inner_done" and e["round"] == r)
    return next(e["t"] for e in events if e["event"] == "allreduce_done" and e["round"] == r) - done


@pytest.mark.parametrize("deadlines", ["adaptive", "fixed"])
def test_stuck_straggler(tmp_path, reap, deadlines):
    common = ["--set", f"swarm.deadlines={deadlines}", "--set", f"swarm.straggler_floor={FLOOR}"]
    stall = [*common, "--set", f"debug.stall={STALL}", "--set", f"debug.stall_round={STALL_ROUND}"]
    procs = start_peers(3, tmp_path, reap, f"t-deadline-{deadlines}", rounds=ROUNDS,
                        extra={0: common, 1: common, 2: stall})
    for p in procs:
        assert p.wait(240) == 0, p.stderr_tail()
    summaries = [load_json(tmp_path / f"p{i}.json") for i in range(3)]
    assert len({s["global_digest"] for s in summaries}) == 1  # the straggler caught up either way
    events = [events_of(tmp_path, p) for p in procs]
    for ev in events[:2]:
        groups = {e["round"]: e["group_size"] for e in ev if e["event"] == "allreduce_done"}
        dropped = [e for e in ev if e["event"] == "stragglers_dropped"]
        starts = [e for e in ev if e["event"] == "allreduce_start" and e["round"] == STALL_ROUND]
        if deadlines == "fixed":
            assert groups == {r: 3 for r in range(1, ROUNDS + 1)}, groups
            assert not dropped
            assert _wait_in(ev, STALL_ROUND) > STALL / 2  # the control: it waited for the stalled peer
            assert all(s["straggler_s"] == 600.0 for s in starts), starts
            continue
        assert groups[STALL_ROUND] == 2 and all(groups[r] == 3 for r in range(1, STALL_ROUND)), groups
        assert [(d["round"], len(d["peers"])) for d in dropped] == [(STALL_ROUND, 1)], dropped
        # Derived from the earlier rounds' arrival offsets: usually all under a second here, so the floor; on a
        # loaded machine (CI) they can be a few seconds, and the deadline is then above the floor (one CI run).
        # Either way it is far below the fixed cap, and the wait ended at it or at the matchmaking window + 0.5 s.
        assert all(FLOOR <= s["straggler_s"] < STALL / 2 for s in starts), starts
        assert dropped[0]["waited_s"] < max(starts[0]["straggler_s"], MATCHMAKING + 0.5) + 2, (dropped, starts)
        assert _wait_in(ev, STALL_ROUND) < STALL / 2
    if deadlines == "adaptive":  # the stalled peer resynced from the pair instead of averaging
        assert any(e["event"] == "state_loaded" for e in events[2])
