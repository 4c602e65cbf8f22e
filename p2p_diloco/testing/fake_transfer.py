"""State transfers of the in-memory swarm (:mod:`.fake_swarm`): downloads from a reachable donor, and pushes from a
client-mode donor that cannot be dialed (it sees the asker's wish at one of its heartbeats), each taking virtual
time, failing as a dead or frozen donor makes them fail, and a liar serving a self-consistent state that is not the
majority's. Functions of the :class:`~.fake_swarm.FakeSwarm` they act for (``self``)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import RoundFailed
from ..outer.optimizer import digest
from ..protocol.push import should_push
from ..protocol.records import Phase, PeerRecord


def download(self: Any, peer_id: str, shard: int | None = None) -> tuple[dict, list[torch.Tensor]]:
    """``self``'s download of ``peer_id``'s state (``FakeSwarm.download_state``)."""
    net, clock = self.net, self.net.clock
    donor = net.swarms.get(peer_id)
    fail = f"state download from {peer_id} failed"
    if donor is None or donor.dead or donor.peer_id is None:
        raise RoundFailed(f"{fail}: the peer is not reachable")
    if donor.sc.client_mode:
        return receive_push(self, donor, shard)
    if net.sim.frozen(peer_id):
        clock.sleep(self.sc.next_chunk_timeout)
        raise RoundFailed(f"{fail}: TimeoutError")
    meta, tensors = served(self, donor, shard)
    clock.sleep(min(net.download_seconds, self.sc.state_timeout))
    if net.download_seconds > self.sc.state_timeout:
        raise RoundFailed(f"{fail}: TimeoutError")
    if donor.dead or net.sim.frozen(peer_id):
        raise RoundFailed(f"{fail}: stream reset")
    return meta, tensors

def served(self: Any, donor: Any, shard: int | None) -> tuple[dict, list[torch.Tensor]]:
    """What ``donor`` hands over: its state, or (a liar) a self-consistent state that is not the majority's."""
    meta, tensors = donor.provider() if shard is None else donor.provider(shard)
    tensors = [t.clone() for t in tensors]
    if donor.name in self.net.liars and shard is None:
        n = len(tensors) // 2
        for t in tensors[:n]:
            t.add_(1e-2)
        meta = dict(meta, digest=digest(tensors))
    return meta, tensors

def pushes_to(self: Any, asker: dict) -> bool:
    """A client-mode peer's heartbeat: would it push its state to the peer whose record is ``asker``?"""
    certified = self.record.get("round") == 0 or bool(self.record.get("head"))
    synced = self.record.get("phase") in (Phase.TRAIN, Phase.SYNC, Phase.DONE)
    return synced and should_push(PeerRecord.from_wire(asker), self.name, int(self.record.get("round", -1)),
                                  certified)

def receive_push(self: Any, donor: Any, shard: int | None) -> tuple[dict, list[torch.Tensor]]:
    """A client-mode donor cannot be dialed: ask it for a push (``wants``/``ask`` in our record) and wait, within
    ``swarm.state_timeout``, until it sees the wish at one of its heartbeats while alive and not frozen and
    holding the round, then for the transfer (``download_seconds``)."""
    net, clock = self.net, self.net.clock
    fail = f"state download from {donor.name} failed"
    if self.sc.client_mode:
        raise RoundFailed(f"{fail}: both peers are in client mode (neither accepts a connection)")
    if shard is not None:
        raise RoundFailed(f"{fail}: a client-mode peer cannot push a shard")
    wants = int(self.seen.get(donor.name, (donor.record,))[0].get("round", 0))
    self.publish(wants=wants, ask=donor.name)
    deadline = clock.monotonic() + self.sc.state_timeout
    try:
        while not (not donor.dead and not net.sim.frozen(donor.name) and pushes_to(donor, self.record)):
            if clock.monotonic() + donor.sc.heartbeat_period >= deadline:
                clock.sleep(max(deadline - clock.monotonic(), 0.0))
                raise RoundFailed(f"{fail}: no push within swarm.state_timeout")
            clock.sleep(donor.sc.heartbeat_period)
        meta, tensors = served(self, donor, None)
        clock.sleep(min(net.download_seconds, max(deadline - clock.monotonic(), 0.0)))
        if net.download_seconds > self.sc.state_timeout:
            raise RoundFailed(f"{fail}: TimeoutError")
        if donor.dead or net.sim.frozen(donor.name):
            raise RoundFailed(f"{fail}: the push stopped (stream reset)")
        return meta, tensors
    finally:
        if not self.dead:
            self.publish(wants=None, ask="")
