"""The end of every round: average this peer's pseudo-gradient with its round's group, or do what the rules say
instead (catch up, repair, wait, confirm that we are alone, step alone). :func:`rules.decide_sync` decides; this
part reads the records, carries the decision out, and keeps the adaptive deadlines (:mod:`~p2p_diloco.protocol.
deadlines`) up to date with what it observes."""

from __future__ import annotations

import logging

from ..errors import RoundFailed, SwarmError
from ..metrics.events import Event
from ..protocol import consensus, rules
from ..protocol.actions import AllReduce, CatchUp, ConfirmAlone, GiveUp, Repair, Solo, Wait
from ..protocol.deadlines import Deadlines, StragglerWait
from ..protocol.liveness import Liveness
from ..protocol.records import Phase
from ..swarm.port import AllReduceRequest, AllReduceResult
from ..protocol import commit
from ..protocol.certificate import Certificate
from .certifier import Certifier
from .chain import Chain
from .context import PeerContext, PeerStats
from .state_sync import StateSync
from .suspects import Suspects

log = logging.getLogger("p2p_diloco.peer")
REPAIR_GRACE = 2.0  # seconds a running attempt may go on after a member was found dead (at least)


class Syncer:
    """One round's sync (module docstring). ``last_group_size`` and the deadlines carry over between rounds."""

    def __init__(self, ctx: PeerContext, state_sync: StateSync, stats: PeerStats, chain: Chain):
        self.ctx, self.state_sync, self.stats, self.chain = ctx, state_sync, stats, chain
        self.deadlines = Deadlines(ctx.cfg.swarm)
        self.certifier = Certifier(ctx)
        self.last_group_size = 1  # of our last all-reduce (1: we stepped alone)
        # round-mates that failed attempts with us: left out of group sizing for a cool-down (liveness.py)
        self.liveness = Liveness(cool_down=ctx.cfg.swarm.round_timeout)
        self.suspects = Suspects(ctx.swarm.probe, ctx.clock.monotonic)  # round-mates our own probe found dead
        self.died: frozenset[str] = frozenset()  # members of the running attempt found dead (it was aborted)
        # the last attempt ended because its leader expects another group (led_matchmaking.py): we read the records
        # again at once, and the next attempt waits for its leader as before (a stale leader's followers would
        # otherwise read the records in a loop until its attempt ends)
        self.regrouped = False

    def sync(self, r: int, buffer: list, tokens: int) -> Certificate | None:
        """Average ``buffer`` (our pseudo-gradient from theta(``r``), left as it is for a retry) with the round's
        group and certify the outer step, prepared in the state (:meth:`GlobalState.prepare`). The round's complete
        certificate if the step may be committed; None if we fell behind, repaired or were stopped instead (theta is
        then whatever the state sync left; nothing half-applied)."""
        ctx = self.ctx
        sc = ctx.cfg.swarm
        wait = StragglerWait(self.deadlines, ctx.clock.monotonic())  # then round-mates still training are left out
        attempt, alone_since, self.regrouped = 0, None, False
        ctx.swarm.publish(phase=Phase.SYNC)  # our pseudo-gradient for this round is ready
        while not ctx.stop.is_set():
            view, now = ctx.view(), ctx.clock.monotonic()
            gone = self.suspects.in_round(view, r)
            me = rules.SyncState(r, ctx.state.digest, wait.deadline, alone_since=alone_since, suspects=gone,
                                 confirm_for=sc.peer_ttl + sc.heartbeat_period, overlap=ctx.cfg.outer.overlap,
                                 cooling=self.liveness.cooling(now), round_deadline=wait.started + sc.round_timeout,
                                 me=ctx.swarm.peer_id or "", head_members=self.chain.head_members(),
                                 client=sc.client_mode)
            action = rules.decide_sync(me, view, now)
            if not isinstance(action, Wait):  # a Wait waits for round-mates still training: none is left out
                self._watch_stragglers(wait, consensus.training(view, r), r, now)
            if not isinstance(action, ConfirmAlone):
                alone_since = None  # a round-mate's record showed: a confirmation starts over
            if isinstance(action, CatchUp):
                self.state_sync.catch_up()
                return None
            if isinstance(action, Repair):
                self.state_sync.repair(r, action)
                return None
            if isinstance(action, Wait):
                ctx.sleep(action.seconds)
                continue
            if isinstance(action, ConfirmAlone):
                if alone_since is None:
                    alone_since = now
                    ctx.status(f"round {r + 1}: {action.reason}")
                ctx.sleep(sc.heartbeat_period)
                continue
            if isinstance(action, GiveUp):
                raise SwarmError(f"round {r + 1}: {action.reason}")
            if isinstance(action, Solo):
                return self._solo(r, buffer, tokens, action)
            attempt += 1
            _log_attempt(r, attempt, action, view, ctx.clock.time())
            certificate = self._all_reduce(r, buffer, tokens, action, attempt)
            if certificate is not None:
                self.liveness.succeeded(action.members or (), ctx.clock.monotonic())
                wait.averaged(ctx.clock.monotonic())
                return certificate
            # an attempt a member's death aborted is nobody's failure: the dead are left out as suspects, and a
            # restarted one must not find itself cooling down
            charged = () if self.died or self.regrouped else action.charged
            cooled = [] if ctx.stop.is_set() else self.liveness.failed(charged, ctx.clock.monotonic())
            if cooled:
                log.warning("round %d: %s failed %d attempts in a row with us: left out of our groups for a "
                            "cool-down", r + 1, ", ".join(cooled), self.liveness.peers[cooled[0]].streak)
        return None

    def _solo(self, r: int, buffer: list, tokens: int, action: Solo) -> Certificate | None:
        """We are the whole swarm: our pseudo-gradient is the average, and we alone sign its certificate."""
        ctx = self.ctx
        log.info("round %d: %s; applying our own pseudo-gradient", r + 1, action.reason)
        ctx.emit_in_round(Event.ALLREDUCE_DONE, r, group_size=1, bytes_sent=0, bytes_received=0, seconds=0.0,
                          lone=True)
        self.last_group_size = 1
        mine = {ctx.swarm.peer_id: {"round": r, "digest": ctx.state.digest, "tokens": tokens,
                                    "head": ctx.state.chain_head}}
        return self._certify(r, ctx.state.prepare(buffer), mine, ctx.clock.monotonic())

    def _certify(self, r: int, after: str, gathered: dict, got_result_at: float) -> Certificate | None:
        """Certify the outer step prepared in the state (its digest ``after``); on failure nothing is applied."""
        statement = self.certifier.statement(r, after, gathered)
        certificate = self.certifier.certify(r, statement, got_result_at)
        if certificate is None:
            self.ctx.state.discard()
        return certificate

    def _watch_stragglers(self, wait: StragglerWait, late: list[str], r: int, now: float) -> None:
        """Feed the straggler deadline what we see (arrival offsets), and say when round-mates are left out."""
        if wait.observe(late, now):
            waited = now - wait.started
            log.warning("round %d: leaving out %d round-mate(s) still training after %.1f s", r + 1, len(late), waited)
            self.ctx.emit_in_round(Event.STRAGGLERS_DROPPED, r, peers=late, waited_s=round(waited, 2))

    def _all_reduce(self, r: int, buffer: list, tokens: int, action: AllReduce, attempt: int
                    ) -> Certificate | None:
        """One all-reduce attempt with the group ``action`` names. Matchmaking that expects a round-mate still
        training ends at the straggler deadline (or after the matchmaking window, if that is later) by hivemind's
        own step timeout. Cancelling the step instead is worse: a step cancelled just as a round-mate's retry took
        it into a smaller group leaves that round-mate waiting for our parts (measured: 10 s and a lost round)."""
        ctx = self.ctx
        ctx.swarm.publish(phase=Phase.SYNC)
        ctx.emit_in_round(Event.ALLREDUCE_START, r, expected_group_size=action.group_size, attempt=attempt,
                 **self.deadlines.snapshot())
        ctx.status(f"round {r + 1} all-reduce: matchmaking with {action.group_size} peers (attempt {attempt})")
        running = []

        def on_running() -> None:
            running.append(True)
            ctx.emit_in_round(Event.ALLREDUCE_RUNNING, r, attempt=attempt)

        look = None if action.give_up_at is None else max(0.5, action.give_up_at - ctx.clock.monotonic())
        self.died, found = frozenset(), [0.0]
        # mid-transfer the data plane re-reduces a dead member's slice (swarm/slice_repair.py), 1/N of the transfer:
        # a suspect aborts a running attempt only once that had time to end
        grace = max(REPAIR_GRACE, self.deadlines.get("allreduce") / max(action.group_size, 1))

        def should_stop() -> bool:  # polled every 0.1 s; probes at most every suspects.INTERVAL
            if not self.died:
                self.died, found[0] = self.suspects.of(action.members or ()), ctx.clock.monotonic()
            if ctx.stop.is_set() or not self.died:
                return ctx.stop.is_set()
            return not running or ctx.clock.monotonic() - found[0] > grace

        request = AllReduceRequest(
            round=r, tensors=buffer, weight=tokens, group_size=action.group_size,
            gather={"round": r, "digest": ctx.state.digest, "tokens": tokens, "head": ctx.state.chain_head},
            should_stop=should_stop, on_running=on_running, matchmaking_time=self.deadlines.get("matchmaking"),
            allreduce_timeout=self.deadlines.get("allreduce"), matchmaking_timeout=look, members=action.members or (),
            leader=action.leader, regroup=not self.regrouped)
        self.regrouped = False
        try:
            result = ctx.state.average(ctx.swarm, request)
        except RoundFailed as e:
            self._failed(r, e, attempt, bool(running), action.all_in)
            return None
        got_result_at = ctx.clock.monotonic()
        self._done(r, result, action.all_in)
        # the members that died mid-transfer (their slices re-reduced by the survivors) are out of the group
        expected = None if action.members is None else [m for m in action.members if m not in result.lost]
        problem = commit.group_problem(r, ctx.state.digest, ctx.swarm.peer_id or "", expected,
                                       action.group_size - len(result.lost), result.gathered)
        problem = problem or self.chain.extension_problem(list(result.gathered))
        if problem:  # we do not sign: no certificate of this group can exist, and nobody applies its step
            log.error("round %d: refusing the group: %s", r + 1, problem)
            ctx.emit_in_round(Event.ALLREDUCE_FAILED, r, reason=f"refused the group: {problem}", attempt=attempt,
                              bytes_sent=result.bytes_sent, bytes_received=result.bytes_received)
            return None
        return self._certify(r, ctx.state.prepare_averaged(ctx.swarm), result.gathered, got_result_at)

    def _failed(self, r: int, e: RoundFailed, attempt: int, running: bool, all_in: bool) -> None:
        """Account for a failed attempt: its event, and the deadline it proved too short, if any."""
        ctx = self.ctx
        reason = f"{', '.join(sorted(self.died))} died (our probe was refused)" if self.died else str(e)
        ctx.emit_in_round(Event.ALLREDUCE_FAILED, r, reason=reason, attempt=attempt, bytes_sent=e.bytes_sent,
                          bytes_received=e.bytes_received)
        self.regrouped = e.regroup and not self.died
        if self.regrouped:  # our view or the leader's is out of date: nobody's failure, no deadline was short
            log.info("round %d: %s; reading the records again", r + 1, e)
        elif running:
            self.deadlines.allreduce.backoff()
        elif all_in and not ctx.stop.is_set():
            self.deadlines.matchmaking.backoff()

    def _done(self, r: int, result: AllReduceResult, all_in: bool) -> None:
        """Account for a successful all-reduce: deadlines, bytes, the group's digests, left-out contributions."""
        ctx = self.ctx
        if all_in:  # otherwise assembling included waiting for round-mates' inner steps
            self.deadlines.matchmaking.observe(result.assembly_seconds)
        self.deadlines.allreduce.observe(result.seconds - result.assembly_seconds)
        self.stats.bytes_sent += result.bytes_sent
        self.stats.bytes_received += result.bytes_received
        self.last_group_size = result.group_size
        ctx.swarm.update(last_sync=round(ctx.clock.time(), 1))  # for `p2p-diloco status`
        theirs = rules.group_mismatch(r, ctx.state.digest, result.gathered)
        if theirs is not None:
            log.error("round %d: group members started from different global weights: %s", r + 1, theirs)
            ctx.emit_in_round(Event.DIGEST_MISMATCH, r, ours=ctx.state.digest, theirs=theirs)
        for pid, reason in sorted(result.excluded.items()):  # our reducers left a bad contribution out
            log.warning("round %d: left out the contribution of peer %s: %s", r + 1, pid, reason)
            ctx.emit_in_round(Event.CONTRIBUTION_EXCLUDED, r, peer=pid, reason=reason)
        repaired = {"lost": list(result.lost), "resent_bytes": result.resent} if result.lost else {}
        if result.lost:
            log.warning("round %d: %s died mid-transfer; its slice was re-reduced among the %d survivors (%d bytes "
                        "resent)", r + 1, ", ".join(result.lost), result.group_size, result.resent)
        ctx.emit_in_round(Event.ALLREDUCE_DONE, r, group_size=result.group_size, bytes_sent=result.bytes_sent,
                          bytes_received=result.bytes_received, seconds=round(result.seconds, 3), **repaired)


def _log_attempt(r: int, attempt: int, action: AllReduce, view: dict, now: float) -> None:
    """Which group an attempt expects, and the view it was chosen from (how many records, in which round and
    phase, how old): when the members' views disagree, the peers' logs side by side show how."""
    phases: dict[str, int] = {}
    for p in view.values():
        key = f"r{p.round}:{p.phase}" if p.phase else f"r{p.round}"
        phases[key] = phases.get(key, 0) + 1
    ages = [now - p.t for p in view.values() if p.t is not None]
    log.info("round %d attempt %d: group %s, led by %s (%s); view: %d records (%s), %.1f-%.1f s old", r + 1,
             attempt, " ".join(sorted(m[-6:] for m in action.members or ())), (action.leader or "-")[-6:],
             action.reason, len(view), " ".join(f"{k}={v}" for k, v in sorted(phases.items())),
             min(ages, default=0.0), max(ages, default=0.0))
