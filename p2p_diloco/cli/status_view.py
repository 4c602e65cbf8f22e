"""What ``p2p-diloco status`` shows: the swarm as the peers' signed live records describe it. Pure functions over
``{peer_id: PeerRecord}`` (read by :meth:`p2p_diloco.swarm.status.StatusClient.read_live_records`); no network
here.

Rounds are shown as the peers show them (their log, their status line, ``events.jsonl``, ``swarm``'s rows): "round
k" is the k-th round, the one that produces θ(k). A record says which θ the peer holds (θ(k−1) while it works on
round k); :func:`shown_round` turns one into the other.
"""

from __future__ import annotations

import time
from typing import Any

from ..metrics import short_id
from ..protocol import consensus
from ..protocol.records import Phase, PeerRecord


def swarm_view(run_id: str, records: dict[str, PeerRecord], now: float | None = None) -> dict[str, Any]:
    """``{"run_id", "swarm_round", "peers": [...], "all_digests_agree"}``; one entry per live peer.

    A peer's digest "agrees" if it is the majority digest among the synced peers of its own round (the rule the
    peers themselves use to repair, :func:`consensus.majority_digest`); ``None`` if that cannot be judged (the
    peer is still joining or repairing).
    """
    now = time.time() if now is None else now
    live = {pid: r for pid, r in records.items() if r.phase != Phase.LEFT}
    peers = [_row(pid, r, live, now) for pid, r in sorted(live.items(), key=lambda kv: (-max(kv[1].round, 0), kv[0]))]
    return {"run_id": run_id, "swarm_round": _swarm_round(live), "peers": peers,
            "all_digests_agree": all(p["digest_agrees"] is not False for p in peers)}


def shown_round(held: int, phase: Phase | None) -> int | None:
    """The round a peer is in, as people read it, from the θ index its record holds: it works on round
    ``held + 1`` (joins, trains, averages, repairs it); once done, it shows the last round it completed.

    Args:
        held: the record's ``round`` (θ index; -1 if the record does not say).
        phase: the record's phase.

    Returns:
        The round number, or None if the record does not say.
    """
    if held < 0:
        return None
    return held if phase == Phase.DONE else held + 1


def _swarm_round(live: dict[str, PeerRecord]) -> int | None:
    """The swarm's round as people read it: the one after the θ the swarm holds (:func:`consensus.swarm_round`),
    or that θ's round if every synced peer holding it is done."""
    held = consensus.swarm_round(live) if live else -1
    if held < 0:
        return None
    done = all(r.phase == Phase.DONE for r in consensus.synced(live, held).values())
    return shown_round(held, Phase.DONE if done else Phase.TRAIN)


def _row(pid: str, r: PeerRecord, live: dict[str, PeerRecord], now: float) -> dict[str, Any]:
    majority = consensus.majority_digest(p.digest for p in consensus.synced(live, r.round).values())
    return {
        "peer_id": pid,
        "round": shown_round(r.round, r.phase),
        "rounds_completed": r.round if r.round >= 0 else None,
        "phase": str(r.phase) if r.phase is not None else None,
        "inner_step": r.inner_step,
        "tokens_per_s": r.tokens_per_s,
        "eval_loss": r.eval_loss,
        "last_sync": r.last_sync,
        "last_sync_ago_s": round(now - r.last_sync, 1) if r.last_sync is not None else None,
        "client_mode": r.client,
        "digest": r.digest or None,
        "digest_agrees": (r.digest == majority) if r.synced and majority else None,
        "record_age_s": round(now - r.t, 1) if r.t is not None else None,
    }


def format_view(view: dict[str, Any]) -> str:
    """A fixed-width table of :func:`swarm_view`, one row per peer."""
    def f(value, spec="", missing="-"):
        return missing if value is None else format(value, spec)

    agree = {True: "yes", False: "NO", None: "-"}
    lines = [f"run {view['run_id']}: {len(view['peers'])} live peer(s), swarm round {f(view['swarm_round'])}",
             f"{'peer':<10} {'round':>5} {'phase':<6} {'step':>6} {'tok/s':>9} {'eval loss':>9} "
             f"{'last sync':>9} {'client':<6} {'digest':<12} {'agrees':<6}"]
    for p in view["peers"]:
        ago = f"{p['last_sync_ago_s']:.0f}s ago" if p["last_sync_ago_s"] is not None else "-"
        lines.append(
            f"{short_id(p['peer_id']):<10} {f(p['round']):>5} {f(p['phase']):<6} {f(p['inner_step']):>6} "
            f"{f(p['tokens_per_s'], ',.0f'):>9} {f(p['eval_loss'], '.4f'):>9} {ago:>9} "
            f"{'yes' if p['client_mode'] else 'no':<6} {(p['digest'] or '-')[:12]:<12} {agree[p['digest_agrees']]:<6}")
    if not view["peers"]:
        lines.append("(no live peer of this run: check --run-id and --initial-peers)")
    return "\n".join(lines)
