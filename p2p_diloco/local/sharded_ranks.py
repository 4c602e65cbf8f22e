"""What every rank of a sharded peer does (``outer.sharding = "sharded"``): the same method on every rank, rank 0
first telling the others which (the leader/follower protocol of :mod:`p2p_diloco.local.cluster`).

Each rank keeps its logical shards of theta and the momentum (:class:`~p2p_diloco.outer.shards.ShardedOuter`) and runs
one hivemind averager per shard (rank 0 in its :class:`~p2p_diloco.swarm.Swarm`, the others in a DHT node that
joins rank 0's). The round protocol itself (who is live, the group size, stragglers, which donor) stays on rank 0
(:class:`~p2p_diloco.outer.sharded_state.ShardedState`); it hands each decision to the ranks as a command:

* ``SPSEUDO``: every rank computes the pseudo-gradient of its shards (one collective per parameter);
* ``SSYNC``: every rank all-reduces its shards with the same shards of the round's other peers, then the ranks
  agree (one all-reduce of success flags) to use the result only if *every* shard of *every* rank succeeded
  and every shard was averaged with the same peers (each shard's averager gathers the main peer id of the peer it
  averages for: :func:`~p2p_diloco.outer.shards.shard_groups_problem`, the same decision on every rank).
  Otherwise none is used and rank 0 retries, as after any failed all-reduce: a peer never applies half a round
  nor signs a round whose shards were averaged with different groups;
* ``SSTEP``: the outer step on every shard, prepared on copies (its digest shared), then committed or discarded once
  the round's certificate is complete or not (global digest = hash of the L shard digests);
* ``SLOAD``: theta into the model (one collective per parameter);
* ``SDOWNLOAD``: every rank downloads its shards from the rank of the donor peer that keeps them (the donor
  publishes that map), checks each shard against its digest, and all ranks check that the shard digests hash to
  the majority's global digest before any shard is used (all or nothing again);
* ``SSAVE`` / ``SRESTORE``: every rank writes / reads its shards' checkpoint files (``checkpoint.ShardFiles``);
  rank 0 writes the round's checkpoint, which records every shard's digest, only after all ranks saved theirs.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from ..checkpoint import CheckpointError, ShardFiles
from ..swarm.port import AllReduceRequest
from .cluster import Cluster
from .commands import SDOWNLOAD, SLOAD, SPSEUDO, SRESTORE, SSAVE, SSTEP, SSYNC
from ..errors import RoundFailed
from ..runtime.forks import keep_out_of_children
from ..outer.shards import Ranks, ShardedOuter, ShardLayout, global_digest, shard_groups_problem

log = logging.getLogger(__name__)


class ShardedRank:
    """One rank's part of a sharded peer. ``cluster`` is None for a 1-process peer (it then keeps every shard).

    Args:
        cfg: the run config.
        cluster: the local ranks, or None.
        params: the model's parameters (before wrapping: every rank holds the same initial weights).
    """

    def __init__(self, cfg, cluster: Cluster | None, params: Sequence[torch.Tensor]):
        self.cfg, self.cluster = cfg, cluster
        ranks = Ranks(cluster.rank, cluster.world, cluster.device) if cluster else Ranks()
        self.ranks = ranks
        self.layout = ShardLayout.of(params, cfg.outer.shards)
        self.outer = ShardedOuter(self.layout, ranks, params, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
        self.buffer = [torch.empty_like(t) for t in self.outer.theta]
        self.swarm = None  # set once started (rank 0: the peer's Swarm; others: start_follower_swarm)
        self.main_peer: str | None = None  # rank 0's peer id (the peer's, in its records), once started
        self.prepared_from = "prepare"  # the last prepare's mode: where commit finds the same delta again

    def held_tensors(self) -> list[torch.Tensor]:
        """Our shards of theta and the momentum, and the pseudo-gradient buffer: no forked child reads them."""
        return [*self.outer.optimizer.state_tensors(), *self.buffer]

    def provider(self, j: int) -> tuple[dict, list[torch.Tensor]]:
        return self.outer.donation(j, self.cfg.fingerprint())

    def _tell(self, op: int, args: list | None = None) -> list | None:
        """Rank 0: send command ``op`` and its arguments to the other ranks. A follower (already told ``op``) passes
        as many placeholders as there are arguments, and gets rank 0's."""
        if self.cluster is None:
            return args
        if self.cluster.rank == 0:
            self.cluster.send(op)
        return self.cluster.broadcast_objects(args) if args is not None else None

    # ------------------------------------------------------------------------------------------ commands
    def pseudo_gradient(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self._tell(SPSEUDO)
        self.outer.pseudo_gradient(params, self.buffer)
        return self.buffer

    def sync(self, args: dict[str, Any] | None = None, **rank0_only: Any):
        """All-reduce our shards (``args``: round, group size, weight, deadlines; rank 0 passes them, followers
        receive them). Returns rank 0's :class:`AllReduceResult`; raises RoundFailed unless every rank succeeded
        and every shard's group was the same peers. Its ``gathered`` is shard 0's, keyed by the member processes
        that keep shard 0, which are the peers' rank 0 (checked: each names itself), i.e. the records' peer ids.
        ``rank0_only``: gather, should_stop, on_running (rank 0's round protocol)."""
        (args,) = self._tell(SSYNC, [args])
        result, problem = None, None
        # every shard's averager gathers the peer it averages for: the shards' groups are compared below
        gather = dict(rank0_only.get("gather", {"round": args["round"]}), peer=self.main_peer)
        try:
            result = self.swarm.all_reduce(AllReduceRequest(
                round=args["round"], tensors=self.buffer, weight=args["weight"], group_size=args["group_size"],
                gather=gather,
                should_stop=rank0_only.get("should_stop", lambda: False),
                on_running=rank0_only.get("on_running", lambda: None), matchmaking_time=args["matchmaking_time"],
                allreduce_timeout=args["allreduce_timeout"], matchmaking_timeout=args["matchmaking_timeout"],
                commit=False))
        except RoundFailed as e:
            problem = str(e)
        if not self.ranks.all_ok(problem is None):  # all or nothing across the shards of this peer
            raise RoundFailed(problem or "a shard all-reduce failed on another local rank")
        # the peer's bytes, exclusions and shard groups, all ranks: every rank takes the same decision from them
        moved = self.ranks.all_gather((result.bytes_sent, result.bytes_received, result.excluded,
                                       result.shard_members))
        members = {j: m for part in moved for j, m in (part[3] or {}).items()}
        problem = shard_groups_problem(members, self.layout.num_shards)
        if problem:  # the shards were averaged with different peers: no round (the buffer is still ours)
            raise RoundFailed(f"the shards' groups differ: {problem}")
        result.bytes_sent, result.bytes_received = sum(m[0] for m in moved), sum(m[1] for m in moved)
        result.excluded = {pid: reason for m in moved for pid, reason in m[2].items()}
        return result

    def step(self, mode: str, round_: int = 0) -> str | None:
        """*Collective.* ``mode`` "prepare": the outer step on copies of every shard with our buffer as the average
        (a solo step), returning the global digest it would give; "prepare_averaged": the same with the last
        all-reduce's average; "commit": take it as theta(``round_``), returning the new global digest; "discard"."""
        self._tell(SSTEP, [mode, round_])
        return self._step(mode, round_)

    def _step(self, mode: str, round_: int) -> str | None:
        if mode in ("prepare", "prepare_averaged"):
            self.prepared_from = mode  # commit steps again from the same delta, in place (ShardedOuter.prepare)
            if mode == "prepare":
                mine = self.outer.prepare(self.buffer)
            else:
                with self.swarm.averaged() as average:  # the buffer stays our pseudo-gradient, for a retry
                    mine = self.outer.prepare(average)
            digests = list(self.outer.digests)
            for part in self.ranks.all_gather(mine):
                for j, d in part.items():
                    digests[j] = d
            return global_digest(digests)
        if mode == "commit":
            if self.prepared_from == "prepare":
                self.outer.commit(round_, self.buffer)
            else:  # the averages are as prepare read them: no all-reduce runs between prepare and commit
                with self.swarm.averaged() as average:
                    self.outer.commit(round_, average)
            return self.outer.refresh_digests()
        self.outer.discard()
        return None

    def load(self, params: Sequence[torch.Tensor]) -> None:
        self._tell(SLOAD)
        self.outer.load_into(params)

    def download(self, plan: dict[str, Any] | None = None) -> str | None:
        """Download our shards from the donor in ``plan`` (shard_peers, round, digest, exact_round). Returns None
        once every rank has loaded its shards, else why not (nothing is loaded then, on any rank)."""
        (plan,) = self._tell(SDOWNLOAD, [plan])
        fp, got, problem = self.cfg.fingerprint(), {}, None
        metas = {}
        for j in self.outer.owned:
            try:
                meta, tensors = self.swarm.download_state(plan["shard_peers"][j], shard=j)
            except RoundFailed as e:
                problem = str(e)
                break
            problem = self.outer.check_download(j, meta, tensors, fp, plan["round"], plan["digest"],
                                                plan["exact_round"])
            if problem:
                break
            got[j], metas[j] = [t.to(torch.float32) for t in tensors], meta
        seen = self.ranks.all_gather(None if problem else {j: (m["round"], m["digest"], m["shard_digest"])
                                                             for j, m in metas.items()})
        if any(part is None for part in seen):
            return problem or "a shard download failed on another local rank"
        shards = {j: item for part in seen for j, item in part.items()}
        rounds, digests = {r for r, _, _ in shards.values()}, {d for _, d, _ in shards.values()}
        shard_digests = [shards[j][2] for j in range(self.layout.num_shards)]
        if len(rounds) != 1 or len(digests) != 1 or global_digest(shard_digests) != next(iter(digests)):
            return "the shards do not add up to one global state (the donor moved on mid-download?)"
        self.outer.load(got, rounds.pop(), shard_digests)
        return None

    def save(self, args: list | None = None) -> str | None:
        """Write our shards' files for a checkpoint (``args``: directory, round, rounds to keep). Returns None once
        every rank has saved, else why not."""
        directory, round_, keep = self._tell(SSAVE, args or [None] * 3)
        files, problem = ShardFiles(directory), None
        try:
            with self.outer.lock:
                for k, j in enumerate(self.outer.owned):
                    files.save(j, round_, self.cfg.fingerprint(), self.outer.theta[k], self.outer.momentum_buffers[k])
            files.prune(self.outer.owned, set(keep) | {round_})
        except OSError as e:
            problem = f"rank {self.ranks.rank}: {e}"
        return None if self.ranks.all_ok(problem is None) else problem or "another local rank could not save"

    def restore(self, args: list | None = None) -> str | None:
        """Load our shards of a checkpoint (``args``: directory, round, all shard digests). None once every rank
        has loaded them (nothing is loaded unless all can be)."""
        directory, round_, digests = self._tell(SRESTORE, args or [None] * 3)
        files, got, problem = ShardFiles(directory), {}, None
        try:
            for j in self.outer.owned:
                got[j] = list(files.load(j, round_, self.cfg.fingerprint(), digests[j]))
        except CheckpointError as e:
            problem = str(e)
        if not self.ranks.all_ok(problem is None):
            return problem or "another local rank could not load its shards"
        self.outer.load(got, round_, digests)
        return None


def start_follower_swarm(rank: ShardedRank, cluster: Cluster, leader_maddrs: list[str],
                         params: Sequence[torch.Tensor]) -> None:
    """A follower rank's DHT node (joined to rank 0's) and averagers for its shards. Like rank 0 (peer/build.py),
    the processes it forks drop the pages of the model's weights (``params``) and of the outer state at once: they
    never read them, and each would otherwise keep a private copy of every page the rank writes later."""
    from ..swarm.swarm import Swarm

    # (an FSDP2 parameter is a DTensor: its local shard is not a tensor object that lives on, so it is not named)
    keep_out_of_children([*(p for p in params if not hasattr(p, "to_local")), *rank.held_tensors()])
    rank.swarm = Swarm(rank.cfg, rank.outer.theta, rank.provider, shards=rank.outer.owned, rank_of=leader_maddrs)
    rank.swarm.start()
    ids = rank.ranks.all_gather(rank.swarm.peer_id)  # rank 0 publishes which peer id serves which shard
    rank.main_peer = ids[0]
    rank.outer.refresh_digests()


def obey(op: int, rank: ShardedRank, params: Sequence[torch.Tensor]) -> bool:
    """A follower's side of one sharded command; False if ``op`` is not one."""
    if op == SPSEUDO:
        rank.pseudo_gradient(params)
    elif op == SSYNC:
        try:
            rank.sync()
        except RoundFailed as e:
            log.info("rank %d: shard all-reduce not used: %s", rank.ranks.rank, e)
    elif op == SSTEP:
        mode, round_ = rank._tell(SSTEP, [None, None])
        rank._step(mode, round_)
    elif op == SLOAD:
        rank.outer.load_into(params)
    elif op == SDOWNLOAD:
        rank.download()
    elif op == SSAVE:
        rank.save()
    elif op == SRESTORE:
        rank.restore()
    else:
        return False
    return True
