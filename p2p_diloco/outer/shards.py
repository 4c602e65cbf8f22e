"""Logical shards of the outer state (``outer.sharding = "sharded"``): pure torch, no network.

In ``rank0`` mode one process holds theta and the outer momentum whole, 8 bytes per parameter plus the averager's
copies (docs/scale.md: ~49 B/param on the outer side, 1.5 TB at 30B). In ``sharded`` mode the flat parameter
vector (``named_parameters`` order) is cut into ``outer.shards`` = L contiguous *logical* shards, and rank k of a
K-rank peer keeps theta and the momentum of shards j = k, k + K, k + 2K, ... only, on its CPU. L is part of the
config fingerprint and does not depend on K, so shard j of a 1-rank peer and of an 8-rank peer hold the same
parameters and can be averaged together (one hivemind averager per shard, :mod:`p2p_diloco.swarm`).

Every operation that needs the whole model is one collective over the local ranks, one parameter at a time, so no
rank ever holds more than one full parameter on top of its shards:

* the pseudo-gradient of a shard needs this rank's local weights of the parameters it covers: each parameter is
  gathered in turn (FSDP: ``full_tensor()``; DDP: every rank already has it);
* loading theta into the model: each parameter is assembled by a sum over the ranks of the pieces they own.

The outer step is elementwise, so it is the same on a shard as on the whole vector (:class:`outer.OuterOptimizer`
runs on the shard tensors). ``global_digest`` is one function of theta whatever the layout: a SHA-256 over the L
shard digests in shard order (:func:`global_digest`). It differs from ``rank0`` mode's digest, which is why
``outer.sharding`` is part of the fingerprint: the two modes never meet in one swarm.
"""

from __future__ import annotations

import hashlib
import math
import threading
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from . import optimizer as outer


def global_digest(shard_digests: Sequence[str]) -> str:
    """The global weights' digest from the digests of all L shards, in shard order."""
    return hashlib.sha256(("sharded:" + ",".join(shard_digests)).encode()).hexdigest()


def shard_digest(theta_j: torch.Tensor, momentum_j: torch.Tensor) -> str:
    """Shard j's digest: its theta and momentum (the whole outer state, as in ``rank0`` mode)."""
    return outer.digest([theta_j, momentum_j])


def shard_groups_problem(members: Mapping[int, Mapping[str, Any]], num_shards: int) -> str | None:
    """Why the groups the L shards of one round were averaged in are not one group of peers, or None.

    ``members``: for each shard j, its group's member processes ``{process peer id: the peer it names}`` (the
    ``"peer"`` it gathered: the main, rank 0, peer id of the peer whose shard it averaged). Every shard must have
    been averaged with the same peers, each once, or the round mixes pseudo-gradients of different groups and no
    certificate can describe it. Shard 0 is kept by every peer's rank 0 (:meth:`ShardLayout.owned`), so its member
    processes *are* the peers: one naming another peer there fails too, and the group of shard 0 is the round's
    group (the one the commit step checks and signs).
    """
    missing = [j for j in range(num_shards) if j not in members]
    if missing:
        return f"no group for shards {missing}"
    peers: dict[int, set[str]] = {}
    for j in range(num_shards):
        named: dict[str, str] = {}
        for process, peer in sorted(members[j].items()):
            if not isinstance(peer, str) or not peer:
                return f"member {process} of shard {j}'s group names no peer"
            if j == 0 and peer != process:
                return f"member {process} of shard 0's group names another peer ({peer})"
            if peer in named:
                return f"shard {j}'s group has two members for peer {peer} ({named[peer]}, {process})"
            named[peer] = process
        peers[j] = set(named)
    for j in range(1, num_shards):
        if peers[j] != peers[0]:
            only_j, only_0 = sorted(peers[j] - peers[0]), sorted(peers[0] - peers[j])
            return (f"shard {j} was averaged with other peers than shard 0 (only in shard {j}: {only_j}, "
                    f"only in shard 0: {only_0})")
    return None


class ShardLayout:
    """L contiguous pieces of the flat parameter vector; a piece may start or end inside a parameter.

    Args:
        numels: element counts of the parameters, in order.
        num_shards: L (``outer.shards``); at most the number of elements.
    """

    def __init__(self, numels: Sequence[int], num_shards: int):
        total = sum(numels)
        if not 1 <= num_shards <= total:
            raise ValueError(f"outer.shards must be between 1 and the parameter count ({total}), got {num_shards}")
        self.num_shards, self.total = num_shards, total
        self.bounds = [total * j // num_shards for j in range(num_shards + 1)]
        # per parameter: (shard j, start in the parameter, end in the parameter, offset in shard j)
        self.pieces: list[list[tuple[int, int, int, int]]] = []
        start = 0
        for n in numels:
            here = []
            for j in range(num_shards):
                lo, hi = max(start, self.bounds[j]), min(start + n, self.bounds[j + 1])
                if lo < hi:
                    here.append((j, lo - start, hi - start, lo - self.bounds[j]))
            self.pieces.append(here)
            start += n

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], num_shards: int) -> "ShardLayout":
        return cls([math.prod(p.shape) for p in params], num_shards)  # DTensor.shape is the global shape

    def size(self, j: int) -> int:
        return self.bounds[j + 1] - self.bounds[j]

    def owned(self, rank: int, world: int) -> list[int]:
        """The shards rank ``rank`` of a ``world``-rank peer keeps (every rank gets one if L >= world)."""
        return list(range(rank, self.num_shards, world))


class Ranks:
    """The local ranks a shard operation spans: a torch.distributed group, or this process alone (world 1)."""

    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | None = None):
        self.rank, self.world, self.device = rank, world, device or torch.device("cpu")

    def all_ok(self, ok: bool) -> bool:
        """True iff ``ok`` on every rank."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag[0])

    def all_gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def full(self, p: torch.Tensor) -> torch.Tensor:
        """Parameter ``p`` whole (an FSDP2 DTensor is gathered: a collective, every rank must call it)."""
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        on_device = t.to(self.device)
        dist.all_reduce(on_device)
        return on_device


class ShardedOuter:
    """This rank's shards of theta and the outer momentum, the outer step on them, and the collectives that move
    theta between the shards and the model. Every method marked *collective* is called on every rank at once.

    Args:
        layout: the logical shards.
        ranks: the local ranks (rank 0 of a 1-process peer is alone).
        params: the model's parameters, all ranks in the same order (before or after FSDP wrapping).
        lr, momentum, nesterov: the outer optimizer (:class:`outer.OuterOptimizer`).
    """

    def __init__(self, layout: ShardLayout, ranks: Ranks, params: Sequence[torch.Tensor], lr: float, momentum: float,
                 nesterov: bool):
        self.layout, self.ranks = layout, ranks
        self.owned = layout.owned(ranks.rank, ranks.world)
        self.index = {j: k for k, j in enumerate(self.owned)}
        shards = [torch.empty(layout.size(j), dtype=torch.float32) for j in self.owned]
        self.optimizer = outer.OuterOptimizer(shards, lr, momentum, nesterov)
        self.theta, self.momentum_buffers = self.optimizer.theta, self.optimizer.momentum_buffers
        self.lock = threading.RLock()  # state donation runs in a background thread; the owner may re-enter
        self.round = 0
        self.digests: list[str] = [""] * layout.num_shards
        self.digest = ""
        self.prepared: int | None = None  # the state version prepare() stepped from (None: nothing prepared)
        self.version = 0  # moves whenever theta or the momentum changes (a commit, a download)
        with torch.no_grad():
            self._from_model(params, self.theta, subtract=False)
        # the other ranks' shard digests arrive with the first refresh_digests() (no collective here: rank 0 may
        # still fail to start, and then tells the others to stop, which they must be able to hear)
        self.local_digest()

    # ------------------------------------------------------------------------------------------ collectives
    @torch.no_grad()
    def _from_model(self, params: Sequence[torch.Tensor], out: Sequence[torch.Tensor], subtract: bool) -> None:
        for i, p in enumerate(params):
            full = self.ranks.full(p.detach())
            flat = None
            for j, lo, hi, at in self.layout.pieces[i]:
                if j not in self.index:
                    continue
                flat = full.reshape(-1) if flat is None else flat
                piece = flat[lo:hi].to(device="cpu", dtype=torch.float32)
                k = self.index[j]
                if subtract:  # theta - local weights, as outer.pseudo_gradient
                    torch.sub(self.theta[k][at:at + hi - lo], piece, out=out[k][at:at + hi - lo])
                else:
                    out[k][at:at + hi - lo].copy_(piece)

    def pseudo_gradient(self, params: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """*Collective.* ``out[k]`` = theta - local weights on this rank's k-th shard."""
        self._from_model(params, out, subtract=True)

    @torch.no_grad()
    def load_into(self, params: Sequence[torch.Tensor]) -> None:
        """*Collective.* Copy theta into the model: each parameter is summed from the pieces the ranks own."""
        for i, p in enumerate(params):
            full = torch.zeros(tuple(p.shape), dtype=torch.float32)
            flat = full.view(-1)
            for j, lo, hi, at in self.layout.pieces[i]:
                if j in self.index:
                    flat[lo:hi].copy_(self.theta[self.index[j]][at:at + hi - lo])
            full = self.ranks.sum_(full)  # x + 0 is exact: every rank gets theta's bits (a -0.0 becomes +0.0)
            if hasattr(p, "to_local"):  # FSDP2: keep this rank's rows only
                from torch.distributed.tensor import distribute_tensor

                mine = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(mine.to_local())
            else:
                p.copy_(full.to(device=p.device, dtype=p.dtype))

    def refresh_digests(self) -> str:
        """*Collective.* Recompute our shards' digests, share them, return the global digest."""
        mine = {j: shard_digest(self.theta[k], self.momentum_buffers[k]) for k, j in enumerate(self.owned)}
        for part in self.ranks.all_gather(mine):
            for j, d in part.items():
                self.digests[j] = d
        self.digest = global_digest(self.digests)
        return self.digest

    # ------------------------------------------------------------------------------------------ local
    def local_digest(self) -> str:
        """The global digest with our own shards' digests recomputed (the others' as last shared)."""
        with self.lock:
            for k, j in enumerate(self.owned):
                self.digests[j] = shard_digest(self.theta[k], self.momentum_buffers[k])
            self.digest = global_digest(self.digests)
            return self.digest

    def prepare(self, delta: Sequence[torch.Tensor]) -> dict[int, str]:
        """The digests our shards would have after the outer step with ``delta`` (``{j: digest}``), theta and the
        momentum left as they are.

        Shard by shard on copies, dropped once hashed: the step's result is not kept aside (it would be 8 bytes
        per parameter of our shards, for the whole certification). :meth:`commit` redoes the same arithmetic in
        place from the same ``delta``, which the caller keeps unchanged until then (the rank's own buffer, or the
        last all-reduce's average, which stays in the averagers until the next all-reduce)."""
        digests, version = {}, self.version  # (only this thread changes the state: donations only read it)
        for k, j in enumerate(self.owned):
            theta, momentum = self.theta[k].clone(), self.momentum_buffers[k].clone()
            self.optimizer.step_on([theta], [momentum], [delta[k]])
            digests[j] = shard_digest(theta, momentum)
            del theta, momentum
        self.prepared = version
        return digests

    def commit(self, round_: int, delta: Sequence[torch.Tensor]) -> None:
        """Take the prepared step: the outer step with ``delta``, the same one :meth:`prepare` was given, in place
        (then :meth:`refresh_digests`, whose global digest the caller checks against the certified one).

        Raises:
            RuntimeError: nothing prepared, or the state changed since (a download in between): a caller's bug.
        """
        with self.lock:
            if self.prepared is None:
                raise RuntimeError("commit() without prepare()")
            if self.prepared != self.version:
                raise RuntimeError("the outer state changed between prepare() and commit()")
            for k in range(len(self.owned)):
                self.optimizer.step_on([self.theta[k]], [self.momentum_buffers[k]], [delta[k]])
            self.round, self.prepared = round_, None
            self.version += 1

    def discard(self) -> None:
        self.prepared = None

    def donation(self, j: int, fingerprint: str) -> tuple[dict, list[torch.Tensor]]:
        """What a peer downloading shard ``j`` from us gets: metadata and (theta_j, momentum_j)."""
        with self.lock:
            k = self.index[j]
            meta = {"round": self.round, "digest": self.digest, "shard": j, "shard_digest": self.digests[j],
                    "fp": fingerprint}
            return meta, [self.theta[k].clone(), self.momentum_buffers[k].clone()]

    def check_download(self, j: int, meta: dict, tensors: Sequence[torch.Tensor], fingerprint: str, round_: int,
                       digest: str | None, exact_round: bool) -> str | None:
        """Why a downloaded shard must not be used, or None if it checks out."""
        if meta.get("fp") != fingerprint or meta.get("shard") != j:
            return "state of another config or shard"
        if (meta.get("round") != round_) if exact_round else (not isinstance(meta.get("round"), int)
                                                              or meta["round"] < round_):
            return f"state of round {meta.get('round')}, wanted {round_}"
        if digest is not None and meta.get("digest") != digest:
            return f"digest {str(meta.get('digest'))[:12]} is not the majority's {digest[:12]}"
        size = self.layout.size(j)
        if len(tensors) != 2 or any(not isinstance(t, torch.Tensor) or tuple(t.shape) != (size,) for t in tensors):
            return "wrong shapes"
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return "non-finite values"
        if shard_digest(tensors[0].to(torch.float32), tensors[1].to(torch.float32)) != meta.get("shard_digest"):
            return "shard does not match its digest"
        return None

    def load(self, shards: dict[int, list[torch.Tensor]], round_: int, digests: Sequence[str]) -> None:
        """Take downloaded (theta_j, momentum_j) for each of our shards; ``digests``: all L shard digests."""
        with self.lock:
            for j, (theta_j, momentum_j) in shards.items():
                k = self.index[j]
                self.theta[k].copy_(theta_j)
                self.momentum_buffers[k].copy_(momentum_j)
            self.round, self.digests = round_, list(digests)
            self.version += 1
            self.digest = global_digest(self.digests)
