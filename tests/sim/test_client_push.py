"""Client-mode peers holding the newest state (issue 17, point 6): a client accepts no inbound connection, so it
can hand its state over only by pushing it to a reachable peer that asks (protocol/push.py). Without the push, the
one reachable peer restarted behind two clients never catches up, and the clients cannot form a group without it
(a group of clients only never forms): the swarm is wedged."""

from __future__ import annotations

import pytest

from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import assert_consistent, one_digest

pytestmark = pytest.mark.sim

CLIENT = ["swarm.client_mode=true"]


def test_reachable_peer_restarted_behind_two_clients_catches_up_by_push(tmp_path):
    ckpt = tmp_path / "ckpt-r"
    with SimSwarm(["run.max_rounds=8", "swarm.min_peers=3"]) as swarm:
        r = swarm.add(sets=[f"checkpoint.dir={ckpt}"], name="r")
        c1, c2 = swarm.add(sets=CLIENT, name="c1"), swarm.add(sets=CLIENT, name="c2")
        swarm.when(r, lambda e: e["event"] == Event.CHECKPOINT_SAVED and e["round"] == 4,
                   lambda: swarm.net.kill(r.name))
        swarm.run_until(lambda: r.task is not None and r.task.done())
        older = CheckpointStore(ckpt).load(ckpt / "round-00000002.pt")  # the newer checkpoints are lost with its disk
        assert older.round == 2
        restarted = swarm.add(sets=[f"checkpoint.dir={ckpt}", "checkpoint.resume=true"], resume_from=older,
                              name="r2")
        swarm.finish([c1, c2, restarted], max_time=900)
        loaded = restarted.of(Event.STATE_LOADED)
        assert loaded and loaded[0]["round"] >= 4 and loaded[0]["from_peer"] in (c1.name, c2.name), restarted.events
        final = one_digest([c1, c2, restarted])
        assert all(p.summary()["rounds_completed"] == 8 for p in (c1, c2, restarted))
        assert final
        assert_consistent(swarm, [c1, c2, restarted])
        # the clients never took a step without the reachable peer: there was no group to take it in
        assert all(e["group_size"] == 3 for p in (c1, c2, restarted) for e in p.of(Event.ALLREDUCE_DONE))


def test_two_clients_never_push_to_each_other():
    """A client catching up from the other client has no way in (neither accepts a connection): it fails at once
    and takes the reachable peer's state instead."""
    with SimSwarm(["run.max_rounds=4"]) as swarm:
        r = swarm.add(sets=["swarm.min_peers=2"], name="r")
        c1 = swarm.add(sets=["swarm.min_peers=2", *CLIENT], name="c1")
        swarm.run_until(lambda: bool(r.of(Event.OUTER_STEP, round=2)))
        late = swarm.add(sets=CLIENT, name="late")
        swarm.finish()
        loaded = late.of(Event.STATE_LOADED)
        assert loaded and loaded[0]["from_peer"] == r.name, late.events
        one_digest([r, c1, late])
