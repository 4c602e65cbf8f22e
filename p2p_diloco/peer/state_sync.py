"""Taking the swarm's state: joining, catching up after falling behind, repairing a theta the majority does not
hold, and sitting a round out until the swarm holds the next theta.

Every download goes to a peer holding the *majority* digest of the round it is taken from (among the records a
certificate we trust backs: :class:`~.chain.Chain`), is re-verified on arrival, its certificate included
(:meth:`GlobalState.fetch <p2p_diloco.outer.state.GlobalState.fetch>`), and moves on to the next donor on any
failure, so a dead, frozen, buggy or lying donor costs time, never correctness. The decisions are
:mod:`p2p_diloco.protocol.rules`'; this part carries them out.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..metrics.events import Event
from ..protocol import rules
from ..protocol.actions import CatchUp, Download, Repair, Start, Stay, Wait
from ..protocol.records import Phase
from .chain import Chain
from .context import PeerContext, PeerStats

log = logging.getLogger("p2p_diloco.peer")
CATCH_UP_TRIES = 3  # reads of the records, each followed by a download from every donor of the majority
KEEP_UP_LOADS = 3  # states taken in a row with no round of ours averaged in between: we are not keeping up


class StateSync:
    """Catch-up, repair and the join of a newcomer (module docstring).

    Args:
        ctx: the peer's shared context.
        chain: the certificates we follow.
        stats: the peer's counters (``rounds_participated`` tells whether a round of ours was averaged since the
            last state we took).
    """

    def __init__(self, ctx: PeerContext, chain: Chain, stats: PeerStats):
        self.ctx, self.chain, self.stats = ctx, chain, stats
        self._loads_in_a_row, self._participated_at_load = 0, -1

    def join(self, finished: Callable[[], bool]) -> Phase:
        """Take the swarm's state, then wait for a round boundary to start at (:func:`rules.decide_join`).
        Returns the phase to announce at that boundary."""
        ctx, sc = self.ctx, self.ctx.cfg.swarm
        self.catch_up()
        deadline = ctx.clock.monotonic() + sc.round_timeout
        phase = Phase.JOIN if ctx.cfg.outer.overlap else Phase.TRAIN
        # decide_join's ``waited``: we took the state of a boundary we had waited for
        waiting = caught_up_after_wait = False
        while not ctx.stop.is_set():
            view = ctx.view()
            ahead = sum(1 for claimed in self.chain.unverified.values() if claimed > ctx.state.round)
            action = rules.decide_join(ctx.state.round, view, inner_steps=ctx.cfg.train.inner_steps,
                                       overlap=ctx.cfg.outer.overlap, waits_for_min_peers=sc.min_peers > 1,
                                       finished=finished(), now=ctx.clock.monotonic(), deadline=deadline,
                                       poll=min(rules.JOIN_POLL, sc.heartbeat_period), me=ctx.swarm.peer_id or "",
                                       head_members=self.chain.head_members(), unverified_ahead=ahead,
                                       waited=caught_up_after_wait)
            if isinstance(action, Start):
                return action.phase
            if isinstance(action, CatchUp):
                self.catch_up()
                caught_up_after_wait = waiting
            waiting = waiting or isinstance(action, Wait)
            ctx.status(f"joined; waiting for the swarm to finish round {ctx.state.round + 1}")
            ctx.sleep(min(rules.JOIN_POLL, sc.heartbeat_period))
        return phase

    def catch_up(self) -> None:
        """If the swarm is past our round (or will not follow us ahead), take the majority's state of its round
        (:func:`rules.decide_catch_up`). The caller announces the new round."""
        ctx = self.ctx
        for _ in range(CATCH_UP_TRIES):
            if ctx.stop.is_set():
                return
            action = rules.decide_catch_up(ctx.state.round, ctx.view(), ctx.rng)
            if isinstance(action, Stay):
                return
            if action.exact_round:
                log.warning("%s: going back to round %d", action.reason, action.target)
            ctx.status(f"downloading state of round {action.target} from the swarm")
            if self.load(action):
                return
        log.warning("could not download the swarm's state; continuing from round %d", ctx.state.round)

    def repair(self, r: int, action: Repair) -> None:
        """Our theta(``r``) differs from the majority's: replace it, and sit out the rest of the round."""
        ctx = self.ctx
        log.error("round %d: our global weights (%s) differ from the majority (%s); repairing", r + 1,
                  ctx.state.digest[:12], action.digest[:12])
        ctx.emit_in_round(Event.DESYNC_DETECTED, r, ours=ctx.state.digest, majority=action.digest)
        ctx.swarm.publish(phase=Phase.REPAIR)  # nobody waits for us or downloads from us meanwhile
        plan = Download(target=r, digest=action.digest, donors=action.donors, exact_round=True, reason=action.reason)
        if not self.load(plan):
            return  # retried at the next check; we stay out of the groups until then
        ctx.announce(Phase.REPAIR)
        self.wait_for_round_end(r, ctx.cfg.swarm.heartbeat_period)

    def repair_last_round(self, action: Repair) -> None:
        """After the run's last round our state differs from the majority's: take theta(round) from them, the same
        round (there is no next round to sit out)."""
        ctx = self.ctx
        r = ctx.state.round
        log.error("after the last round our state (%s) differs from the majority (%s); repairing",
                  ctx.state.digest[:12], action.digest[:12])
        ctx.emit(Event.DESYNC_DETECTED, r, ours=ctx.state.digest, majority=action.digest)
        plan = Download(target=r, digest=action.digest, donors=action.donors, exact_round=True, reason=action.reason)
        if self.load(plan):
            ctx.announce(Phase.DONE)
        else:
            ctx.sleep(ctx.cfg.swarm.heartbeat_period)  # decided again at the next look, until the linger deadline

    def wait_for_round_end(self, r: int, poll: float) -> None:
        """Sit out the round after theta(``r``): once the swarm holds theta(r+1), download it
        (:func:`rules.decide_round_end`)."""
        ctx = self.ctx
        deadline = ctx.clock.monotonic() + ctx.cfg.swarm.round_timeout
        while not ctx.stop.is_set():
            action = rules.decide_round_end(r, ctx.view(), ctx.clock.monotonic(), deadline, poll)
            if isinstance(action, CatchUp):
                self.catch_up()
                return
            if isinstance(action, Stay):
                return
            assert isinstance(action, Wait)
            ctx.sleep(action.seconds)

    def load(self, plan: Download) -> bool:
        """Take the state ``plan`` names from the first of its donors whose state checks out (``state_loaded``)."""
        ctx = self.ctx
        head = ctx.state.certificate
        for donor in plan.donors:
            started = ctx.clock.monotonic()
            ctx.emit(Event.STATE_DOWNLOAD_START, plan.target, from_peer=donor)
            problem = ctx.state.fetch(ctx.swarm, donor, plan, ctx.view, ctx.cfg.fingerprint(), self.chain.trust)
            if problem:
                log.warning("state from %s not used: %s; trying the next donor", donor, problem)
                ctx.emit(Event.STATE_DOWNLOAD_FAILED, plan.target, from_peer=donor, reason=problem)
                continue
            self.chain.certify_download(head)
            # The model gets theta at the next boundary: with outer.overlap this runs in the background while the
            # model is training.
            ctx.emit(Event.STATE_LOADED, ctx.state.round, from_peer=donor, digest=ctx.state.digest)
            self._check_keeping_up(ctx.clock.monotonic() - started)
            return True
        return False

    def _check_keeping_up(self, seconds: float) -> None:
        """Say so (a warning and ``cannot_keep_up``, every :data:`KEEP_UP_LOADS` states) when we keep taking the
        swarm's state and none of our rounds gets averaged in between: a state download that takes longer than the
        swarm's rounds (the swarm is a round further each time it ends), or inner steps too slow for the others'
        round deadlines. Either way this peer spends its compute and the donors' bandwidth and adds nothing; it
        keeps trying (the swarm's rounds may get longer), but its user should know why it does not train."""
        if self.stats.rounds_participated != self._participated_at_load:
            self._loads_in_a_row, self._participated_at_load = 0, self.stats.rounds_participated
        self._loads_in_a_row += 1
        if self._loads_in_a_row % KEEP_UP_LOADS:
            return
        log.warning("cannot keep up with the swarm: %d states taken in a row (%.1f s for the last download), none "
                    "followed by a round of ours in the average: the swarm's rounds end before we can take part. "
                    "A download slower than a round needs a faster link or longer rounds (train.inner_steps); inner "
                    "steps slower than the others' need round.mode = \"swarm_target\"", self._loads_in_a_row,
                    seconds)
        self.ctx.emit(Event.CANNOT_KEEP_UP, self.ctx.state.round, states=self._loads_in_a_row,
                      download_s=round(seconds, 3))
