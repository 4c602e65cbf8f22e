"""The global state cut into logical shards across the local ranks (``outer.sharding = "sharded"``): rank 0's side.

The round protocol is the same as for :class:`~p2p_diloco.outer.state.WholeState`; only what touches theta goes
through :class:`~p2p_diloco.local.sharded_ranks.ShardedRank`, so that each local rank works on its own logical
shards and rank 0 never holds theta whole: the pseudo-gradient, the all-reduce (one averager per shard), the outer
step, loading theta into the model, state downloads and checkpoints. A 1-process peer is a cluster of one rank that
keeps every shard. ``round`` and ``digest`` are the shards' own (:class:`~p2p_diloco.outer.shards.ShardedOuter`):
there is no second copy.

The live record carries ``shard_peers``: for each shard j, the peer id of the process (the rank) of this peer that
keeps it, so that a peer catching up can download shard j from the right process of its donor.

Each rank all-reduces its shards in a collective with the others (all or nothing across the peer), so this state
has one pseudo-gradient buffer per rank and no background sync: ``outer.overlap`` needs ``outer.sharding = rank0``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..checkpoint import CheckpointError
from ..local.sharded_ranks import ShardedRank
from ..protocol.actions import Download
from ..protocol.certificate import Certificate
from ..protocol.records import View
from ..swarm.port import AllReduceRequest
from .state import GlobalState, Tensors


class ShardedState(GlobalState):
    """Rank 0's view of a sharded global state (module docstring).

    Args:
        cfg: the run config.
        cluster: the local ranks (:class:`~p2p_diloco.local.cluster.Cluster`), or None for a 1-process peer.
        params: the model's initial parameters (theta(0)).
    """

    def __init__(self, cfg, cluster, params: Sequence[torch.Tensor]):
        self.cfg, self.cluster = cfg, cluster
        self.rank = ShardedRank(cfg, cluster, params)
        self.outer = self.rank.outer
        self.lock = self.outer.lock
        self.certificate: Certificate | None = None

    @property
    def round(self) -> int:  # type: ignore[override]
        return self.outer.round

    @property
    def digest(self) -> str:  # type: ignore[override]
        return self.outer.digest

    def swarm_options(self) -> dict[str, Any]:
        return {"shards": self.outer.owned}

    def attach(self, swarm: Any, replica: Any) -> None:
        """The other ranks start their DHT nodes (joined to ours) and their shards' averagers; our record says
        which process keeps which shard; every rank's shard digests are shared from now on."""
        self.rank.swarm = swarm
        if self.cluster:
            self.cluster.broadcast_objects([swarm.visible_maddrs()])
        ids = self.rank.ranks.all_gather(swarm.peer_id)
        self.rank.main_peer = ids[0]  # every shard's averager gathers it (sharded_ranks.py compares the groups)
        swarm.update(shard_peers=[ids[j % len(ids)] for j in range(self.rank.layout.num_shards)])
        self.outer.refresh_digests()

    def tensors_like(self) -> Tensors:
        return self.outer.theta

    def held_tensors(self) -> Tensors:
        return self.rank.held_tensors()

    def donate(self, *shard: int) -> tuple[dict, Tensors]:
        return self.rank.provider(shard[0])

    def new_buffer(self) -> Tensors:
        return self.rank.buffer  # no second copy: every rank all-reduces and steps its own buffer

    def snapshot(self) -> Tensors:
        with self.lock:
            return [t.clone() for t in self.outer.theta]

    def pseudo_gradient(self, replica: Any, out: Tensors, start: Tensors | None = None) -> None:
        if start is not None or out is not self.rank.buffer:
            raise NotImplementedError("a sharded state computes the pseudo-gradient from theta into its own buffer")
        self.rank.pseudo_gradient(replica.params)

    def average(self, swarm: Any, request: AllReduceRequest) -> Any:
        sc = self.cfg.swarm
        args = {"round": request.round, "weight": float(request.weight), "group_size": request.group_size,
                "matchmaking_time": request.matchmaking_time or sc.matchmaking_time,
                "allreduce_timeout": request.allreduce_timeout or sc.allreduce_timeout,
                "matchmaking_timeout": request.matchmaking_timeout}
        return self.rank.sync(args, gather=request.gather, should_stop=request.should_stop,
                              on_running=request.on_running)

    def prepare(self, average: Tensors) -> str:
        return self.rank.step("prepare")  # a solo step: ``average`` is the ranks' own buffer

    def prepare_averaged(self, swarm: Any) -> str:
        return self.rank.step("prepare_averaged")  # every rank from its own swarm's averages

    def commit(self, certificate: Certificate) -> None:
        digest = self.rank.step("commit", self.round + 1)
        if digest != certificate.statement.after:  # the same arithmetic twice: a bug if it differs
            raise RuntimeError(f"committed digest {digest[:12]} is not the prepared {certificate.statement.after[:12]}")
        self.certificate = certificate

    def discard(self) -> None:
        self.rank.step("discard")

    def lookahead(self, pseudo_gradient: Tensors, out: Tensors) -> None:
        self.outer.optimizer.lookahead(pseudo_gradient, out)

    def load_into(self, replica: Any, source: Tensors | None = None) -> None:
        if source is not None:
            raise NotImplementedError("a sharded state loads theta itself into the model")
        self.rank.load(replica.params)

    def fetch(self, swarm: Any, donor: str, plan: Download, read_view: Callable[[], View], fingerprint: str,
              trust: Callable[[Certificate], str | None]) -> str | None:
        """Download theta(target) and the momentum shard by shard, each from the process of the donor that keeps
        it; nothing is taken unless every shard of every rank checks out."""
        record = read_view().get(donor)
        shard_peers = record.shard_peers if record is not None else None
        if not shard_peers or len(shard_peers) != self.rank.layout.num_shards:
            return "the donor publishes no map of its shards"
        problem = self.rank.download({"shard_peers": list(shard_peers), "round": plan.target,
                                      "digest": plan.digest, "exact_round": plan.exact_round})
        if problem is None:
            self.certificate = None  # shard donations carry no certificate yet (docs/protocol.md)
        return problem

    def save(self, directory: str, keep: Sequence[int]) -> tuple[Tensors, Tensors, dict]:
        """The shards go to per-shard files, written by every rank before rank 0 writes the checkpoint."""
        problem = self.rank.save([directory, self.round, list(keep)])
        if problem:
            raise OSError(problem)
        return [], [], {"shard_digests": list(self.outer.digests)}

    def restore(self, state: Any, directory: str) -> None:
        problem = self.rank.restore([directory, state.round, state.extra["shard_digests"]])
        if problem:
            raise CheckpointError(problem)
        self.certificate = Certificate.from_json(state.certificate) if state.certificate else None
