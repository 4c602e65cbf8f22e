"""Recovery half of the round protocol: taking the swarm's state (joining, falling behind, repairing a corrupt
theta), deciding that a peer is really alone, and waiting for the others at the start and end of a run. A mixin of :class:`p2p_diloco.peer.Peer`, kept apart so that
each file stays readable; it uses the peer's ``cfg``, ``swarm``, ``metrics``, ``stop``, ``outer``/``theta``,
``round``/``digest`` (under ``_state_lock``) and ``_boundary()``.

Every download goes to a peer holding the *majority* digest of the round it is taken from, is re-verified on
arrival (:func:`p2p_diloco.consensus.check_donated_state`), and moves on to the next donor on any failure, so a
dead, frozen, buggy or lying donor costs time, never correctness.
"""

from __future__ import annotations

import logging
import time

import torch

from . import consensus
from .errors import RoundFailed
from .outer import digest as digest_of

log = logging.getLogger("p2p_diloco.peer")


class Recovery:
    """State download, catch-up, desync repair, the lone-peer check, the start and end waits (module docstring)."""

    def _confirm_alone(self, r: int) -> bool:
        """Before a solo step, make sure the others are really gone and not just missing from one DHT read.

        A peer that averaged with others last round waits a full record lifetime: a solo step taken while they
        are alive would fork theta (their records reappear, or they were only between two heartbeats).
        """
        if self._last_group_size <= 1:
            return True
        wait_until = time.monotonic() + self.cfg.swarm.peer_ttl + self.cfg.swarm.heartbeat_period
        self.metrics.status(f"round {r + 1}: the other peers are gone; confirming before a solo step")
        while time.monotonic() < wait_until:
            if self.stop.wait(self.cfg.swarm.heartbeat_period):
                return False
            peers = self._live_peers()
            if consensus.synced(peers, r) or consensus.swarm_round(peers) > r or consensus.alone_ahead(peers, r):
                return False
        self._last_group_size = 1
        return True

    def _state_for_donation(self) -> tuple[dict, list[torch.Tensor]]:
        with self._state_lock:
            meta = {"round": self.round, "digest": self.digest, "fp": self.cfg.fingerprint(),
                    "peer_id": getattr(self.swarm, "peer_id", "")}
            tensors = [t.clone() for t in self.outer.state_tensors()]
        if self.cfg.debug.corrupt_state:  # security tests: a lying donor, self-consistent but not the majority's
            for t in tensors[:len(self.theta)]:
                t.add_(1e-2)
            meta["digest"] = digest_of(tensors[:len(self.theta)])
        return meta, tensors

    def _join_swarm(self) -> None:
        """Take the swarm's state, then start at a round boundary: a newcomer that starts a round that is well
        under way would make every other peer of that round wait for its inner steps."""
        self.catch_up()
        deadline = time.monotonic() + self.cfg.swarm.round_timeout
        while not self.stop.is_set() and not self._finished() and time.monotonic() < deadline:
            peers = self._live_peers()
            if consensus.swarm_round(peers) > self.round:
                self.catch_up()
            elif self.round == 0 and self.cfg.swarm.min_peers > 1:
                break  # the first round of a swarm that waited for min_peers: the others expect us in it
            elif not consensus.round_well_under_way(peers, self.round, self.cfg.train.inner_steps,
                                                    self.cfg.outer.overlap):
                break
            self.metrics.status(f"joined; waiting for the swarm to finish round {self.round + 1}")
            self.stop.wait(min(0.2, self.cfg.swarm.heartbeat_period))  # the next boundary is a short window
        # With overlap the round we can still contribute to is decided by OverlappedRounds: nobody may count us as
        # a member of a round before that.
        self._boundary(phase="join" if self.cfg.outer.overlap else "train")

    def catch_up(self) -> None:
        """If the swarm is past our round, download the majority's (round, theta, momentum) of the swarm's round
        (:func:`consensus.swarm_round`); if we are ahead alone of peers that will not follow us, go back to their
        round the same way. The caller announces the new round (:meth:`_boundary`)."""
        for _ in range(3):
            peers = self._live_peers()
            target = consensus.swarm_round(peers)
            back = consensus.alone_ahead(peers, self.round)
            if (target <= self.round and not back) or target < 0 or self.stop.is_set():
                return
            if back:
                log.warning("we hold round %d alone; the %d other peers are in earlier rounds and will not follow: "
                            "going back to round %d", self.round, len(consensus.synced(peers)), target)
            self.metrics.status(f"downloading state of round {target} from the swarm")
            digest, donors = consensus.pick_donors(peers, target)
            if self.cfg.debug.prefer_donor in donors:  # tests only: make sure a given (lying) donor is tried first
                donors.remove(self.cfg.debug.prefer_donor)
                donors.insert(0, self.cfg.debug.prefer_donor)
            if self._load_state(target, digest, donors, exact_round=back):
                return
        log.warning("could not download the swarm's state; continuing from round %d", self.round)

    def _repair(self, r: int, good: str, peers: dict[str, dict]) -> None:
        """Our theta(r) differs from the majority's: replace it, and sit out the rest of round r."""
        log.error("round %d: our global weights (%s) differ from the majority (%s); repairing", r + 1,
                  self.digest[:12], good[:12])
        self.metrics.event("desync_detected", r + 1, ours=self.digest, majority=good)
        self.swarm.publish(phase="repair")  # nobody waits for us or downloads from us meanwhile
        donors = sorted(pid for pid, p in consensus.synced(peers, r).items() if p.get("digest") == good)
        if not self._load_state(r, good, donors, exact_round=True):
            return  # retried at the next check; we stay out of the groups until then
        self.swarm.publish(phase="repair", digest=self.digest)
        self._wait_for_round_end(r, self.cfg.swarm.heartbeat_period)

    def _wait_for_round_end(self, r: int, poll: float) -> None:
        """Sit out round ``r``: once the swarm holds theta(r+1), download it. Returns early if the peers of round
        ``r`` are gone (nothing will come) or after ``swarm.round_timeout``."""
        deadline = time.monotonic() + self.cfg.swarm.round_timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            peers = self._live_peers()
            if consensus.swarm_round(peers) > r:
                self.catch_up()
                return
            if not consensus.synced(peers, r):
                return
            self.stop.wait(poll)

    def _load_state(self, target: int, digest: str | None, donors: list[str], exact_round: bool = False) -> bool:
        """Download from the first donor whose state checks out; True once loaded (``state_loaded`` event)."""
        for donor in donors:
            self.metrics.event("state_download_start", target, from_peer=donor)
            try:
                meta, tensors = self.swarm.download_state(donor)
            except RoundFailed as e:
                log.warning("%s; trying the next donor", e)
                self.metrics.event("state_download_failed", target, from_peer=donor, reason=str(e))
                continue
            want, expected = target, digest
            got = meta.get("round") if isinstance(meta, dict) else None
            if isinstance(got, int) and got > target and not exact_round:
                # The donor moved on during the download: its state must then be the majority's of *that* round,
                # vouched for by peers other than the donor (else a liar would only need to claim a later round).
                # With no other synced peer at all (a lone donor), its own live record is all there is to go by.
                peers = self._live_peers()
                others = {pid: p for pid, p in peers.items() if pid != donor}
                vouching = others if consensus.synced(others) else {donor: peers.get(donor, {})}
                want, expected = got, consensus.pick_donors(vouching, got)[0]
            problem = consensus.check_donated_state(meta, tensors, self.theta, self.cfg.fingerprint(), want, expected,
                                                    exact_round)
            if problem is None and expected is None and want != target:
                problem = f"no other peer vouches for its round {want}"
            if problem:
                log.warning("rejected state from %s: %s", donor, problem)
                self.metrics.event("state_download_failed", target, from_peer=donor, reason=problem)
                continue
            with self._state_lock:
                self.outer.load_state_tensors(tensors)
                self.round, self.digest = int(meta["round"]), meta["digest"]
            # The model gets theta at the next boundary (_boundary): with outer.overlap this runs in the background
            # while the model is training.
            self.metrics.event("state_loaded", self.round, from_peer=donor, digest=self.digest)
            return True
        return False

    def _wait_for_peers(self) -> None:
        """Hold the first round until ``swarm.min_peers`` peers are live and ready to train (their data is built:
        that can take a while), so that they all start it together and all take part in it."""
        want, deadline = self.cfg.swarm.min_peers - 1, time.monotonic() + self.cfg.swarm.min_peers_timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            seen = sum(1 for p in self._live_peers().values() if p.get("ready"))
            if seen >= want:
                return
            self.metrics.status(f"waiting for peers: {seen + 1}/{want + 1} ready")
            self.stop.wait(min(0.25, self.cfg.swarm.heartbeat_period))  # they all start within a short window
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
