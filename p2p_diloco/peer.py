"""One DiLoCo peer and its round protocol. No hivemind here: the swarm is reached through a :class:`Swarm`-like
object built by the CLI.

A round, seen from one peer holding the global weights theta(r) (bit-identical on every synced peer):

1. start from theta(r) and run H inner AdamW steps on this peer's own data;
2. pseudo_gradient = theta(r) - local weights;
3. average it, weighted by tokens trained, with *every* live peer of round r (the group size is taken from the
   live records in the DHT, and hivemind is told to form a group of exactly that size, so the swarm never splits
   into disjoint groups that would each average a different subset);
4. apply the outer Nesterov step -> theta(r+1); copy it into the model; checkpoint.

Failure rules, checked in this order before every all-reduce attempt (each wait is bounded by a ``[swarm]``
timeout, see docs/protocol.md):

* the swarm is already past round r -> we missed the round: download (round, theta, momentum) from a peer
  holding the majority digest of the swarm's round (consensus.swarm_round), trying the next donor on a failure;
* the peers of round r mostly hold another digest than ours -> our theta is corrupt: download theta(r) from the
  majority, sit the rest of the round out (phase "repair"), and take theta(r+1) when the others have it;
* no other live peer is in round r, confirmed over a record lifetime -> we are the whole swarm: solo step;
* the all-reduce fails in any way (a peer died, froze, left) -> apply nothing, re-read the records, try again.

Round numbers are swarm-wide: ``max_rounds`` R means "stop once theta(R) exists", for late joiners too.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Callable

import torch

from . import consensus, progress
from . import outer as outer_mod
from .cluster import INIT, Cluster, ClusterReplica, ClusterTrainer
from .checkpoint import CheckpointStore, PeerState
from .peer_checkpoints import PeerCheckpoints, check_resumable
from .config import Config
from .data import PackedStream, eval_batches
from .deadlines import Deadlines, StragglerWait
from .errors import RoundFailed
from .inner import InnerTrainer, Replica, resolve_device
from .metrics import Metrics
from .model import build_model, count_parameters
from .overlap import OverlappedRounds
from .recovery import Recovery
from .tokenizer import build_tokenizer, vocab_size

log = logging.getLogger(__name__)
SYNCED_PHASES = consensus.SYNCED_PHASES
PROGRESS_EVERY = 10  # inner steps between inner_progress events (fault benchmarks count lost work with them)


def data_seed_for(peer_id: str) -> int:
    """Default data order of a peer: derived from its peer id, so every peer reads a different order."""
    return int(hashlib.sha256(peer_id.encode()).hexdigest()[:8], 16)


class Peer(PeerCheckpoints, Recovery, OverlappedRounds):
    """A DiLoCo peer: inner training, outer step, the round protocol, fault recovery and checkpoints.

    Args:
        cfg: the full run config.
        metrics: event sink (``events.jsonl`` and the status line).
        swarm_factory: ``(cfg, tensors_like, state_provider) -> Swarm``; see :mod:`p2p_diloco.swarm`.
        stop: set it (e.g. from a signal handler) to stop at the next safe point.
        on_started: called with the swarm once it is up (the CLI prints the join line from it).
        cluster: this peer's local ranks under torchrun (we are rank 0; :mod:`p2p_diloco.cluster`), or None.

    Raises:
        CheckpointError: ``checkpoint.resume`` is set and the newest checkpoint is missing, corrupt or belongs
            to another config (raised here, before anything joins the swarm).
    """

    def __init__(self, cfg: Config, metrics: Metrics, swarm_factory: Callable[..., Any],
                 stop: threading.Event | None = None, on_started: Callable[[Any], None] | None = None,
                 cluster: Cluster | None = None):
        self.cfg, self.metrics, self.stop = cfg, metrics, stop or threading.Event()
        self.cluster = cluster
        self.on_started = on_started
        self.store = CheckpointStore(cfg.checkpoint.dir, cfg.checkpoint.keep) if cfg.checkpoint.dir else None
        self.resumed: PeerState | None = self.store.load(fingerprint=cfg.fingerprint()) if (
            self.store and cfg.checkpoint.resume) else None
        if self.resumed:
            check_resumable(self.resumed, cfg, cluster)
        if cfg.train.threads > 0:
            torch.set_num_threads(cfg.train.threads)
        self.device = cluster.device if cluster else resolve_device(cfg.train.device)
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.model = build_model(cfg.model, vocab_size(self.tokenizer), cfg.run.seed).to(self.device)
        self.params = list(self.model.parameters())
        self.eval_set = eval_batches(self.tokenizer, cfg.data, cfg.eval.batches)
        self.outer = self._build_outer()
        self.theta = self.outer.theta
        self.round, self.digest = 0, self._theta_digest()
        self._state_lock = threading.Lock()  # guards theta/momentum/round against the state-sharing thread
        self.swarm = self._build_swarm(swarm_factory)
        self.tokens_trained = self.bytes_sent = self.bytes_received = self.rounds_participated = 0
        self.inner_steps_done = 0
        self.eval_first: float | None = None
        self.eval_last: float | None = None
        self._last_group_size = 1
        self._tokens_per_s = 0.0  # our training speed in the last round (swarm_target progress records)
        self.deadlines = Deadlines(cfg.swarm)
        self._at_boundary = True  # no inner step since theta(self.round) was set: a consistent checkpoint point
        log.info("model: %d parameters, fingerprint %s", count_parameters(self.model), cfg.fingerprint())

    # ------------------------------------------------------------------------------------- outer state (hooks)
    # A sharded peer (p2p_diloco/sharded_peer.py) keeps only its shards of theta and overrides these.
    def _build_outer(self):
        return outer_mod.OuterOptimizer(outer_mod.snapshot(self.params), self.cfg.outer.lr, self.cfg.outer.momentum,
                                        self.cfg.outer.nesterov)

    def _build_swarm(self, swarm_factory: Callable[..., Any]):
        return swarm_factory(self.cfg, self.theta, self._state_for_donation)

    def _theta_digest(self) -> str:
        return outer_mod.digest(self.theta)

    def _outer_step(self, delta: list[torch.Tensor]) -> None:
        self.outer.step(delta)

    def _delta_buffers(self) -> list[torch.Tensor]:
        return [torch.empty_like(t) for t in self.theta]

    # ------------------------------------------------------------------------------------------------ driver
    def run(self) -> dict[str, Any]:
        """Join the swarm, train until ``max_rounds`` (or a stop request), and return the summary."""
        self.swarm.start()
        try:
            if self.on_started:
                self.on_started(self.swarm)
            self._build_trainer()
            if self.resumed:
                self._restore(self.resumed)
            self.swarm.publish(ready=True)  # data and model are built: we can start a round at once
            self._wait_for_peers()
            self._join_swarm()
            if self.cfg.outer.overlap:
                self.run_overlapped()
            while not self.stop.is_set() and not self._finished():
                self.run_round()
            if self._finished():
                self._linger_for_stragglers()
            elif self._at_boundary:
                self._save_checkpoint(force=True)  # stopped between rounds: keep exactly this point
        finally:
            if self.cluster:  # the other local ranks stop first: the swarm's shutdown can take a few seconds
                self.cluster.stop_followers()
            self.swarm.shutdown()
            if hasattr(self, "data"):
                self.data.close()
        return self.summary()

    def _build_trainer(self) -> None:
        saved = self.resumed.extra if self.resumed else {}
        seed = saved.get("data_seed", self.cfg.data.seed)
        if seed is None or seed < 0:
            seed = data_seed_for(self.swarm.peer_id)
        self.data_seed = seed
        self.data = PackedStream(self.tokenizer, self.cfg.data, seed)
        horizon = self.cfg.train.total_steps or self.cfg.run.max_rounds * self.cfg.train.inner_steps
        if self.cluster:
            self.cluster.send(INIT, seed)  # the other ranks build the same data stream, then wrap the model with us
            self.trainer = ClusterTrainer(self.cluster, self.model, self.cfg.train, self.data.next_batch, horizon)
            self.replica = ClusterReplica(self.cluster, self.model, self.trainer, self.cfg.train.autocast)
        else:
            self.trainer = InnerTrainer(self.model, self.cfg.train, self.data.next_batch, horizon, self.device)
            self.replica = Replica(self.model, self.trainer, self.cfg.train.autocast)

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
        tokens, steps = self._train_inner(r)
        if self.stop.is_set():
            return
        delta = self._delta_buffers()
        self.replica.pseudo_gradient(self.theta, delta)
        self._sync_and_step(r, delta, tokens, steps)
        self._boundary()

    def _sync_and_step(self, r: int, delta: list[torch.Tensor], tokens: int, steps: int) -> bool:
        """Average ``delta`` with round ``r``'s peers and apply the outer step -> theta(r + 1). False if we fell
        behind, repaired or stopped instead (theta is then whatever recovery left; nothing half-applied)."""
        if not self._sync(r, delta, tokens):
            return False
        with self._state_lock:
            self._outer_step(delta)
            self.round, self.digest = r + 1, self._theta_digest()
        self.rounds_participated += 1
        self.metrics.event("outer_step", self.round, digest=self.digest, inner_steps=steps)
        self._debug_corrupt()
        return True

    def _boundary(self, phase: str = "train") -> None:
        """theta(self.round) is set (outer step or download): load it, announce it, checkpoint, evaluate."""
        self.replica.load(self.theta)
        self._at_boundary = True
        self.swarm.publish(phase=phase, round=self.round, digest=self.digest, inner_step=0, round_tokens=0)
        self.swarm.set_donor_round(self.round)
        self._save_checkpoint()
        if self.round % self.cfg.eval.every_rounds == 0 or self._finished():
            self._evaluate()

    def _train_inner(self, r: int) -> tuple[int, int]:
        """Round ``r``'s inner steps: H of them, or (``swarm_target``) until the swarm's progress reaches the
        round's target (:mod:`p2p_diloco.progress`). Returns (tokens trained, inner steps)."""
        H, tokens, k, t0 = self.cfg.train.inner_steps, 0, 0, time.monotonic()
        by_target = self.cfg.round.mode == "swarm_target"
        step_tokens = self.data.tokens_per_batch * self.cfg.train.grad_accum
        records: dict[str, dict] = {}
        lr_step, next_read = r * H, t0
        if self.cfg.debug.stall_round == r + 1:
            self.stop.wait(self.cfg.debug.stall)  # tests only: a training stall while our records stay live
        while not self.stop.is_set():
            if not by_target and k >= H:
                break
            if by_target:
                if time.monotonic() >= next_read:  # publish ours, read theirs; extrapolate them in between
                    records = self._exchange_progress(tokens, step_tokens, time.monotonic() - t0)
                    next_read = time.monotonic() + self.cfg.round.progress_period
                done = progress.swarm_progress(r, tokens, step_tokens, records, H, self.cfg.round.target_tokens,
                                               now=time.time())
                if done.reached and k > 0:  # at least one step: a zero-token pseudo-gradient has no weight
                    break
                # the lr schedule follows the swarm's progress through the round, so fast and slow peers agree
                lr_step = r * H + min(H - 1, int(H * done.fraction))
            k += 1
            self._at_boundary = False
            loss, n = self.trainer.step(lr_step if by_target else r * H + k - 1)
            tokens += n
            rate = tokens / max(time.monotonic() - t0, 1e-9)
            self.swarm.update(inner_step=k, tokens=self.tokens_trained + tokens, round_tokens=tokens,
                              **({} if by_target else {"tokens_per_s": round(rate, 1)}))  # (else: progress records)
            if k % PROGRESS_EVERY == 0 or k == H:
                self.metrics.event("inner_progress", r + 1, inner_step=k, loss=round(loss, 4),
                                   global_step=self.inner_steps_done + k)  # this peer's steps so far
            self.metrics.status(f"round {r + 1} inner_step {k}{'' if by_target else f'/{H}'} loss {loss:.3f} "
                                f"{rate:,.0f} tok/s")
            if self.cfg.debug.step_delay:
                self.stop.wait(self.cfg.debug.step_delay)  # tests and benchmarks only: a slow peer
        self.tokens_trained += tokens
        self.inner_steps_done += k
        self.metrics.event("inner_done", r + 1, inner_steps=k, tokens=tokens, seconds=round(time.monotonic() - t0, 3))
        return tokens, k

    def _exchange_progress(self, tokens: int, step_tokens: int, elapsed: float) -> dict[str, dict]:
        """Publish our progress in the round (``swarm_target``) and return the other peers' records."""
        rate = tokens / elapsed if tokens and elapsed > 0 else self._tokens_per_s
        self._tokens_per_s = rate
        self.swarm.publish(round_tokens=tokens, step_tokens=step_tokens, tokens_per_s=round(rate, 1))
        return self._live_peers()

    def _sync(self, r: int, delta: list[torch.Tensor], tokens: int) -> bool:
        """Average ``delta`` in place with round ``r``'s peers. False if we fell behind or repaired instead."""
        wait = StragglerWait(self.deadlines, time.monotonic())  # then round-mates still training are left out
        attempt = 0
        self.swarm.publish(phase="sync")  # our pseudo-gradient for round r is ready
        while not self.stop.is_set():
            peers = self._live_peers()
            if consensus.swarm_round(peers) > r or consensus.alone_ahead(peers, r):
                self.catch_up()
                return False
            good = consensus.needs_repair(peers, r, self.digest)
            if good is not None:
                self._repair(r, good, peers)
                return False
            late = sorted(pid for pid, p in peers.items() if p.get("round") == r and p.get("phase") == "train")
            ready, give_up = wait.phases(late, time.monotonic())
            if give_up:
                waited = time.monotonic() - wait.started
                log.warning("round %d: leaving out %d round-mate(s) still training after %.1f s", r + 1, len(late),
                            waited)
                self.metrics.event("stragglers_dropped", r + 1, peers=late, waited_s=round(waited, 2))
            mates = sorted(pid for pid, p in peers.items() if p.get("round") == r and p.get("phase") in ready)
            if self.cfg.outer.overlap and any(peers[m].get("phase") != "sync" for m in mates):
                # Overlapped peers start syncing as soon as their inner steps end, at different moments: matching
                # now would fix the group size before the slower ones (or a newcomer) are in, and whoever came
                # first would take their places. We are training meanwhile, so waiting here costs nothing.
                self.stop.wait(0.2)
                continue
            if not mates:
                if not self._confirm_alone(r):
                    continue
                log.info("round %d: no other live peer in this round; applying our own pseudo-gradient", r + 1)
                self.metrics.event("allreduce_done", r + 1, group_size=1, bytes_sent=0, bytes_received=0,
                                   seconds=0.0, lone=True)
                self._last_group_size = 1
                return True
            attempt += 1
            # with round-mates still training, an attempt that expects them ends at the straggler deadline
            give_up_at = wait.deadline if late and ready != ("sync",) else None
            if self._all_reduce(r, delta, tokens, len(mates) + 1, attempt, all_in=not late, give_up_at=give_up_at):
                wait.averaged(time.monotonic())
                return True
        return False

    def _all_reduce(self, r: int, delta: list[torch.Tensor], tokens: int, group_size: int, attempt: int,
                    all_in: bool = True, give_up_at: float | None = None) -> bool:
        """One all-reduce attempt. ``all_in``: no round-mate was still training, so a failure to assemble the
        group says the matchmaking window is too short for this swarm (it then grows; see deadlines.py).
        ``give_up_at``: stop matchmaking at this ``time.monotonic()`` (the straggler deadline)."""
        self.swarm.publish(phase="sync")
        self.metrics.event("allreduce_start", r + 1, expected_group_size=group_size, attempt=attempt,
                           **self.deadlines.snapshot())
        self.metrics.status(f"round {r + 1} all-reduce: matchmaking with {group_size} peers (attempt {attempt})")
        if attempt == 1 and self.cfg.debug.sync_delay_round == r + 1:
            self.stop.wait(self.cfg.debug.sync_delay)  # fault tests only (debug.sync_delay)
        gather = {"round": r, "digest": self.digest, "tokens": tokens}
        running = []

        def on_running() -> None:
            running.append(True)
            self.metrics.event("allreduce_running", r + 1, attempt=attempt)

        # Matchmaking that expects a round-mate still training ends at the straggler deadline (or after the
        # matchmaking window, if that is later) by hivemind's own step timeout. Cancelling the step instead is
        # worse: a step cancelled just as a round-mate's retry took it into a smaller group leaves that round-mate
        # waiting for our parts (measured: 10 s and a lost round).
        look = None if give_up_at is None else max(0.5, give_up_at - time.monotonic())
        try:
            result = self.swarm.all_reduce(
                r, delta, tokens, group_size, gather, should_stop=self.stop.is_set, on_running=on_running,
                matchmaking_time=self.deadlines.get("matchmaking"), allreduce_timeout=self.deadlines.get("allreduce"),
                matchmaking_timeout=look)
        except RoundFailed as e:
            self.metrics.event("allreduce_failed", r + 1, reason=str(e), attempt=attempt)
            if running:
                self.deadlines.allreduce.backoff()
            elif all_in and not self.stop.is_set():
                self.deadlines.matchmaking.backoff()
            return False
        if all_in:  # otherwise assembling included waiting for round-mates' inner steps
            self.deadlines.matchmaking.observe(result.assembly_seconds)
        self.deadlines.allreduce.observe(result.seconds - result.assembly_seconds)
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self._last_group_size = result.group_size
        self.swarm.update(last_sync=round(time.time(), 1))  # for `p2p-diloco status`
        self._check_group(r, result.gathered)
        for pid, reason in sorted(result.excluded.items()):  # our reducers left a bad contribution out
            log.warning("round %d: left out the contribution of peer %s: %s", r + 1, pid, reason)
            self.metrics.event("contribution_excluded", r + 1, peer=pid, reason=reason)
        self.metrics.event("allreduce_done", r + 1, group_size=result.group_size, bytes_sent=result.bytes_sent,
                           bytes_received=result.bytes_received, seconds=round(result.seconds, 3))
        return True

    def _check_group(self, r: int, gathered: dict[str, Any]) -> None:
        """Every member must have started the round from the same theta; a mismatch is a desync, logged loudly.

        The result is still applied: the next round's digest check repairs whichever side is in the minority.
        """
        other = {pid: g.get("digest") for pid, g in gathered.items() if g.get("digest") != self.digest}
        if other or any(g.get("round") != r for g in gathered.values()):
            log.error("round %d: group members started from different global weights: %s", r + 1, other)
            self.metrics.event("digest_mismatch", r + 1, ours=self.digest, theirs=other)

    def _debug_corrupt(self) -> None:
        """Test hook (``debug.corrupt_theta_at_round``): silently perturb theta, as a bit flip or bug would."""
        if self.cfg.debug.corrupt_theta_at_round != self.round:
            return
        with self._state_lock:
            self.theta[0].view(-1)[0] += 1e-3
            self.digest = self._theta_digest()
        log.warning("debug: corrupted theta after round %d (digest now %s)", self.round, self.digest[:12])
        self.metrics.event("debug_corrupted", self.round, digest=self.digest)

    # ------------------------------------------------------------------------------------------------- misc
    def _evaluate(self) -> None:
        loss = self.replica.evaluate(self.eval_set)
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
