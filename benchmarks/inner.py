"""The product's inner loop against a bare transformers + AdamW loop: tokens/s and peak memory, alternated.

Arms, run one after the other ``--pairs`` times (bare first), each in its own process:

- ``bare``: ``python -m benchmarks.inner --bare-worker`` builds the same model (``build_model`` of the same config
  and seed), ``torch.optim.AdamW`` with the fused kernel (the same lr, betas and weight decay), and the batches of
  the same data stream prebuilt in memory (on the device), then times ``forward, backward, clip, step, zero_grad``
  (what an inner step is) for as many steps as the peer trains after its first round; it prints its tokens/s.
- ``peer``: ``p2p-diloco join`` alone (``swarm.min_peers = 1``: it steps alone each round), ``--rounds`` rounds of
  H = ``--inner-steps``; tokens/s = the tokens of its ``inner_done`` events over their seconds, the first round
  left out (start-up), as the bare loop leaves out ``--warmup`` steps.

Both use the same model, batch (``data.batch_size`` x ``data.seq_len``), dtype (fp32 on CPU: autocast off) and
torch threads (``--threads``). Memory: the peak PSS (proportional set size: shared pages counted once) of each
arm's whole process tree (the peer: its main process, DHT, averager and p2pd), sampled every second, in
``--memory-pairs`` pairs of their own after the speed pairs. Not in the speed pairs: reading ``smaps_rollup`` walks
a process's page tables (8.6 ms of CPU for the peer's main process, 16 ms a sample for its whole tree), which took
2.4 % from the peer's tokens/s on this 2-core machine (3 runs each way, 2026-12-06) and less from the bare loop's.

Printed: every run, then the means. Last lines: ``mfu_peer=<a> mfu_bare=<b>`` when the device's peak is known (a
listed GPU or ``--set train.peak_tflops=...``; ``scripts/gpu-check.sh`` reads it), ``pss_peer_over_bare=<m>``
(issue 22's goal: <= 1.5; only with ``--memory-pairs`` >= 1) and ``inner_over_bare=<x>``, the mean of the speed
pairs' ratios of tokens/s (goal: >= 0.98).
``--set train.device=cuda`` runs both arms on the GPU (bf16 autocast, as the product's default there).

Usage: ``python -m benchmarks.inner [--quick]`` (``--quick``: 2 pairs of 3 rounds of H = 100; the full run 3 pairs
of 5 rounds; then one memory pair); ``--set`` changes the model or the batch of both arms.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from p2p_diloco.config import load_config
from p2p_diloco.metrics.events import Event
from p2p_diloco.runtime.peer_process import PeerProcess, stop_all
from p2p_diloco.training.data import PackedStream
from p2p_diloco.training.inner import autocast_context, resolve_device
from p2p_diloco.training.model import build_model
from p2p_diloco.training.throughput import flops_per_token, mfu, peak_flops
from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

REPO = Path(__file__).resolve().parent.parent
PEER = ["swarm.min_peers=1", "eval.every_rounds=1000000", "eval.batches=1", "data.seed=1"]
SAMPLE_S = 1.0  # sampled 10x a second, the sampling itself slowed the peer it measured by a few %


def bare_worker(sets: list[str], steps: int, warmup: int, threads: int) -> None:
    """The bare loop (module docstring); prints ``tokens_per_s=<x>`` and, when the device's peak is known,
    ``mfu=<y>``. The fused AdamW; on CUDA bf16 autocast as the product's ``auto``, batches on the device."""
    torch.set_num_threads(threads)
    cfg = load_config(None, sets)
    device = resolve_device(cfg.train.device)
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, vocab_size(tokenizer), cfg.run.seed).to(device)
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                                  fused=True)  # the fastest kernel here too: the bare loop is the limit
    autocast = autocast_context(t.autocast, device)
    stream = PackedStream(tokenizer, cfg.data, 1)
    batches = [stream.next_batch().to(device) for _ in range(warmup + steps)]
    stream.close()
    model.train()
    t0 = 0.0
    for i, batch in enumerate(batches):
        if i == warmup:
            _sync(device)
            t0 = time.perf_counter()
        with autocast():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(device)
    rate = steps * batches[0].numel() / (time.perf_counter() - t0)
    print(f"tokens_per_s={rate:.1f}", flush=True)
    value = mfu(rate, flops_per_token(model, cfg.data.seq_len), peak_flops(device, t.peak_tflops))
    if value is not None:
        print(f"mfu={value:.4f}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pss(pid: int) -> int:
    """The PSS of one process in bytes, from ``/proc/<pid>/smaps_rollup`` (one line the kernel sums: reading the
    whole ``smaps`` of every process, as psutil does, cost enough CPU to slow the arm it measured); 0 if gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_pss(proc: subprocess.Popen | PeerProcess, timeout: float, sample: bool) -> int:
    """Wait for ``proc`` (at most ``timeout`` s); with ``sample``, sampling the summed PSS of its process tree: the
    peak (else 0)."""
    if not sample:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the run did not end within {timeout:.0f} s") from None
        return 0
    root, peak, deadline = psutil.Process(proc.pid), 0, time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run did not end within {timeout:.0f} s")
        try:
            pids = [root.pid, *(p.pid for p in root.children(recursive=True))]
        except psutil.Error:
            pids = []
        peak = max(peak, sum(_pss(pid) for pid in pids))
        time.sleep(SAMPLE_S)
    return peak


def run_bare(args: argparse.Namespace, steps: int, sample: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.inner", "--bare-worker", "--steps", str(steps), "--warmup",
           str(args.inner_steps), "--threads", str(args.threads), *(a for s in args.sets for a in ("--set", s))]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = _peak_pss(proc, timeout=600, sample=sample)
    out, err = proc.communicate()
    values = dict(ln.split("=", 1) for ln in out.splitlines() if "=" in ln)
    if proc.returncode != 0 or "tokens_per_s" not in values:
        raise RuntimeError(f"the bare loop failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")
    return {"tokens_per_s": float(values["tokens_per_s"]), "peak_pss": peak,
            "mfu": float(values["mfu"]) if "mfu" in values else None}


def run_peer(args: argparse.Namespace, log_dir: Path, sample: bool) -> dict:
    log_dir.mkdir(parents=True)
    cmd = ["join", "--run-id", f"inner-{int(time.time() * 1000)}", "--max-rounds", str(args.rounds),
           "--inner-steps", str(args.inner_steps), "--log-dir", str(log_dir), "--set",
           f"train.threads={args.threads}", *(a for s in [*PEER, *args.sets] for a in ("--set", s))]
    proc = PeerProcess(cmd, cwd=REPO, env={"P2P_DILOCO_INITIAL_PEERS": None}, stderr=log_dir / "stderr.log")
    try:
        peak = _peak_pss(proc, timeout=120 + args.rounds * args.inner_steps * 2.0, sample=sample)
    finally:
        stop_all([proc], grace=20)
    if proc.returncode != 0:
        raise RuntimeError(f"the peer failed ({proc.returncode}); see {log_dir / 'stderr.log'}")
    done = [e for e in proc.events(log_dir) if e["event"] == Event.INNER_DONE][1:]  # round 1: start-up
    if not done:
        raise RuntimeError("the peer did not finish a round after its first")
    seconds = sum(e["seconds"] for e in done)
    mfus = [e["mfu"] * e["seconds"] for e in done if "mfu" in e]
    return {"tokens_per_s": sum(e["tokens"] for e in done) / seconds, "peak_pss": peak,
            "steps": sum(e["inner_steps"] for e in done), "mfu": sum(mfus) / seconds if mfus else None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 pairs of 3 rounds (the full run: 3 pairs of 5)")
    ap.add_argument("--pairs", type=int, help="speed pairs (unsampled)")
    ap.add_argument("--memory-pairs", type=int, default=1, help="pairs whose peak PSS is sampled (0: none)")
    ap.add_argument("--rounds", type=int, help="the peer's rounds (the first is left out)")
    ap.add_argument("--inner-steps", type=int, default=100, help="H (also the bare loop's warm-up steps)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both arms")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.pairs = args.pairs or (2 if args.quick else 3)
    args.rounds = args.rounds or (3 if args.quick else 5)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the first round is left out)")
    if args.pairs < 1 or args.memory_pairs < 0:
        ap.error("--pairs must be >= 1 and --memory-pairs >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bare_worker:
        bare_worker(args.sets, args.steps, args.warmup, args.threads)
        return 0
    cfg = load_config(None, [*PEER, *args.sets])
    print(f"model {cfg.model.num_layers} layers x {cfg.model.hidden_size}; batch {cfg.data.batch_size} x "
          f"{cfg.data.seq_len}; {args.threads} threads; peer: {args.rounds} rounds of H = {args.inner_steps} (the "
          f"first left out); {args.pairs} pairs, alternated", flush=True)
    steps = (args.rounds - 1) * args.inner_steps
    ratios, pss, mfus = [], [], []
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-inner-") as root:
        for i in range(args.pairs):
            bare = run_bare(args, steps, sample=False)
            peer = run_peer(args, Path(root) / f"peer{i}", sample=False)
            ratios.append(peer["tokens_per_s"] / bare["tokens_per_s"])
            if peer["mfu"] is not None and bare["mfu"] is not None:
                mfus.append((peer["mfu"], bare["mfu"]))
            print(f"pair {i + 1}: bare {bare['tokens_per_s']:,.0f} tok/s; peer {peer['tokens_per_s']:,.0f} tok/s; "
                  f"peer/bare {ratios[-1]:.3f}", flush=True)
        for i in range(args.memory_pairs):
            bare = run_bare(args, steps, sample=True)
            peer = run_peer(args, Path(root) / f"memory{i}", sample=True)
            pss.append(peer["peak_pss"] / bare["peak_pss"])
            print(f"memory pair {i + 1}: peak PSS bare {bare['peak_pss'] / 2**20:,.0f} MiB, peer "
                  f"{peer['peak_pss'] / 2**20:,.0f} MiB: {pss[-1]:.2f} (tokens/s, sampled: bare "
                  f"{bare['tokens_per_s']:,.0f}, peer {peer['tokens_per_s']:,.0f})", flush=True)
    if mfus:
        print(f"mfu_peer={statistics.mean(m[0] for m in mfus):.4f} mfu_bare={statistics.mean(m[1] for m in mfus):.4f}")
    if pss:
        print(f"pss_peer_over_bare={statistics.mean(pss):.2f}")
    print(f"inner_over_bare={statistics.mean(ratios):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
