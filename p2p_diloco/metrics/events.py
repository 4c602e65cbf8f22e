"""The catalogue of a peer's events: every name it writes to ``events.jsonl``, with its fields.

Events are the observable contract of a peer: ``p2p-diloco swarm``, the tests, the benchmarks and anyone's
dashboards read them. Every line has ``t`` (unix time), ``event`` and ``round``, plus the fields below. ``round`` is
the round the event belongs to: an event during round k (which starts from theta(k-1) and produces theta(k)), or
about theta(k) (``outer_step``, ``eval``, ``state_loaded``, ``checkpoint_saved``, ``resumed``), says k.

The README's event list is rendered from :data:`CATALOGUE` (``python -m p2p_diloco.metrics.events``), and a test
checks that it is up to date.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import StrEnum


class Event(StrEnum):
    ROUND_START = "round_start"
    INNER_PROGRESS = "inner_progress"
    INNER_DONE = "inner_done"
    ALLREDUCE_START = "allreduce_start"
    ALLREDUCE_RUNNING = "allreduce_running"
    ALLREDUCE_DONE = "allreduce_done"
    ALLREDUCE_FAILED = "allreduce_failed"
    STRAGGLERS_DROPPED = "stragglers_dropped"
    CONTRIBUTION_EXCLUDED = "contribution_excluded"
    DIGEST_MISMATCH = "digest_mismatch"
    COMMIT_FAILED = "commit_failed"
    OUTER_STEP = "outer_step"
    EVAL = "eval"
    STATE_DOWNLOAD_START = "state_download_start"
    STATE_DOWNLOAD_FAILED = "state_download_failed"
    STATE_LOADED = "state_loaded"
    CANNOT_KEEP_UP = "cannot_keep_up"
    DESYNC_DETECTED = "desync_detected"
    CHECKPOINT_SAVED = "checkpoint_saved"
    RESUMED = "resumed"


@dataclass(frozen=True)
class Spec:
    doc: str
    fields: tuple[str, ...] = ()  # always present
    optional: tuple[str, ...] = ()  # present in some events of the kind


CATALOGUE: dict[Event, Spec] = {
    Event.ROUND_START: Spec("a round's inner steps begin (from θ with `digest`)", ("digest",)),
    Event.INNER_PROGRESS: Spec("every 10 inner steps and at the last; `global_step`: the run's position in inner "
                               "steps, (round − 1) × H + `inner_step` (with `round.mode=swarm_target`, the step of the "
                               "lr schedule, which follows the swarm's progress): the same on every peer and after "
                               "`--resume`; `tokens_per_s`: this peer's speed in the round so far; `mfu`: as in "
                               "`inner_done`", ("inner_step", "loss", "global_step", "tokens_per_s"), ("mfu",)),
    Event.INNER_DONE: Spec("the end of a round's inner training; `tokens_per_s`: over the round; `mfu` (0..1, only "
                           "when the device's peak is known: a listed GPU or `train.peak_tflops`): model FLOPs "
                           "utilisation, training/throughput.py", ("inner_steps", "tokens", "seconds",
                                                                    "tokens_per_s"), ("mfu",)),
    Event.ALLREDUCE_START: Spec("an all-reduce attempt begins, with the deadlines in force",
                                ("expected_group_size", "attempt", "straggler_s", "allreduce_s", "matchmaking_s")),
    Event.ALLREDUCE_RUNNING: Spec("the group is assembled, tensors are flowing", ("attempt",)),
    Event.ALLREDUCE_DONE: Spec("the average is here (`lone`: a solo step, nobody else was live; `lost`: members "
                               "that died mid-transfer, their slice re-reduced by the survivors, moving "
                               "`resent_bytes` more)",
                               ("group_size", "bytes_sent", "bytes_received", "seconds"),
                               ("lone", "lost", "resent_bytes")),
    Event.ALLREDUCE_FAILED: Spec("the attempt failed; nothing was applied (`bytes_sent`, `bytes_received`: what it "
                                 "moved before it failed, thrown away)", ("reason", "attempt"),
                                 ("bytes_sent", "bytes_received")),
    Event.STRAGGLERS_DROPPED: Spec("round-mates still training were left out after the straggler deadline",
                                   ("peers", "waited_s")),
    Event.CONTRIBUTION_EXCLUDED: Spec("our reducer left that peer's pseudo-gradient out of the round",
                                      ("peer", "reason")),
    Event.DIGEST_MISMATCH: Spec("a group member started the round from other global weights", ("ours", "theirs")),
    Event.COMMIT_FAILED: Spec("the round's certificate was not complete in the commit window; nothing was applied",
                              ("reason", "members")),
    Event.OUTER_STEP: Spec("θ(round) is committed (`inner_steps`: ours in it; `certificate`: the id of the round "
                           "certificate, signed by all `signers`)", ("digest", "inner_steps", "certificate",
                                                                       "signers")),
    Event.EVAL: Spec("eval loss of θ(round) on the shared held-out split", ("loss",)),
    Event.STATE_DOWNLOAD_START: Spec("downloading the swarm's state from a donor", ("from_peer",)),
    Event.STATE_DOWNLOAD_FAILED: Spec("that donor's state did not arrive or did not check out",
                                      ("from_peer", "reason")),
    Event.STATE_LOADED: Spec("θ(round) and its momentum taken from a donor", ("from_peer", "digest")),
    Event.CANNOT_KEEP_UP: Spec("`states` taken from donors in a row (every 3rd) and none of our rounds averaged in "
                               "between: the swarm's rounds end before we can take part (`download_s`: the last "
                               "download's seconds; a warning says what to do)", ("states", "download_s")),
    Event.DESYNC_DETECTED: Spec("our θ is not the majority's: repairing", ("ours", "majority")),
    Event.CHECKPOINT_SAVED: Spec("a round-boundary checkpoint is on disk", ("path", "digest")),
    Event.RESUMED: Spec("continued from a checkpoint", ("digest", "path")),
}


def check(name: str, fields: dict) -> str | None:
    """Why an event with these fields breaks the catalogue, or None."""
    try:
        spec = CATALOGUE[Event(name)]
    except ValueError:
        return f"unknown event {name!r}"
    missing = set(spec.fields) - set(fields)
    extra = set(fields) - set(spec.fields) - set(spec.optional)
    if missing or extra:
        return f"event {name}: missing {sorted(missing)}, unexpected {sorted(extra)}"
    return None


def render() -> str:
    """The README's event list (one line per event, Markdown)."""
    lines = ["One JSON object per line with `t` (unix time), `event` and `round` (the round the event belongs to: "
             "the events of round k, which starts from θ(k−1), and those about θ(k) say k), and:", ""]
    for event, spec in CATALOGUE.items():
        names = [f"`{f}`" for f in spec.fields] + [f"`{f}` (optional)" for f in spec.optional]
        lines.append(f"- `{event}`: {spec.doc}" + (f"; {', '.join(names)}" if names else ""))
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render() + "\n")
