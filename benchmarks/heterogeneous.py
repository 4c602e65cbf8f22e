"""Peers of different speeds: ``round.mode = fixed_steps`` against ``swarm_target``, through the real swarm.

N peers (``p2p-diloco swarm``), the last ``--slow`` of them slowed with ``--debug-step-delay`` (an artificial sleep
per inner step). Every mode is given the same token budget: R rounds of H steps of every peer's batch (under
``swarm_target`` a round's target is exactly that many tokens, spread over the peers by speed; under
``fixed_steps_no_wait`` the slow peer's tokens are trained but dropped).

Modes: ``fixed_steps`` (everyone waits for the slowest), ``fixed_steps_no_wait`` (fast peers wait at most 2 s for
a straggler, so the slow peer misses rounds: its work is dropped and it downloads the swarm's state, the
missed-round policy) and ``swarm_target``.

Per mode it reports:
- wall time: from the first ``round_start`` to the last ``outer_step`` of any peer;
- idle fraction per peer: the time from the end of its inner steps (``inner_done``) to the end of its all-reduce
  (``allreduce_done``), summed over rounds, over that wall time. It counts waiting for other peers plus the
  matchmaking and transfer themselves (tiny here), so it is an upper bound on the time lost to waiting;
- tokens trained per peer and the final eval loss of the global weights.

Last line: ``idle_fraction_swarm_target=<the largest idle fraction of any peer under swarm_target>``.

Usage: ``python -m benchmarks.heterogeneous --quick`` (3 peers, one slowed by 0.2 s a step, H = 50, 6 rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_swarm
from p2p_diloco.metrics import read_events
from p2p_diloco.metrics.events import Event


# name -> --set items. "fixed_steps_no_wait" is fixed_steps where the fast peers wait about 2 s for a straggler
# (in matchmaking, then between attempts): the slow peer then misses rounds, and the missed-round policy (drop the
# work, download the swarm's state) applies.
MODES = {"fixed_steps": ["round.mode=fixed_steps"],
         "fixed_steps_no_wait": ["round.mode=fixed_steps", "swarm.round_timeout=2", "swarm.matchmaking_time=2",
                                 "swarm.request_timeout=1"],
         "swarm_target": ["round.mode=swarm_target"]}


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict:
    """One ``p2p-diloco swarm`` run; returns the per-peer figures."""
    delays = [0.0] * (args.peers - args.slow) + [args.delay] * args.slow
    log_dir, summary = out / mode, out / f"{mode}.json"
    cmd = ["--peers", str(args.peers), "--max-rounds", str(args.rounds), "--inner-steps", str(args.h),
           "--run-id", f"hetero-{mode.replace('_', '-')}-{int(time.time())}", "--data-seed", "1",
           "--log-dir", str(log_dir), "--summary-json", str(summary),
           "--set", f"train.total_steps={args.rounds * args.h}", "--debug-step-delay", *map(str, delays)]
    for item in MODES[mode]:
        cmd += ["--set", item]
    rc = run_swarm(cmd, out / f"{mode}.log", timeout=3600)
    if rc != 0 or not summary.exists():
        raise SystemExit(f"{mode}: swarm failed (exit {rc}); see {out / f'{mode}.log'}")
    result = json.loads(summary.read_text())
    peers = []
    for index, peer in enumerate(result["peers"]):
        events = read_events(log_dir / peer["peer_id"] / "events.jsonl")
        peers.append({"index": index, "delay": delays[index], "tokens": peer["tokens_trained"],
                      "rounds_participated": peer["rounds_participated"],
                      "eval_loss": peer["eval_loss_last"], "events": events})
    starts = [e["t"] for p in peers for e in p["events"] if e["event"] == Event.ROUND_START]
    ends = [e["t"] for p in peers for e in p["events"] if e["event"] == Event.OUTER_STEP]
    wall = max(ends) - min(starts)
    for p in peers:
        done = {e["round"]: e["t"] for e in p["events"] if e["event"] == Event.INNER_DONE}
        waits = [e["t"] - done[e["round"]] for e in p["events"]
                 if e["event"] == Event.ALLREDUCE_DONE and e["round"] in done]
        p["idle_fraction"] = sum(waits) / wall
        p["steps"] = [e["inner_steps"] for e in p["events"] if e["event"] == Event.INNER_DONE]
        del p["events"]
    return {"mode": mode, "wall_s": wall, "digests_equal": result["all_digests_equal"], "peers": peers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 peers, 1 slowed by 0.2 s/step, H = 50, 6 rounds")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--slow", type=int, default=1, help="how many peers are slowed")
    ap.add_argument("--delay", type=float, default=0.2, help="seconds slept per inner step by a slow peer")
    ap.add_argument("--h", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=None, help="default 12, 6 with --quick")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    args.rounds = args.rounds or (6 if args.quick else 12)
    if not 0 < args.slow < args.peers:
        ap.error("--slow must be between 1 and --peers - 1")
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="p2p-diloco-hetero-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.peers} peers, {args.slow} slowed by {args.delay} s/step; H = {args.h}, {args.rounds} rounds; "
          f"logs in {out}", flush=True)
    results = [run_mode(mode, args, out) for mode in args.modes]
    print(f"\n{'mode':<20} {'wall s':>7} {'eval loss':>9}  per peer: delay s/step, tokens, idle fraction, steps/round, "
          "rounds in the all-reduce")
    for r in results:
        print(f"{r['mode']:<20} {r['wall_s']:>7.1f} {r['peers'][0]['eval_loss']:>9.4f}  digests equal: "
              f"{r['digests_equal']}")
        for p in r["peers"]:
            print(f"    peer {p['index']}: {p['delay']:.2f}  {p['tokens']:>9,}  {p['idle_fraction']:.3f}  "
                  f"{p['steps']}  "
                  f"{p['rounds_participated']}")
    target = next((r for r in results if r["mode"] == "swarm_target"), None)
    if target is None:
        return 0
    print(f"idle_fraction_swarm_target={max(p['idle_fraction'] for p in target['peers']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
