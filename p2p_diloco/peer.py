"""One DiLoCo peer and its round protocol. No hivemind here: the swarm is reached through a :class:`Swarm`-like
object built by the CLI.

A round, seen from one peer holding the global weights theta(r) (bit-identical on every synced peer):

1. start from theta(r) and run H inner AdamW steps on this peer's own data;
2. pseudo_gradient = theta(r) - local weights;
3. average it, weighted by tokens trained, with *every* live peer of round r (the group size is taken from the
   live records in the DHT, and hivemind is told to form a group of exactly that size, so the swarm never splits
   into disjoint groups that would each average a different subset);
4. apply the outer Nesterov step -> theta(r+1); 5. copy theta(r+1) into the model.

Failure rules, in the order they are checked (each wait is bounded by a ``[swarm]`` timeout):

* a live peer is already past round r -> we missed the round: download (round, theta, momentum) from it;
* no other live peer is in round r -> we are the whole swarm: apply our own pseudo-gradient;
* the all-reduce fails in any way -> apply nothing, re-read the records, and try again.

Round numbers are swarm-wide: ``max_rounds`` R means "stop once theta(R) exists", for late joiners too.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Callable

import torch

from . import outer as outer_mod
from .config import Config
from .data import PackedStream, eval_batches
from .errors import RoundFailed
from .inner import InnerTrainer, evaluate, resolve_device
from .metrics import Metrics
from .model import build_model, count_parameters
from .tokenizer import build_tokenizer, vocab_size

log = logging.getLogger(__name__)
SYNCED_PHASES = ("train", "sync", "done")  # phases in which a record's round/digest describe real global weights


def data_seed_for(peer_id: str) -> int:
    """Default data order of a peer: derived from its peer id, so every peer reads a different order."""
    return int(hashlib.sha256(peer_id.encode()).hexdigest()[:8], 16)


class Peer:
    """A DiLoCo peer: inner training, outer step and the round protocol.

    Args:
        cfg: the full run config.
        metrics: event sink (``events.jsonl`` and the status line).
        swarm_factory: ``(cfg, tensors_like, state_provider) -> Swarm``; see :mod:`p2p_diloco.swarm`.
        stop: set it (e.g. from a signal handler) to stop at the next safe point.
        on_started: called with the swarm once it is up (the CLI prints the join line from it).
    """

    def __init__(self, cfg: Config, metrics: Metrics, swarm_factory: Callable[..., Any],
                 stop: threading.Event | None = None, on_started: Callable[[Any], None] | None = None):
        self.cfg, self.metrics, self.stop = cfg, metrics, stop or threading.Event()
        self.on_started = on_started
        if cfg.train.threads > 0:
            torch.set_num_threads(cfg.train.threads)
        self.device = resolve_device(cfg.train.device)
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.model = build_model(cfg.model, vocab_size(self.tokenizer), cfg.run.seed).to(self.device)
        self.params = list(self.model.parameters())
        self.eval_set = eval_batches(self.tokenizer, cfg.data, cfg.eval.batches)
        self.outer = outer_mod.OuterOptimizer(outer_mod.snapshot(self.params), cfg.outer.lr, cfg.outer.momentum,
                                              cfg.outer.nesterov)
        self.theta = self.outer.theta
        self.round, self.digest = 0, outer_mod.digest(self.theta)
        self._state_lock = threading.Lock()  # guards theta/momentum/round against the state-sharing thread
        self.swarm = swarm_factory(cfg, self.theta, self._state_for_donation)
        self.tokens_trained = self.bytes_sent = self.bytes_received = self.rounds_participated = 0
        self.eval_first: float | None = None
        self.eval_last: float | None = None
        log.info("model: %d parameters, fingerprint %s", count_parameters(self.model), cfg.fingerprint())

    # ------------------------------------------------------------------------------------------------ driver
    def run(self) -> dict[str, Any]:
        """Join the swarm, train until ``max_rounds`` (or a stop request), and return the summary."""
        self.swarm.start()
        try:
            if self.on_started:
                self.on_started(self.swarm)
            seed = self.cfg.data.seed if self.cfg.data.seed >= 0 else data_seed_for(self.swarm.peer_id)
            self.data = PackedStream(self.tokenizer, self.cfg.data, seed)
            horizon = self.cfg.train.total_steps or self.cfg.run.max_rounds * self.cfg.train.inner_steps
            self.trainer = InnerTrainer(self.model, self.cfg.train, self.data.next_batch, horizon, self.device)
            self._wait_for_peers()
            self.catch_up()
            self.swarm.publish(phase="train", round=self.round, digest=self.digest)
            self._evaluate()
            while not self.stop.is_set() and not self._finished():
                self.run_round()
            if self._finished():
                self._linger_for_stragglers()
        finally:
            self.swarm.shutdown()
        return self.summary()

    def _finished(self) -> bool:
        return 0 < self.cfg.run.max_rounds <= self.round

    def summary(self) -> dict[str, Any]:
        return {
            "peer_id": getattr(self.swarm, "peer_id", None), "run_id": self.cfg.run.run_id,
            "rounds_completed": self.round, "rounds_participated": self.rounds_participated,
            "global_digest": self.digest, "eval_loss_first": self.eval_first, "eval_loss_last": self.eval_last,
            "tokens_trained": self.tokens_trained, "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received, "stopped_early": not self._finished(),
        }

    # ------------------------------------------------------------------------------------------------- round
    def run_round(self) -> None:
        r = self.round
        self.metrics.event("round_start", r + 1, digest=self.digest)
        tokens = self._train_inner(r)
        if self.stop.is_set():
            return
        delta = [torch.empty_like(t) for t in self.theta]
        outer_mod.pseudo_gradient(self.theta, self.params, delta)
        if self._sync(r, delta, tokens):
            with self._state_lock:
                self.outer.step(delta)
                self.round, self.digest = r + 1, outer_mod.digest(self.theta)
            self.rounds_participated += 1
            self.metrics.event("outer_step", self.round, digest=self.digest)
        outer_mod.load_into(self.params, self.theta)
        self.swarm.publish(phase="train", round=self.round, digest=self.digest, inner_step=0)
        self.swarm.set_donor_round(self.round)
        if self.round % self.cfg.eval.every_rounds == 0 or self._finished():
            self._evaluate()

    def _train_inner(self, r: int) -> int:
        H, tokens, t0 = self.cfg.train.inner_steps, 0, time.monotonic()
        for k in range(H):
            if self.stop.is_set():
                break
            loss, n = self.trainer.step(r * H + k)
            tokens += n
            self.swarm.update(inner_step=k + 1, tokens=self.tokens_trained + tokens)
            rate = tokens / max(time.monotonic() - t0, 1e-9)
            self.metrics.status(f"round {r + 1} inner_step {k + 1}/{H} loss {loss:.3f} {rate:,.0f} tok/s")
        self.tokens_trained += tokens
        return tokens

    def _sync(self, r: int, delta: list[torch.Tensor], tokens: int) -> bool:
        """Average ``delta`` in place with round ``r``'s peers. False if we fell behind and loaded state."""
        deadline = time.monotonic() + self.cfg.swarm.round_timeout
        attempt = 0
        while not self.stop.is_set():
            peers = self._live_peers()
            if any(p.get("round", -1) > r and p.get("phase") in SYNCED_PHASES for p in peers.values()):
                self.catch_up()
                return False
            ready = ("sync",) if time.monotonic() > deadline else ("train", "sync")
            mates = sorted(pid for pid, p in peers.items() if p.get("round") == r and p.get("phase") in ready)
            if not mates:
                log.info("round %d: no other live peer in this round; applying our own pseudo-gradient", r + 1)
                self.metrics.event("allreduce_done", r + 1, group_size=1, bytes_sent=0, bytes_received=0,
                                   seconds=0.0, lone=True)
                return True
            attempt += 1
            if self._all_reduce(r, delta, tokens, len(mates) + 1, attempt):
                return True
        return False

    def _all_reduce(self, r: int, delta: list[torch.Tensor], tokens: int, group_size: int, attempt: int) -> bool:
        self.swarm.publish(phase="sync")
        self.metrics.event("allreduce_start", r + 1, expected_group_size=group_size, attempt=attempt)
        self.metrics.status(f"round {r + 1} all-reduce: matchmaking with {group_size} peers (attempt {attempt})")
        gather = {"round": r, "digest": self.digest, "tokens": tokens}
        try:
            result = self.swarm.all_reduce(r, delta, tokens, group_size, gather)
        except RoundFailed as e:
            self.metrics.event("allreduce_failed", r + 1, reason=str(e), attempt=attempt)
            return False
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self._check_group(r, result.gathered)
        self.metrics.event("allreduce_done", r + 1, group_size=result.group_size, bytes_sent=result.bytes_sent,
                           bytes_received=result.bytes_received, seconds=round(result.seconds, 3))
        return True

    def _check_group(self, r: int, gathered: dict[str, Any]) -> None:
        """Every member must have started the round from the same theta; a mismatch is a desync, logged loudly."""
        other = {pid: g.get("digest") for pid, g in gathered.items() if g.get("digest") != self.digest}
        if other or any(g.get("round") != r for g in gathered.values()):
            log.error("round %d: group members started from different global weights: %s", r + 1, other)
            self.metrics.event("digest_mismatch", r + 1, ours=self.digest, theirs=other)

    # ------------------------------------------------------------------------------------------ state sharing
    def _state_for_donation(self) -> tuple[dict, list[torch.Tensor]]:
        with self._state_lock:
            meta = {"round": self.round, "digest": self.digest, "fp": self.cfg.fingerprint(),
                    "peer_id": getattr(self.swarm, "peer_id", "")}
            return meta, [t.clone() for t in self.outer.state_tensors()]

    def catch_up(self) -> None:
        """If a live peer is past our round, download its (round, theta, momentum); verify before using it."""
        for _ in range(3):
            peers = self._live_peers()
            target = max((p.get("round", -1) for p in peers.values() if p.get("phase") in SYNCED_PHASES),
                         default=-1)
            if target <= self.round or self.stop.is_set():
                return
            self.metrics.status(f"downloading state of round {target} from the swarm")
            if self._load_state(target):
                return
        log.warning("could not download the swarm's state; continuing from round %d", self.round)

    def _load_state(self, target: int) -> bool:
        loaded = self.swarm.load_state()
        if loaded is None:
            return False
        meta, tensors = loaded
        n = len(self.theta)
        if meta.get("fp") != self.cfg.fingerprint() or meta.get("round", -1) < target or len(tensors) != 2 * n:
            log.warning("rejected state from %s: round/fingerprint/shape mismatch", meta.get("peer_id"))
            return False
        if outer_mod.digest(tensors[:n]) != meta.get("digest"):
            log.warning("rejected state from %s: digest does not match its contents", meta.get("peer_id"))
            return False
        with self._state_lock:
            self.outer.load_state_tensors(tensors)
            self.round, self.digest = int(meta["round"]), meta["digest"]
        outer_mod.load_into(self.params, self.theta)
        self.swarm.set_donor_round(self.round)
        self.metrics.event("state_loaded", self.round, from_peer=meta.get("peer_id"), digest=self.digest)
        return True

    # ------------------------------------------------------------------------------------------------- misc
    def _evaluate(self) -> None:
        loss = evaluate(self.model, self.eval_set, self.device, self.cfg.train.autocast)
        self.eval_first = loss if self.eval_first is None else self.eval_first
        self.eval_last = loss
        self.swarm.update(eval_loss=loss)
        self.metrics.event("eval", self.round, loss=round(loss, 6))

    def _live_peers(self) -> dict[str, dict]:
        """The swarm's live records. A DHT hiccup is retried: guessing "no peers" would mean a solo step."""
        while True:
            try:
                return self.swarm.live_peers()
            except TimeoutError:
                log.warning("DHT did not answer; retrying")
                if self.stop.wait(1.0):
                    raise

    def _wait_for_peers(self) -> None:
        """Hold the first round until ``swarm.min_peers`` peers are live, so that they all take part in it."""
        want, deadline = self.cfg.swarm.min_peers - 1, time.monotonic() + self.cfg.swarm.min_peers_timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            seen = len(self._live_peers())
            if seen >= want:
                return
            self.metrics.status(f"waiting for peers: {seen + 1}/{want + 1} live")
            self.stop.wait(self.cfg.swarm.heartbeat_period)
        if not self.stop.is_set():
            log.warning("only %d of %d peers live after %.0fs; starting anyway", len(self._live_peers()) + 1,
                        want + 1, self.cfg.swarm.min_peers_timeout)

    def _linger_for_stragglers(self) -> None:
        """Stay a state donor for a while so a peer that missed the last round can still catch up."""
        self.swarm.publish(phase="done", round=self.round, digest=self.digest)
        deadline = time.monotonic() + self.cfg.swarm.state_timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            behind = [pid for pid, p in self._live_peers().items()
                      if p.get("phase") in ("join", "train", "sync") and p.get("round", -1) < self.round]
            if not behind:
                return
            self.metrics.status(f"finished round {self.round}; waiting for {len(behind)} peer(s) to catch up")
            self.stop.wait(self.cfg.swarm.heartbeat_period)
