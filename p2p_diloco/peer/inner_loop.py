"""A round's inner steps, as many as ``round.mode`` says: H of them, or until the swarm's combined progress reaches
the round's target (:mod:`p2p_diloco.protocol.progress`)."""

from __future__ import annotations

from ..metrics.events import Event
from ..protocol import progress
from ..protocol.records import PeerRecord
from .context import PeerContext, PeerStats

PROGRESS_EVERY = 10  # inner steps between inner_progress events (fault benchmarks count lost work with them)


class InnerLoop:
    """Runs the inner steps of a round on the peer's training part and publishes its progress.

    Args:
        ctx: the peer's shared context.
        training: the local model and its trainer (:class:`~p2p_diloco.training.part.Training`).
        stats: the peer's counters (tokens and inner steps are added here).
    """

    def __init__(self, ctx: PeerContext, training, stats: PeerStats):
        self.ctx, self.training, self.stats = ctx, training, stats
        self.tokens_per_s = 0.0  # our speed in the last round (swarm_target progress records)
        self.stepped = False  # an inner step since the last round boundary (then the state is no checkpoint point)

    def train(self, r: int) -> tuple[int, int]:
        """The inner steps of the round that starts from theta(``r``). Returns (tokens trained, inner steps)."""
        cfg, clock, stop = self.ctx.cfg, self.ctx.clock, self.ctx.stop
        H, tokens, k, t0 = cfg.train.inner_steps, 0, 0, clock.monotonic()
        by_target = cfg.round.mode == "swarm_target"
        step_tokens = self.training.tokens_per_step
        view: dict[str, PeerRecord] = {}
        schedule_step, next_read = r * H, t0  # schedule_step: the swarm's position in the lr schedule
        while not stop.is_set():
            if not by_target and k >= H:
                break
            if by_target:
                if clock.monotonic() >= next_read:  # publish ours, read theirs; extrapolate them in between
                    view = self._exchange_progress(tokens, step_tokens, clock.monotonic() - t0)
                    next_read = clock.monotonic() + cfg.round.progress_period
                done = progress.swarm_progress(r, tokens, step_tokens, view, H, cfg.round.target_tokens,
                                               now=clock.time())
                if done.reached and k > 0:  # at least one step: a zero-token pseudo-gradient has no weight
                    break
                # the lr schedule follows the swarm's progress through the round, so fast and slow peers agree
                schedule_step = r * H + min(H - 1, int(H * done.fraction))
            k += 1
            self.stepped = True
            step = schedule_step if by_target else r * H + k - 1  # the lr schedule's step (0-based)
            loss, n = self.training.step(step)
            tokens += n
            self._progress(r, k, loss, tokens, clock.monotonic() - t0, by_target, global_step=step + 1)
            if cfg.debug.step_delay:
                clock.wait(stop, cfg.debug.step_delay)  # tests and benchmarks only: a slow peer
        self.stats.tokens_trained += tokens
        self.stats.inner_steps += k
        seconds = clock.monotonic() - t0
        rate = tokens / seconds if seconds > 0 else 0.0
        self.ctx.emit_in_round(Event.INNER_DONE, r, inner_steps=k, tokens=tokens, seconds=round(seconds, 3),
                               tokens_per_s=round(rate, 1), **self._mfu(rate))
        return tokens, k

    def _mfu(self, tokens_per_s: float) -> dict[str, float]:
        """``{"mfu": x}`` (0..1, 4 decimals) when the device's peak is known, else nothing."""
        value = self.training.mfu(tokens_per_s)
        return {} if value is None else {"mfu": round(value, 4)}

    def _progress(self, r: int, k: int, loss: float, tokens: int, elapsed: float, by_target: bool,
                  global_step: int) -> None:
        """Publish inner step ``k`` of the round that starts from theta(``r``): the live record, every
        :data:`PROGRESS_EVERY` steps an event, and the status line. ``global_step`` is the run's position (the lr
        schedule's step + 1), derived from the round and step alone so that it goes on where it was after a
        ``--resume`` (TensorBoard's x axis)."""
        H = self.ctx.cfg.train.inner_steps
        rate = tokens / max(elapsed, 1e-9)
        self.ctx.swarm.update(inner_step=k, tokens=self.stats.tokens_trained + tokens, round_tokens=tokens,
                              **({} if by_target else {"tokens_per_s": round(rate, 1)}))  # (else: progress records)
        mfu = self._mfu(rate)
        if k % PROGRESS_EVERY == 0 or k == H:
            self.ctx.emit_in_round(Event.INNER_PROGRESS, r, inner_step=k, loss=round(loss, 4),
                                   global_step=global_step, tokens_per_s=round(rate, 1), **mfu)
        # "round k" is the round being trained (the one that produces theta(k)), as in events.jsonl and `status`
        shown = f"  MFU {100 * mfu['mfu']:.1f} %" if mfu else ""
        self.ctx.status(f"round {r + 1}  inner step {k}{'' if by_target else f'/{H}'}  loss {loss:.3f}  "
                        f"{rate:,.0f} tok/s{shown}")

    def _exchange_progress(self, tokens: int, step_tokens: int, elapsed: float) -> dict[str, PeerRecord]:
        """Publish our progress in the round (``swarm_target``) and return the other peers' records."""
        rate = tokens / elapsed if tokens and elapsed > 0 else self.tokens_per_s
        self.tokens_per_s = rate
        self.ctx.swarm.publish(round_tokens=tokens, step_tokens=step_tokens, tokens_per_s=round(rate, 1))
        return self.ctx.view()
