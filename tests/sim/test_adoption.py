"""The in-memory swarm refuses a peer as the real one does (config/adoption.py, one rule for both): a shared
setting that differs from a live peer's is refused, a per-peer one is not."""

from __future__ import annotations

import pytest

from p2p_diloco.errors import ConfigMismatch
from p2p_diloco.metrics.events import Event
from p2p_diloco.testing.harness import SimSwarm
from tests.sim.helpers import one_digest

pytestmark = pytest.mark.sim


def test_a_peer_with_another_shared_setting_is_refused_and_a_per_peer_one_is_not():
    with SimSwarm(["run.max_rounds=2"]) as swarm:
        a = swarm.add()
        swarm.run_until(lambda: bool(a.of(Event.ROUND_START)))
        other = swarm.add(sets=["train.lr=0.01"])
        swarm.run_until(lambda: other.task.done())
        with pytest.raises(ConfigMismatch, match="train.lr: ours 0.01, theirs 0.001"):
            other.summary()
        own = swarm.add(sets=["data.batch_size=4", "run.max_rounds=2"])
        swarm.finish([a, own])
        one_digest([a, own])
        assert own.summary()["rounds_completed"] == 2
