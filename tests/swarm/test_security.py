"""An open swarm survives bad peers (docs/security.md): a peer sending corrupted pseudo-gradients and a stranger in
a private run, with real subprocess peers on 127.0.0.1 (the other attacks and a lying donor: tests/sim)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.planned import free_port
from tests.swarm.helpers import FAULT, Proc, digests_by_round, eval_by_round, events_of, start_peers, wait_for_event

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(420)]
ROUNDS = 3


def _run(tmp_path: Path, tag: str, run_id: str, last: list[str], peers: int = 3) -> list[Proc]:
    """``peers`` peers with fixed data seeds; the last one also gets ``last``."""
    extra = {i: ["--data-seed", str(i)] for i in range(peers)}
    extra[peers - 1] += last
    procs = start_peers(peers, tmp_path, tag, run_id, ROUNDS, extra=extra)
    for p in procs:
        assert p.wait(300) == 0, p.stderr_tail()
    return procs


def test_malicious_peer_is_left_out_by_every_reducer(tmp_path, reap):
    """A 3-peer swarm whose 3rd peer sends NaN pseudo-gradients every round (through the real reducers of the TCP
    data plane): every honest peer's reducers leave it out (``contribution_excluded`` names it), the honest peers
    stay finite and keep learning, and every peer holds the same digest after every round. The other attacks, and
    the comparison with an honest-only run, are scenarios of tests/sim/test_joining.py."""
    procs = _run(tmp_path, reap, "t-sec-nan", ["--debug-corrupt-pseudo-gradient", "nan"])
    honest, attacker = procs[:2], procs[2]
    for p in honest:
        events = events_of(tmp_path, p)
        losses = eval_by_round(events)
        assert sorted(losses) == list(range(ROUNDS + 1)), losses
        assert all(math.isfinite(v) for v in losses.values()), losses
        assert losses[ROUNDS] < losses[0] - 0.5, losses  # still learning
        assert [e["group_size"] for e in events if e["event"] == Event.ALLREDUCE_DONE] == [3] * ROUNDS
        excluded = {e["peer"] for e in events if e["event"] == Event.CONTRIBUTION_EXCLUDED}
        assert excluded == {attacker.peer_id}, excluded
    assert all(len(d) == 1 for d in digests_by_round(tmp_path, procs).values()), digests_by_round(tmp_path, procs)


def _identities(tmp_path: Path, n: int) -> list[tuple[str, str]]:
    """``n`` identity files and their peer ids (an operator's run members are known in advance this way)."""
    out = []
    for i in range(n):
        identity = Identity(tmp_path / f"id{i}.key")
        out.append((identity.path, identity.peer_id))
    return out


def test_private_run_refuses_a_stranger(tmp_path, reap):
    """Two members of a private run (swarm.allowed_peers, given as a file) and a stranger of the same run id and
    config: the members only ever average with each other, and the stranger never gets a group or their state."""
    (id0, pid0), (id1, pid1) = _identities(tmp_path, 2)
    members = tmp_path / "members.txt"
    members.write_text(f"# the run's members\n{pid0}\n{pid1}  # second\n")
    common = ["--run-id", "t-private", "--max-rounds", "2", "--log-dir", str(tmp_path), *FAULT]
    private = [*common, "--allowed-peers", str(members), "--set", "swarm.min_peers=2"]
    port = free_port()  # the first member's address is known in advance: everyone starts at once
    first = Proc(["join", "--identity-path", id0, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", *private], reap)
    joining = ["--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{pid0}", "--initial-peers-wait", "90"]
    # the stranger starts with the members, so that it is there from the first round on
    stranger = Proc(["join", *joining, *common], reap)
    procs = [first, Proc(["join", *joining, "--identity-path", id1, *private], reap)]
    for p in [stranger, *procs]:
        p.wait_joined()
    for p in procs:
        assert p.wait(300) == 0, p.stderr_tail()
    # it did try (matchmaking with the members, or a download of their state) and was refused
    wait_for_event(tmp_path / stranger.peer_id / "events.jsonl",
                   lambda e: e["event"] in (Event.ALLREDUCE_FAILED, Event.STATE_DOWNLOAD_FAILED), 60, stranger)
    stranger.kill_group()
    for p in procs:
        events = events_of(tmp_path, p)
        assert [e["group_size"] for e in events if e["event"] == Event.ALLREDUCE_DONE] == [2, 2]
    assert all(len(d) == 1 for d in digests_by_round(tmp_path, procs).values())
    theirs = events_of(tmp_path, stranger)
    assert not [e for e in theirs if e["event"] == Event.ALLREDUCE_DONE and e["group_size"] > 1]
    assert not [e for e in theirs if e["event"] == Event.STATE_LOADED]


@pytest.mark.light
def test_a_peer_outside_its_own_allowlist_is_a_one_line_error(tmp_path, reap):
    (_, pid0), (id1, _) = _identities(tmp_path, 2)
    proc = Proc(["join", "--identity-path", id1, "--allowed-peers", pid0, "--run-id", "t-notlisted",
                 "--log-dir", str(tmp_path), *FAULT], reap)
    assert proc.wait(120) == 2
    assert "is not in swarm.allowed_peers" in proc.stderr_tail(), proc.stderr_tail()
