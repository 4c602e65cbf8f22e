"""A peer whose outer state is sharded (``outer.sharding = "sharded"``): rank 0's side.

The round protocol is :class:`~p2p_diloco.peer.Peer`'s, unchanged; only what touches theta goes through
:class:`~p2p_diloco.sharded.ShardedRank`, so that each local rank works on its own logical shards and rank 0 never
holds theta whole: the pseudo-gradient, the all-reduce (one averager per shard), the outer step, loading theta
into the model and state downloads. A 1-process peer is a cluster of one rank that keeps every shard.

The live record carries ``shard_peers``: for each shard j, the peer id of the process (the rank) of this peer that
keeps it, so that a peer catching up can download shard j from the right process of its donor.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .checkpoint import CheckpointError, PeerState
from .peer import Peer
from .sharded import ShardedRank

log = logging.getLogger("p2p_diloco.peer")


class _ShardedSwarm:
    """The peer's :class:`~p2p_diloco.swarm.Swarm` with the all-reduce done by every rank on its shards."""

    def __init__(self, swarm, rank: ShardedRank):
        self._swarm, self._rank = swarm, rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._swarm, name)

    def all_reduce(self, round_, tensors, weight, group_size, gather, should_stop=lambda: False,
                   on_running=lambda: None, matchmaking_time=None, allreduce_timeout=None, matchmaking_timeout=None):
        sc = self._swarm.sc
        args = {"round": round_, "weight": float(weight), "group_size": group_size,
                "matchmaking_time": matchmaking_time or sc.matchmaking_time,
                "allreduce_timeout": allreduce_timeout or sc.allreduce_timeout,
                "matchmaking_timeout": matchmaking_timeout}
        return self._rank.sync(args, gather=gather, should_stop=should_stop, on_running=on_running)


class _ShardedReplica:
    """The peer's replica with theta moving shard by shard (every rank at once)."""

    def __init__(self, base, rank: ShardedRank):
        self._base, self._rank = base, rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def pseudo_gradient(self, theta, out) -> None:
        for o, d in zip(out, self._rank.pseudo_gradient(self._base.params), strict=True):
            if o is not d:  # (the peer passes the ranks' own buffers: ShardedPeer._delta_buffers)
                o.copy_(d)

    def load(self, theta) -> None:
        self._rank.load(self._base.params)


class ShardedPeer(Peer):
    """:class:`~p2p_diloco.peer.Peer` with ``outer.sharding = "sharded"`` (module docstring)."""

    def _build_outer(self):
        self.shards = ShardedRank(self.cfg, self.cluster, self.params)
        return self.shards.outer

    def _build_swarm(self, swarm_factory: Callable[..., Any]):
        swarm = swarm_factory(self.cfg, self.theta, self.shards.provider, shards=self.shards.outer.owned)
        self.shards.swarm = swarm
        return _ShardedSwarm(swarm, self.shards)

    def _theta_digest(self) -> str:
        return self.shards.outer.local_digest()

    def _delta_buffers(self) -> list[torch.Tensor]:
        return self.shards.delta  # no second copy: the all-reduce and the outer step use these

    def _outer_step(self, delta: list[torch.Tensor]) -> None:
        self.shards.step(self.round + 1)  # delta is the ranks' own buffers (ShardedRank.delta)

    def _build_trainer(self) -> None:
        super()._build_trainer()
        self.replica = _ShardedReplica(self.replica, self.shards)
        if self.cluster:  # the other ranks start their DHT nodes (joined to ours) and their shards' averagers
            self.cluster.broadcast_objects([self.swarm.visible_maddrs()])
        ids = self.shards.ranks.all_gather(self.swarm.peer_id)
        shard_peers = [ids[j % len(ids)] for j in range(self.shards.layout.num_shards)]
        self.swarm.update(shard_peers=shard_peers)
        self.digest = self.shards.outer.refresh_digests()  # every rank's shard digests, from now on

    def _outer_for_checkpoint(self) -> tuple[list, list, dict]:
        """The shards go to per-shard files, written by every rank before rank 0 writes the checkpoint."""
        # the checkpoints the store keeps once this one is saved (if the save fails, the newest ones stay whole)
        rounds = [int(p.name[6:-3]) for p in self.store.paths()]  # round-XXXXXXXX.pt
        keep = rounds[len(rounds) - self.store.keep + 1:] if self.store.keep > 1 else []
        problem = self.shards.save([str(self.store.directory), self.round, keep])
        if problem:
            raise OSError(problem)
        return [], [], {"shard_digests": list(self.shards.outer.digests)}

    def _restore_outer(self, state: PeerState) -> None:
        problem = self.shards.restore([str(self.store.directory), state.round, state.extra["shard_digests"]])
        if problem:
            raise CheckpointError(problem)

    def _load_state(self, target: int, digest: str | None, donors: list[str], exact_round: bool = False) -> bool:
        """Download theta(target) and the momentum shard by shard from the first donor whose state checks out."""
        peers = self._live_peers()
        for donor in donors:
            self.metrics.event("state_download_start", target, from_peer=donor)
            shard_peers = peers.get(donor, {}).get("shard_peers")
            if not isinstance(shard_peers, list) or len(shard_peers) != self.shards.layout.num_shards:
                problem = "the donor publishes no map of its shards"
            else:
                problem = self.shards.download({"shard_peers": shard_peers, "round": target, "digest": digest,
                                                "exact_round": exact_round})
            if problem:
                log.warning("state from %s not used: %s", donor, problem)
                self.metrics.event("state_download_failed", target, from_peer=donor, reason=problem)
                continue
            with self._state_lock:
                self.round, self.digest = self.shards.outer.round, self.shards.outer.digest
            self.metrics.event("state_loaded", self.round, from_peer=donor, digest=self.digest)
            return True
        return False

