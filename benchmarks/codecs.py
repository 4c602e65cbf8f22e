"""Wire codecs: reconstruction error on a real pseudo-gradient, and the effect on eval loss of a short swarm run.

Method:
1. Reconstruction: build the default tiny model, run one round of H inner steps alone (the default config, data
   seed 0), take the pseudo-gradient theta - local, and encode -> decode it with every codec. Printed: relative L2
   error ||decoded - delta|| / ||delta||, max abs error, and bytes per value. No network.
2. Eval loss: for every codec, ``p2p-diloco swarm --peers 3 --max-rounds R`` on 127.0.0.1 with
   ``--set outer.compression=<codec>`` and ``train.total_steps`` = R x H (the inner lr decays over the run;
   everything else default), and the eval loss after the last round and
   whether all digests agreed, from ``--summary-json``. Then ``none`` and ``int8`` again with ``outer.overlap``
   (the outer step one round late). Every run reads the same data (``--data-seed 1``: peer i reads order 1+i).

3. ``--runs`` picks the swarm runs (default: every codec, then ``none+overlap`` and ``int8+overlap``); with
   ``--curve`` it also prints every run's eval loss after each round (read from a peer's ``events.jsonl``; all
   peers hold the same global weights), to see whether a gap between runs opens or closes over a longer run.

Usage: ``python -m benchmarks.codecs [--rounds 3] [--skip-swarm] [--runs none none+overlap] [--curve]
[--set K=V]`` (``--set``: for every swarm run). Takes ~1 min per codec on 2 cores at 5 rounds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import run_swarm
from p2p_diloco.outer import optimizer as outer
from p2p_diloco.outer.codecs import CODECS, get_codec
from p2p_diloco.config import Config
from p2p_diloco.training.data import PackedStream
from p2p_diloco.training.inner import InnerTrainer
from p2p_diloco.metrics import read_events
from p2p_diloco.metrics.events import Event
from p2p_diloco.training.model import build_model
from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size


def real_pseudo_gradient(cfg: Config) -> torch.Tensor:
    """theta - local after one round of inner steps of the default config, flattened."""
    torch.manual_seed(0)
    tok = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, vocab_size(tok), cfg.run.seed)
    params = list(model.parameters())
    theta = outer.snapshot(params)
    data = PackedStream(tok, cfg.data, seed=0)
    trainer = InnerTrainer(model, cfg.train, data.next_batch, 0, torch.device("cpu"))
    for step in range(cfg.train.inner_steps):
        trainer.step(step)
    data.close()
    delta = [torch.empty_like(t) for t in theta]
    outer.pseudo_gradient(theta, params, delta)
    return torch.cat([d.reshape(-1) for d in delta])


def reconstruction_table() -> None:
    delta = real_pseudo_gradient(Config())
    print(f"pseudo-gradient: {delta.numel():,} values, norm {delta.norm():.4f}, max |v| {delta.abs().max():.2e}")
    print(f"{'codec':<6} {'bytes/value':>11} {'rel L2 error':>13} {'max abs error':>14}")
    for name in CODECS:
        codec = get_codec(name)
        decoded = codec.round_trip(delta)
        rel = ((decoded - delta).norm() / delta.norm()).item()
        print(f"{name:<6} {codec.payload_bytes(delta.numel()) / delta.numel():>11.3f} {rel:>13.2e} "
              f"{(decoded - delta).abs().max().item():>14.2e}")


def eval_curve(log_dir: Path) -> dict[int, float]:
    """``{round: eval loss}`` from the first peer's event log under ``log_dir``."""
    for events in sorted(log_dir.glob("*/events.jsonl")):
        return {e["round"]: e["loss"] for e in read_events(events) if e.get("event") == Event.EVAL}
    return {}


def _swarm_run(tmp: Path, codec: str, overlap: bool, rounds: int, sets: list[str] = ()) -> str:
    """One ``p2p-diloco swarm --peers 3`` run (``sets``: more ``--set`` items); the table row (or FAILED)."""
    name = f"{codec}{'+overlap' if overlap else ''}"
    summary = tmp / f"{name}.json"
    cmd = ["--peers", "3", "--max-rounds", str(rounds), "--run-id", f"codec-{codec}-{int(overlap)}",
           "--data-seed", "1", "--set", f"outer.compression={codec}",
           "--set", f"train.total_steps={rounds * Config().train.inner_steps}",  # cosine decay over the run
           "--set", f"outer.overlap={str(overlap).lower()}", "--summary-json", str(summary),
           "--log-dir", str(tmp / name), *[a for item in sets for a in ("--set", item)]]
    t0 = time.monotonic()
    rc = run_swarm(cmd, tmp / f"{name}.log", timeout=900)
    wall = time.monotonic() - t0
    if rc != 0 or not summary.exists():
        return f"{name:<13} FAILED (exit {rc})"
    result = json.loads(summary.read_text())
    peers = result["peers"]
    first = sum(p["eval_loss_first"] for p in peers) / len(peers)
    last = sum(p["eval_loss_last"] for p in peers) / len(peers)
    sent = sum(p["bytes_sent"] for p in peers) / len(peers) / 1e6
    return (f"{name:<13} {first:>10.4f} {last:>10.4f} {sent:>13.2f} {wall:>7.0f} "
            f"{str(result['all_digests_equal']):>14}")


RUNS = [*CODECS, "none+overlap", "int8+overlap"]


def swarm_table(rounds: int, runs: list[str], curve: bool, sets: list[str] = ()) -> None:
    print(f"\n3-peer swarm, {rounds} rounds per run, data seeds 1-3 (default config otherwise)")
    print(f"{'run':<13} {'eval first':>10} {'eval last':>10} {'MB sent/peer':>13} {'wall s':>7} {'digests agree':>14}")
    curves = {}
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-codecs-") as tmp:
        for run in runs:
            codec, _, mode = run.partition("+")
            print(_swarm_run(Path(tmp), codec, mode == "overlap", rounds, sets), flush=True)
            curves[run] = eval_curve(Path(tmp) / run)
    if curve:
        print("\neval loss after each round (global weights)")
        print(f"{'round':>5} " + " ".join(f"{run:>13}" for run in runs))
        for r in sorted({r for c in curves.values() for r in c}):
            print(f"{r:>5} " + " ".join(f"{curves[run].get(r, float('nan')):>13.4f}" for run in runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-swarm", action="store_true", help="only the reconstruction table")
    ap.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS, help="swarm runs, in order")
    ap.add_argument("--curve", action="store_true", help="also print each run's eval loss after every round")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override for every swarm run")
    args = ap.parse_args()
    reconstruction_table()
    if not args.skip_swarm:
        swarm_table(args.rounds, args.runs, args.curve, args.sets)


if __name__ == "__main__":
    main()
