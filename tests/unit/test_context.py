"""PeerContext.view (p2p_diloco/peer/context.py): a DHT read that times out is retried, but never forever."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from p2p_diloco.errors import SwarmError
from p2p_diloco.peer.context import VIEW_TRIES, PeerContext

pytestmark = pytest.mark.unit


class FlakySwarm:
    """live_peers times out ``timeouts`` times, then answers."""

    def __init__(self, timeouts: float):
        self.timeouts, self.reads = timeouts, 0

    def live_peers(self):
        self.reads += 1
        if self.reads <= self.timeouts:
            raise TimeoutError
        return {"a": "record"}


class Clock:
    def __init__(self, stop_after: int | None = None):
        self.waits, self.stop_after = [], stop_after

    def wait(self, event, seconds: float) -> bool:  # True: stopped
        self.waits.append(seconds)
        return self.stop_after is not None and len(self.waits) >= self.stop_after


def context(swarm, clock) -> PeerContext:
    return PeerContext(cfg=None, clock=clock, stop=SimpleNamespace(), metrics=None, swarm=swarm, state=None,
                       rng=random.Random(0))


def test_a_dht_hiccup_is_retried():
    swarm, clock = FlakySwarm(VIEW_TRIES - 1), Clock()
    assert context(swarm, clock).view() == {"a": "record"}
    assert swarm.reads == VIEW_TRIES and clock.waits == [1.0] * (VIEW_TRIES - 1)


def test_a_dht_that_stopped_answering_ends_the_peer_with_one_line():
    swarm, clock = FlakySwarm(float("inf")), Clock()
    with pytest.raises(SwarmError, match=f"did not answer {VIEW_TRIES} reads") as e:
        context(swarm, clock).view()
    assert swarm.reads == VIEW_TRIES and "\n" not in str(e.value)


def test_a_stop_request_ends_the_retries():
    swarm, clock = FlakySwarm(float("inf")), Clock(stop_after=1)
    with pytest.raises(TimeoutError):
        context(swarm, clock).view()
    assert swarm.reads == 1
