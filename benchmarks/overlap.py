"""Overlap that costs nothing? Blocking, eager and streaming rounds on a 100 Mbit/s link: eval loss and utilisation.

The link, the model and the peers are ``benchmarks/utilization.py``'s: two network namespaces joined by a veth pair
capped with ``tc ... tbf`` (``--rate``), one ``p2p-diloco join`` peer in each (one torch thread), a ~3.3M-parameter
Llama whose fp32 pseudo-gradient is 13 MB (about 1 s each way at 100 Mbit/s). Every arm trains the same
T = ``--rounds`` x ``--inner-steps`` (H) inner steps per peer from the same theta(0), with data orders 1 and 2:

- ``blocking``: R rounds of H, the default round (the sync idles both peers);
- ``eager``: ``outer.overlap = true`` (the sync of round r runs behind round r+1; the next round starts from the
  look-ahead of our own pseudo-gradient: peer/overlap.py);
- ``streaming-f<F>``: Streaming DiLoCo (https://arxiv.org/abs/2501.18512): ``outer.overlap = true`` and
  ``outer.fragments = F``, R x F rounds of H / F steps, so each fragment is synced every H steps and the bytes per
  inner step are blocking's; each fragment's sync runs behind the next H / F steps and lands merged with
  ``outer.fragment_alpha`` (peer/streaming.py), with the outer step ``--streaming-outer`` (default 0.7:0.9, chosen in
  the simulator on data seed 11: docs/performance.md).

Printed per arm: eval loss of theta after the last round (the peers' summaries, 8 eval batches) and over
blocking's, utilisation (inner time / wall, utilization.py's definition: the window ends with the last sync,
which nothing can hide), steady utilisation (whole rounds only), sync seconds per sync, MB received per peer per
H inner steps, and whether both peers ended with one digest. Last line: ``overlap_loss_over_blocking=<y>
utilization=<u>`` for the overlapped arm with the lowest loss (named on the line before); goals y <= 1.01 and
u >= 0.95.

Usage (root): ``sudo .venv/bin/python -m benchmarks.overlap [--quick]``; ``--quick`` is R = 8 rounds of H = 20 and
streaming at F = 2 and 4 (its arms took 254 s on 2 cores), the full run R = 16 (439 s). ``--arms`` picks a subset.
Namespaces and processes are removed on any exit, as in utilization.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import utilization as util

DATA_SEED = 1  # peer i reads data order DATA_SEED + i, in every arm
LOSS_GOAL, UTILIZATION_GOAL = 1.01, 0.95


def arms_of(fragments: list[int], streaming_outer: tuple[float, float]) -> list[tuple[str, int, list[str]]]:
    """(name, F, extra --set items) of every arm, blocking first."""
    lr, momentum = streaming_outer
    arms = [("blocking", 1, []), ("eager", 1, ["outer.overlap=true"])]
    for f in fragments:
        arms.append((f"streaming-f{f}", f, ["outer.overlap=true", f"outer.fragments={f}", f"outer.lr={lr}",
                                            f"outer.momentum={momentum}"]))
    return arms


def run_arm(net: util.Net, args: argparse.Namespace, name: str, fragments: int, sets: list[str], root: Path) -> dict:
    """One arm: both peers to the end, then its figures (or ``{"error": ...}``)."""
    row: dict = {"arm": name, "fragments": fragments}
    log_dir = root / name
    log_dir.mkdir(parents=True)
    arm_args = argparse.Namespace(rounds=args.rounds * fragments, inner_steps=args.inner_steps // fragments,
                                  data_seed=DATA_SEED)
    flags = [a for s in [*sets, "eval.batches=8"] for a in ("--set", s)]
    t = time.monotonic()
    try:
        peers = util.run_peers(net, arm_args, flags, log_dir)
        figs = [util.peer_figures(p.events(log_dir), arm_args.inner_steps) for p in peers]
        summaries = [json.loads((log_dir / f"peer{i}.json").read_text()) for i in range(len(peers))]
    except Exception as e:  # a failed arm is reported, the others still run
        return {**row, "error": str(e) if isinstance(e, RuntimeError) else repr(e), "log_dir": str(log_dir)}
    steady = [f["steady_utilization"] for f in figs if f["steady_utilization"] is not None]
    return {**row, "loss": statistics.mean(s["eval_loss_last"] for s in summaries),
            "one_digest": len({s["global_digest"] for s in summaries}) == 1,
            "utilization": statistics.mean(f["utilization"] for f in figs),
            "steady_utilization": statistics.mean(steady) if steady else None,
            "solo_steps": sum(f["lone_steps"] for f in figs),
            "sync_s_per_sync": statistics.mean(f["sync_s"] / max(f["syncs"], 1) for f in figs),
            "mb_per_h_steps": statistics.mean(f["bytes_received"] for f in figs) / args.rounds / 1e6,
            "rounds": max(f["rounds"] for f in figs), "peers": figs, "row_wall_s": time.monotonic() - t,
            "log_dir": str(log_dir)}


HEADER = (f"{'arm':<13} {'loss':>7} {'/block':>7} {'util':>6} {'steady':>6} {'sync s':>7} {'MB/H':>6} "
          f"{'rounds':>6} {'digest':>6} {'run s':>6}")


def format_row(r: dict, blocking: float | None) -> str:
    if "error" in r:
        return f"{r['arm']:<13} FAILED: {r['error']}"
    ratio = f"{r['loss'] / blocking:.4f}" if blocking else "-"
    steady = f"{r['steady_utilization']:.3f}" if r["steady_utilization"] is not None else "-"
    solo = f"  ({r['solo_steps']} solo steps!)" if r["solo_steps"] else ""
    return (f"{r['arm']:<13} {r['loss']:>7.4f} {ratio:>7} {r['utilization']:>6.3f} {steady:>6} "
            f"{r['sync_s_per_sync']:>7.2f} {r['mb_per_h_steps']:>6.2f} {r['rounds']:>6} "
            f"{'one' if r['one_digest'] else 'SPLIT':>6} {r['row_wall_s']:>6.0f}{solo}")


def verdict(rows: list[dict]) -> tuple[float, float, str]:
    """(loss over blocking, utilisation, arm) of the overlapped arm with the lowest loss; nan if none ran."""
    ok = {r["arm"]: r for r in rows if "error" not in r}
    overlapped = [r for r in ok.values() if r["arm"] != "blocking"]
    if "blocking" not in ok or not overlapped:
        return float("nan"), float("nan"), "-"
    best = min(overlapped, key=lambda r: r["loss"])
    return best["loss"] / ok["blocking"]["loss"], best["utilization"], best["arm"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 rounds of H (the full run: 16)")
    ap.add_argument("--rounds", type=int, help="R: rounds of H inner steps per arm (streaming: R x F of H / F)")
    ap.add_argument("--inner-steps", type=int, default=20, help="H (a multiple of every F)")
    ap.add_argument("--fragments", type=int, nargs="+", default=[2, 4], help="F of the streaming arms")
    ap.add_argument("--streaming-outer", default="0.7:0.9", metavar="LR:MOMENTUM")
    ap.add_argument("--arms", help="comma-separated subset of the arms' names (blocking is always run)")
    ap.add_argument("--rate", default="100mbit", help="tbf rate of each direction of the link (tc syntax)")
    ap.add_argument("--json", help="write every arm's figures to this JSON file")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (8 if args.quick else 16)
    if any(args.inner_steps % f for f in args.fragments):
        ap.error(f"--inner-steps {args.inner_steps} is not a multiple of every F in {args.fragments}")
    lr, _, m = args.streaming_outer.partition(":")
    args.outer = (float(lr), float(m or 0.0))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("overlap.py: needs root (ip netns, tc); run it with sudo", file=sys.stderr)
        return 2
    arms = arms_of(args.fragments, args.outer)
    if args.arms:
        wanted = {"blocking", *args.arms.split(",")}
        arms = [a for a in arms if a[0] in wanted]
    root = Path(tempfile.mkdtemp(prefix="p2p-diloco-overlap-"))
    print(f"{len(arms)} arms: {', '.join(a[0] for a in arms)}; T = {args.rounds} x {args.inner_steps} inner steps "
          f"per peer, 2 peers; link {args.rate}; logs in {root}", flush=True)
    rows: list[dict] = []

    def body(net: util.Net) -> None:
        print(HEADER, flush=True)
        for name, fragments, sets in arms:
            rows.append(run_arm(net, args, name, fragments, sets, root))
            blocking = next((r["loss"] for r in rows if r["arm"] == "blocking" and "error" not in r), None)
            print(format_row(rows[-1], blocking), flush=True)

    rc = util.in_namespaces(args.rate, body, "overlap.py")
    if rc:
        return rc
    y, u, name = verdict(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "best": name}, indent=2) + "\n")
    failed = [r for r in rows if "error" in r] + [r for r in rows if not r.get("one_digest", True)]
    print(f"best overlapped arm: {name} (goals: loss over blocking <= {LOSS_GOAL}, utilization >= "
          f"{UTILIZATION_GOAL})")
    print(f"overlap_loss_over_blocking={y:.4f} utilization={u:.3f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
