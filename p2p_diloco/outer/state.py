"""The global state a peer holds: theta, the outer momentum, the round and theta's digest, behind one interface.

theta(r) is bit-identical on every synced peer; everything that reads or changes it goes through a
:class:`GlobalState`, which owns it (and the lock that keeps a donation consistent while the round protocol
changes it). Two implementations: :class:`WholeState` keeps it whole in this process (``outer.sharding =
"rank0"``), :class:`~p2p_diloco.outer.sharded_state.ShardedState` cut into logical shards across the local ranks
(``"sharded"``). The round protocol never knows which one it has.

The commit contract: theta only changes by :meth:`GlobalState.commit` (the outer step whose result
:meth:`GlobalState.prepare` hashed from the average of a round, once that round's certificate is complete; the
whole state redoes it in place from the same average, which stays untouched until then, so it holds no second
outer state), :meth:`GlobalState.fetch` (a
state that checked out against its digest and certificate) or :meth:`GlobalState.restore` (a verified checkpoint);
``round``, ``digest`` and ``certificate`` change with it, under the same lock. ``digest`` covers the whole outer
state, theta *and* the momentum: it is what certificates sign and what every download is checked against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch

from ..errors import RoundFailed
from ..protocol import rules
from ..protocol.actions import Download
from ..protocol.certificate import Certificate
from ..protocol.records import View
from . import optimizer as opt

Tensors = list[torch.Tensor]


class GlobalState(ABC):
    """theta, momentum, ``round`` (theta is theta(round)), ``digest`` (of theta and momentum) and ``certificate``
    (the round certificate that produced them; None for theta(0), or a state from before certificates); see the
    module docstring. ``replica`` arguments are the peer's :class:`~p2p_diloco.training.inner.Replica`.
    """

    round: int
    digest: str
    certificate: Certificate | None
    lock: threading.RLock  # held by every change of the state, and while a donation or a checkpoint reads it

    @property
    def chain_head(self) -> str:
        """The id of the certificate of our state (:data:`~p2p_diloco.protocol.certificate.GENESIS` if none)."""
        cert = self.certificate
        return cert.id if cert is not None else ""

    def adopt(self, certificate: Certificate) -> bool:
        """Take ``certificate`` as the one of our state if it certifies exactly that state (a state downloaded
        without its certificate: sharded donations carry none). True if taken."""
        with self.lock:
            s = certificate.statement
            if s.round + 1 != self.round or s.after != self.digest:
                return False
            self.certificate = certificate
            return True

    def swarm_options(self) -> dict[str, Any]:
        """Extra arguments of the swarm factory (the shards this process averages)."""
        return {}

    def attach(self, swarm: Any, replica: Any) -> None:  # noqa: B027 (a hook: most states need nothing here)
        """Called once the swarm is up and the trainer built (a sharded peer's ranks join the swarm here)."""

    @abstractmethod
    def tensors_like(self) -> Tensors:
        """Tensors shaped like what this process all-reduces (the swarm's averager buffers)."""

    def held_tensors(self) -> Tensors:
        """The large tensors this state holds in this process (kept out of forked children: runtime/forks.py)."""
        return []

    @abstractmethod
    def donate(self, *shard: int) -> tuple[dict, Tensors]:
        """``(metadata, tensors)`` for a peer that downloads our state (called from a background thread)."""

    @abstractmethod
    def new_buffer(self) -> Tensors:
        """A buffer for a pseudo-gradient, which the all-reduce then replaces in place by the swarm's average."""

    @abstractmethod
    def snapshot(self) -> Tensors:
        """A copy of theta (in the layout of :meth:`new_buffer`)."""

    @abstractmethod
    def pseudo_gradient(self, replica: Any, out: Tensors, start: Tensors | None = None) -> None:
        """``out = start - local weights``; ``start`` is theta unless given (``outer.overlap``)."""

    @abstractmethod
    def average(self, swarm: Any, request: Any) -> Any:
        """All-reduce ``request.tensors`` (a buffer of our pseudo-gradient); an :class:`AllReduceResult`, or
        RoundFailed. The buffer is left as it was, so that a retry of the round (after a commit that did not
        complete) sends our own pseudo-gradient again; the average is held in ``swarm`` for
        :meth:`prepare_averaged`."""

    @abstractmethod
    def prepare_averaged(self, swarm: Any) -> str:
        """:meth:`prepare` with the average of the last successful :meth:`average`."""

    @abstractmethod
    def prepare(self, average: Tensors) -> str:
        """Compute the outer step with the swarm's ``average`` (theta(round) -> theta(round + 1)) aside, without
        changing the state, and return the digest it would have; it is held until :meth:`commit` or
        :meth:`discard`."""

    @abstractmethod
    def commit(self, certificate: Certificate) -> None:
        """Take the prepared step: theta(round + 1), certified by ``certificate``."""

    @abstractmethod
    def discard(self) -> None:
        """Drop the prepared step (its round did not commit): the state stays theta(round)."""

    @abstractmethod
    def lookahead(self, pseudo_gradient: Tensors, out: Tensors) -> None:
        """``out`` = the theta :meth:`apply` would give if the average were ``pseudo_gradient`` (state unchanged)."""

    @abstractmethod
    def load_into(self, replica: Any, source: Tensors | None = None) -> None:
        """Copy theta (or ``source``, in the layout of :meth:`new_buffer`) into the local model."""

    def theta_in_model(self, replica: Any) -> contextlib.AbstractContextManager:
        """A context in which the local model holds theta (to evaluate theta): it already does at a round boundary,
        except with ``outer.fragments`` (:class:`~p2p_diloco.outer.fragment_state.FragmentState`)."""
        return contextlib.nullcontext()

    @abstractmethod
    def fetch(self, swarm: Any, donor: str, plan: Download, read_view: Callable[[], View], fingerprint: str,
              trust: Callable[[Certificate], str | None]) -> str | None:
        """Download the state ``plan`` asks for from ``donor`` and take it if it checks out, its certificate
        included (``trust``: why we may not follow a certificate, or None); None once taken, else why not
        (nothing is changed then)."""

    @abstractmethod
    def save(self, directory: str, keep: Sequence[int]) -> tuple[Tensors, Tensors, dict]:
        """``(theta, momentum, extra)`` for the round's checkpoint (a sharded state writes its own files first and
        returns none); OSError if it cannot be saved. ``keep``: the rounds whose checkpoints stay."""

    @abstractmethod
    def restore(self, state: Any, directory: str) -> None:
        """Take the outer state of a verified checkpoint (:class:`~p2p_diloco.checkpoint.PeerState`)."""


@dataclasses.dataclass(frozen=True)
class _Pending:
    """An outer step prepared and not yet committed."""

    reopen: Callable[[], Any]  # a context manager giving the average back
    before: str  # the digest of the state it steps from
    after: str  # the digest it leads to
    hashes: list[str]  # the per-tensor hashes of the state it leads to


class WholeState(GlobalState):
    """theta and the momentum whole, in this process (``outer.sharding = "rank0"``).

    Args:
        params: the model's initial parameters: theta(0), the same bits on every peer.
        lr, momentum, nesterov: the outer optimizer (:class:`~p2p_diloco.outer.optimizer.OuterOptimizer`).
        fingerprint: the run config's fingerprint, sent with every donation.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool, fingerprint: str):
        self.optimizer = opt.OuterOptimizer(opt.snapshot(params), lr, momentum, nesterov)
        self.theta = self.optimizer.theta
        self.fingerprint = fingerprint
        self.lock = threading.RLock()
        self.round, self.digest = 0, opt.digest(self.optimizer.state_tensors())
        self.certificate: Certificate | None = None
        self.owner = ""  # our peer id, sent with donations
        self._pending: _Pending | None = None  # the prepared outer step, until it commits or is discarded
        self._hash_cache: tuple[str, list[str]] | None = None  # (digest, its per-tensor hashes)

    def attach(self, swarm: Any, replica: Any) -> None:
        self.owner = swarm.peer_id or ""

    def tensors_like(self) -> Tensors:
        return self.theta

    def held_tensors(self) -> Tensors:
        return self.optimizer.state_tensors()

    def donate(self, *shard: int) -> tuple[dict, Tensors]:
        with self.lock:
            meta = {"round": self.round, "digest": self.digest, "fp": self.fingerprint, "peer_id": self.owner,
                    "certificate": None if self.certificate is None else self.certificate.to_json()}
            return meta, [t.clone() for t in self.optimizer.state_tensors()]

    def new_buffer(self) -> Tensors:
        return [torch.empty_like(t) for t in self.theta]

    def snapshot(self) -> Tensors:
        return opt.snapshot(self.theta)

    def pseudo_gradient(self, replica: Any, out: Tensors, start: Tensors | None = None) -> None:
        replica.pseudo_gradient(self.theta if start is None else start, out)

    def average(self, swarm: Any, request: Any) -> Any:
        return swarm.all_reduce(dataclasses.replace(request, commit=False))

    def prepare_averaged(self, swarm: Any) -> str:
        with swarm.averaged() as average:  # read in place: no copy of the average
            return self._prepare(average, swarm.averaged)

    def prepare(self, average: Tensors) -> str:
        return self._prepare(average, lambda: contextlib.nullcontext(average))

    def _prepare(self, average: Tensors, reopen: Callable[[], Any]) -> str:
        """The digest theta(round + 1) and its momentum would have: each tensor the step changes is stepped on a
        copy, hashed and dropped, so no second outer state is held (8 bytes per parameter); :meth:`commit` then
        redoes the step in place, from the same average (``reopen`` gives it back) with the same arithmetic."""
        with self.lock:
            n = len(self.theta)
            stepped = self._stepped(average)
            hashes = self._hashes_except({i for i, _ in stepped})
            momentum = self.optimizer.momentum_buffers
            for i, d in stepped:  # one tensor at a time: the copies cost the largest tensor twice at most
                t, m = self.theta[i].clone(), momentum[i].clone()
                self.optimizer.step_on([t], [m], [d])
                hashes[i], hashes[n + i] = opt.tensor_hashes([t, m])  # (the two in parallel threads when large)
            after = opt.digest_of_hashes(hashes)
            self._pending = _Pending(reopen, self.digest, after, hashes)
        return after

    def _stepped(self, average: Tensors) -> list[tuple[int, torch.Tensor]]:
        """``(index of a theta tensor, its average pseudo-gradient)`` for each tensor the outer step changes."""
        return list(enumerate(average))

    def _hashes_except(self, skip: set[int]) -> list[str]:
        """The per-tensor hashes of theta and momentum (:func:`~p2p_diloco.outer.optimizer.tensor_hashes`) of the
        tensors of theta not in ``skip`` and their momentum; "" for the others. Kept from the last commit while
        the digest is still that commit's (a fragment round changes 1/F of the tensors)."""
        n, ours = len(self.theta), self.optimizer.state_tensors()
        cached = self._hash_cache[1] if self._hash_cache and self._hash_cache[0] == self.digest else None
        keep = [j for j in range(2 * n) if j % n not in skip]
        hashes = [""] * (2 * n)
        fresh = [] if cached else opt.tensor_hashes([ours[j] for j in keep])
        for k, j in enumerate(keep):
            hashes[j] = cached[j] if cached else fresh[k]
        return hashes

    def commit(self, certificate: Certificate) -> None:
        pending = self._pending
        if pending is None:
            raise RuntimeError("commit() without prepare()")  # a bug of the caller
        if certificate.statement.after != pending.after:
            raise RuntimeError("commit() of another step than the one prepared")  # a bug of the caller
        with pending.reopen() as average, self.lock:  # (the averagers' locks first, as in prepare_averaged)
            if self.digest != pending.before:
                raise RuntimeError("the outer state changed between prepare() and commit()")  # a caller's bug
            momentum = self.optimizer.momentum_buffers
            for i, d in self._stepped(average):  # the arithmetic of prepare on the same inputs: the same bits
                self.optimizer.step_on([self.theta[i]], [momentum[i]], [d])
            self.round, self.digest = self.round + 1, pending.after
            self.certificate, self._pending = certificate, None
            self._hash_cache = (pending.after, pending.hashes)

    def discard(self) -> None:
        self._pending = None

    def lookahead(self, pseudo_gradient: Tensors, out: Tensors) -> None:
        self.optimizer.lookahead(pseudo_gradient, out)

    def load_into(self, replica: Any, source: Tensors | None = None) -> None:
        replica.load(self.theta if source is None else source)

    def fetch(self, swarm: Any, donor: str, plan: Download, read_view: Callable[[], View], fingerprint: str,
              trust: Callable[[Certificate], str | None]) -> str | None:
        try:
            meta, tensors = swarm.download_state(donor)
        except RoundFailed as e:
            return str(e)
        got = meta.get("round") if isinstance(meta, dict) else None
        want, expected, vouch = rules.donation_target(plan.target, plan.digest, got, donor, read_view,
                                                      plan.exact_round)
        problem = check_donated_state(meta, tensors, self.optimizer.state_tensors(), fingerprint, want, expected,
                                      plan.exact_round)
        if problem or vouch:
            return problem or vouch
        cert, problem = donated_certificate(meta, trust)
        if problem:
            return problem
        with self.lock:
            self.optimizer.load_state_tensors(tensors)  # every shape was checked: nothing is half-written
            self.round, self.digest, self.certificate = int(meta["round"]), meta["digest"], cert
        return None

    def save(self, directory: str, keep: Sequence[int]) -> tuple[Tensors, Tensors, dict]:
        return self.theta, self.optimizer.momentum_buffers, {}

    def restore(self, state: Any, directory: str) -> None:
        with self.lock:
            self.optimizer.load_state_tensors([*state.theta, *state.momentum])
            self.round, self.digest = state.round, state.global_digest
            self.certificate = Certificate.from_json(state.certificate) if state.certificate else None


def check_donated_state(meta: Any, tensors: Sequence[torch.Tensor], ours: Sequence[torch.Tensor],
                        fingerprint: str, target: int, digest: str | None, exact_round: bool = False) -> str | None:
    """Why a downloaded ``(meta, theta + momentum)`` must be refused, or None if it is what we asked for.
    ``ours``: our own theta and momentum (:meth:`OuterOptimizer.state_tensors`), whose shapes it must have.

    A donor could be buggy, of another config, already a round further, or (for repairs) not in the majority;
    the digest (of theta *and* momentum) is recomputed from the bytes received, so neither a transfer error nor a
    momentum of another shape can slip through.
    """
    if not isinstance(meta, dict) or not isinstance(meta.get("round"), int) or not isinstance(meta.get("digest"), str):
        return "malformed metadata"
    if meta.get("fp") != fingerprint:
        return "fingerprint mismatch"
    shapes = opt.shape_problem(ours, tensors)
    if shapes:
        return shapes
    if opt.digest(tensors) != meta.get("digest"):
        return "digest does not match its contents"
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return "it holds non-finite values"
    got = meta.get("round", -1)
    if got < target or (exact_round and got != target):
        return f"it holds round {got}, we need {target}"
    if got == target and digest is not None and meta["digest"] != digest:
        return "it does not hold the majority's weights"
    return None


def donated_certificate(meta: dict, trust: Callable[[Certificate], str | None]
                        ) -> tuple[Certificate | None, str | None]:
    """``(certificate, problem)``: the certificate a donated state comes with, checked: of exactly that state,
    and one we trust (``trust``: complete, and tied to our chain or our trust root; see
    :mod:`p2p_diloco.protocol.trust`). theta(0) needs none (every peer builds it from the config)."""
    body = meta.get("certificate")
    if body is None:
        return None, (None if meta["round"] == 0 else f"no certificate for its round {meta['round']}")
    try:
        cert = Certificate.from_json(body)
    except ValueError as e:
        return None, str(e)
    s = cert.statement
    if s.round + 1 != meta["round"] or s.after != meta["digest"] or s.fingerprint != meta.get("fp"):
        return None, "its certificate is of another state"
    problem = trust(cert)
    return (None, f"its certificate is not one we follow: {problem}") if problem else (cert, None)
