"""How few bytes can a round send at no loss? Every codec through the real swarm, the same data and rounds.

Arms: ``p2p-diloco swarm --peers N`` (default 4) for T inner steps per peer in rounds of H (``benchmarks/
convergence.py``'s quick length by default: T = 600, H = 20, the tiny default model), with ``outer.compression``
= none (fp32), int8, int4, and ``topk`` at two densities (``--densities``, default 1/64 and 1/32 of every chunk of
4,096, 2-bit values, error feedback; ``outer.aggregation = mean``, which topk needs: config/checks.py; and the
outer step of :func:`topk_outer`). Every other setting is the config's own, the same for every arm.

Printed per arm: final eval loss (on the global weights, from a peer's event log), loss over fp32's, bytes sent per
peer per round (measured: the peers' ``bytes_sent`` / rounds; a butterfly all-reduce receives as much as it sends),
and fp32's bytes over the arm's. Last line: ``compression_vs_fp32=<c> loss_over_fp32=<y>`` for the arm with the
largest c among those with y <= 1.01 (fp32 itself qualifies, with c = 1).

Usage: ``python -m benchmarks.compression --quick`` (5 arms of T = 600 at N = 4: about 10 minutes on 2 cores);
``--steps``, ``--h``, ``--peers``, ``--set`` as in convergence.py. ``--project`` prints, instead of training, the
sync time per round at 1B, 30B and 50B parameters on 100 Mbit/s and 1 Gbit/s links with each codec (arithmetic on
the codecs' exact encoded sizes: ``docs/scale.md``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.convergence import Arm, swarm_arm
from p2p_diloco.config import load_config
from p2p_diloco.outer.codecs import get_codec

LOSS_BUDGET = 1.01  # the loss an arm may reach, over fp32's, and still count as "no loss"


def topk_outer(density: float) -> list[str]:
    """The outer step of a topk arm: SparseLoCo's (arXiv 2508.15706), error feedback decayed by 0.95 and no outer
    momentum, with an outer lr of 1 / (8 x density): 8 at 1/64, 4 at 1/32. A position that one member of N sends
    is divided by N in the average, so sparse averages need a larger step than dense ones. From the simulator on
    data seed 11 (docs/performance.md: every setting tried); at 1/32, lr 4 was tried there after this benchmark's
    lr 8 arm had ended worse."""
    return ["outer.momentum=0", "outer.topk_error_decay=0.95", f"outer.lr={1 / (8 * density):g}"]


def arms_of(densities: list[float], bits: int, topk_sets: list[str] = ()) -> list[tuple[str, list[str]]]:
    """(name, extra --set items) of every arm, fp32 first; ``topk_sets`` go to the topk arms only, after
    :func:`topk_outer` (so they override it)."""
    arms = [("fp32", ["outer.compression='none'"]), ("int8", ["outer.compression='int8'"]),
            ("int4", ["outer.compression='int4'"])]
    for d in densities:
        arms.append((f"topk-{d:.4f}-{bits}bit", ["outer.compression='topk'", f"outer.topk_density={d}",
                                                 f"outer.topk_bits={bits}", "outer.aggregation='mean'",
                                                 *topk_outer(d), *topk_sets]))
    return arms


def verdict(arms: list[Arm], rounds: int) -> tuple[float, float, str]:
    """(compression over fp32, loss over fp32, arm name) of the most compressed arm within the loss budget."""
    fp32 = arms[0]
    best = (1.0, 1.0, fp32.name)
    for arm in arms[1:]:
        if arm.note or not arm.curve or arm.bytes_per_worker <= 0:
            continue
        c, y = fp32.bytes_per_worker / arm.bytes_per_worker, arm.final / fp32.final
        if y <= LOSS_BUDGET and c > best[0]:
            best = (c, y, arm.name)
    return best


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 600 else f"{seconds:.1f} s"


def project(peers: int, densities: list[float], bits: int) -> None:
    """Bytes each peer sends per round (butterfly: 2(N-1)/N x the encoded model) and the time at full link speed,
    sent and received at once (full duplex); matchmaking and codec time come on top."""
    codecs = [("fp32", get_codec("none")), ("int8", get_codec("int8")), ("int4", get_codec("int4"))]
    codecs += [(f"topk {d:.4f} {bits}-bit", get_codec("topk", d, bits)) for d in densities]
    print(f"N = {peers}: bytes sent per peer per round = 2(N-1)/N x the encoded model")
    print("| model | codec | bytes/param | sent per peer | 100 Mbit/s | 1 Gbit/s |")
    print("|---|---|---|---|---|---|")
    for params in (1e9, 30e9, 50e9):
        for name, codec in codecs:
            chunk = 2**20  # the encoded size of a whole model, per 2^20 values (exact for every codec here)
            per_param = codec.payload_bytes(chunk) / chunk
            sent = 2 * (peers - 1) / peers * per_param * params
            print(f"| {params / 1e9:.0f}B | {name} | {per_param:.4f} | {sent / 1e9:.2f} GB | "
                  f"{_duration(sent * 8 / 100e6)} | {_duration(sent * 8 / 1e9)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 600, H = 20 (about 10 minutes)")
    ap.add_argument("--steps", type=int, default=None, help="T: inner steps per peer (default 600)")
    ap.add_argument("--h", type=int, default=20, help="H: inner steps per round")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--densities", type=float, nargs="+", default=[1 / 64, 1 / 32])
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4, 8))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--topk-set", dest="topk_sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for the topk arms only (e.g. their own outer step)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--project", action="store_true", help="print the sync-time projection for 1B-50B and exit")
    ap.add_argument("--arms", nargs="+", default=None, help="run only these arms (fp32 always runs: the reference)")
    args = ap.parse_args()
    if args.project:
        project(args.peers, args.densities, args.bits)
        return 0
    steps = args.steps or 600
    if steps % args.h:
        ap.error(f"--steps {steps} must be a multiple of --h {args.h}")
    rounds = steps // args.h
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="p2p-diloco-compression-"))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    print(f"N = {args.peers}, T = {steps}, H = {args.h} ({rounds} rounds); logs in {out}", flush=True)
    t0, arms = time.monotonic(), []
    for name, extra in arms_of(args.densities, args.bits, args.topk_sets):
        if args.arms and name != "fp32" and name not in args.arms:
            continue
        cfg = load_config(None, args.sets + extra)
        arms.append(swarm_arm(name, cfg, args.sets + extra, args.peers, steps, args.h, out))
        print(f"  {name}: {arms[-1].final:.4f} ({arms[-1].wall_s:.0f} s) {arms[-1].note}", flush=True)
    print(f"runtime {time.monotonic() - t0:.0f} s")
    fp32 = arms[0]
    print(f"{'arm':<22} {'eval loss':>9} {'over fp32':>9} {'bytes/peer/round':>16} {'fp32 bytes over':>15}")
    for arm in arms:
        per_round = arm.bytes_per_worker / rounds
        ratio = fp32.bytes_per_worker / arm.bytes_per_worker if arm.bytes_per_worker else float("nan")
        print(f"{arm.name:<22} {arm.final:>9.4f} {arm.final / fp32.final:>9.4f} {per_round:>16,.0f} "
              f"{ratio:>15.1f} {arm.note}")
    c, y, name = verdict(arms, rounds)
    print(f"best within {LOSS_BUDGET}x fp32's loss: {name}")
    print(f"compression_vs_fp32={c:.1f} loss_over_fp32={y:.4f}")
    return 0 if not fp32.note else 1


if __name__ == "__main__":
    sys.exit(main())
