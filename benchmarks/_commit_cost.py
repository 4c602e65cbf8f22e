"""The commit step's cost, measured inside ``benchmarks.allreduce``'s workers (``commit`` command).

Every worker's DHT runs with a peer's identity and the run's record validators (as ``Swarm`` starts it), so the
signature exchange is the peer's own code: :class:`~p2p_diloco.peer.certifier.Certifier` over
``Swarm.put_blob`` / ``Swarm.get_blobs`` (borrowed onto a bare DHT by :class:`BareSwarm`). Two figures per step:

* ``commit_s``: sign the round's statement, publish the signature, read until every member's signature checks
  out (all workers start together, as members finish an all-reduce within milliseconds of each other);
* ``outer_old_s`` / ``outer_new_s``: the outer step on the payload as theta (momentum 0.9, Nesterov) before and
  after the commit step existed: in place plus the digest of theta (one SHA-256 pass), vs the peer's
  ``WholeState.prepare`` (a copy into buffers kept between rounds, the step there, the digest of theta and the
  momentum, hashed in parallel threads) and ``commit`` (a swap).
"""

from __future__ import annotations

import statistics
import threading
import time
from types import SimpleNamespace

RUN = "bench"
PEER_TTL = 6.0


def dht_options() -> tuple[object, dict]:
    """A fresh identity, and the DHT arguments a peer's swarm starts its DHT with."""
    from p2p_diloco.swarm.identity import Identity
    from p2p_diloco.swarm.swarm import record_validators

    identity = Identity()
    return identity, {"identity_path": identity.path, "record_validators": record_validators(identity, RUN, PEER_TTL)}


class BareSwarm:
    """``Swarm``'s blob methods on a bare DHT: the same keys, checks, signatures and call bounds."""

    def __init__(self, dht, identity):
        from p2p_diloco.swarm.identity import RSAKeyBook

        self.dht, self.identity, self.run_id, self.allowed = dht, identity, RUN, None
        self.sc = SimpleNamespace(peer_ttl=PEER_TTL)
        self._dht_lock = threading.Lock()
        self.peer_id, self.signer, self.keys = identity.peer_id, identity, RSAKeyBook()

    def __getattr__(self, name):  # put_blob, get_blobs, _dht_call: the real methods, bound to this object
        from p2p_diloco.swarm.swarm import Swarm

        return getattr(Swarm, name).__get__(self)


def commit_seconds(swarm: BareSwarm, members: list[str], round_: int) -> float:
    """One commit exchange by the peer's Certifier; raises if the certificate is not complete."""
    from p2p_diloco.peer.certifier import Certifier
    from p2p_diloco.protocol.certificate import Statement
    from p2p_diloco.runtime.clock import RealClock

    clock, stop = RealClock(), threading.Event()
    ctx = SimpleNamespace(swarm=swarm, clock=clock, cfg=SimpleNamespace(swarm=SimpleNamespace(peer_ttl=PEER_TTL)),
                          sleep=lambda s: clock.wait(stop, s), emit_in_round=lambda *a, **k: None)
    members = sorted(members)
    statement = Statement(run_id=RUN, fingerprint="0" * 16, round=round_, members=tuple(members),
                          weights=(1.0,) * len(members), before="a" * 64, after="b" * 64, prev="")
    t0 = time.perf_counter()
    cert = Certifier(ctx).certify(round_, statement, clock.monotonic())
    seconds = time.perf_counter() - t0
    if cert is None:
        raise RuntimeError(f"round {round_}: the certificate was not complete")
    return seconds


def outer_step_seconds(payload: list, repeats: int = 5) -> tuple[float, float]:
    """``(old, new)`` median seconds of the outer step and its digest (module docstring) over ``repeats``
    alternating runs, on copies of ``payload``: the new one is the peer's own ``WholeState.prepare`` + ``commit``,
    timed from its second round on (the buffers it computes aside in are allocated once, in its first)."""
    olds, news = zip(*(_outer_step_once(payload) for _ in range(repeats)))
    return statistics.median(olds), statistics.median(news)


def _outer_step_once(payload: list) -> tuple[float, float]:
    import torch

    from p2p_diloco.outer.optimizer import OuterOptimizer, legacy_digest
    from p2p_diloco.outer.state import WholeState
    from p2p_diloco.protocol.certificate import Certificate, Statement

    average = [t * 1e-3 for t in payload]
    old = OuterOptimizer([t.clone() for t in payload], 0.7, 0.9, True)
    old.step(average)
    t0 = time.perf_counter()
    old.step(average)
    legacy_digest(old.theta)  # what the peer computed after each outer step before: theta only, in one pass
    t_old = time.perf_counter() - t0
    new = WholeState(payload, 0.7, 0.9, True, "0" * 16)
    t_new = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        after = new.prepare(average)
        new.commit(Certificate(Statement(RUN, "0" * 16, new.round, ("p",), (1.0,), new.digest, after, "")))
        t_new = time.perf_counter() - t0
    assert all(torch.equal(a, b) for a, b in zip(old.theta, new.theta))  # the same bits either way
    return t_old, t_new
