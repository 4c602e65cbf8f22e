"""What a peer costs per model parameter, measured at CPU scale, and the budget that implies at 1B, 30B and 50B.

Three measurements, then arithmetic (docs/scale.md shows a run of it):

1. **Tensor accounting** (this process): build a model, take one inner step (AdamW state exists after it), build
   the outer optimizer and a pseudo-gradient buffer, and sum the bytes each component's tensors hold, per
   parameter: parameters, gradients, AdamW, theta, outer momentum, pseudo-gradient; and each codec's payload.
2. **Whole-peer memory slope**: ``p2p-diloco swarm --peers 2 --max-rounds 4`` for two model sizes; each peer's
   peak PSS (proportional set size, so hivemind's shared-memory copies are not counted twice), summed over its
   processes (main, DHT, averager, p2pd), sampled every 0.2 s; the mean over the peers. The slope between the two
   sizes is what one more parameter costs a 1-rank CPU peer in all: inner training, outer state, hivemind's
   averager buffers, codec buffers, allocator.
3. **Codec time**: encode + decode of a pseudo-gradient-sized tensor with each codec, in ns per value, this CPU
   (torch's default threads; the fastest of 3).

Then, for N = 4 peers of K = 8 ranks: memory per GPU and per host, bytes sent per peer per round (butterfly:
2(N-1)/N x payload) and the transfer time at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s.

Last line: ``bytes_per_param_peer=<slope of 2.>``. Usage: ``python -m benchmarks.scale`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil
import torch

from benchmarks.common import swarm_process
from p2p_diloco.outer import optimizer as outer
from p2p_diloco.outer.codecs import CODECS, get_codec
from p2p_diloco.config import load_config
from p2p_diloco.training.data import PackedStream
from p2p_diloco.training.inner import InnerTrainer
from p2p_diloco.training.model import build_model, count_parameters
from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

SIZES = {"small": ["model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4"],
         "large": ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=4"]}
COMMON = ["data.max_bytes=1500000", "eval.batches=2", "train.threads=1", "swarm.matchmaking_time=3.0",
          "data.batch_size=2", "data.seq_len=64",  # small activations: the slope is then mostly per-parameter
          "swarm.request_timeout=1.0"]
ROUNDS = 4  # each peer through its steady state: both phases (inner steps, sync) more than once
TARGETS = {"1B": 1.1e9, "30B": 30e9, "50B": 50e9}
LINKS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9, "10 Gbit/s": 10e9}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def account(size: str) -> tuple[int, dict[str, float]]:
    """Bytes per parameter held by each component, counted from the tensors themselves."""
    cfg = load_config(sets=[*SIZES[size], *COMMON])
    tokenizer = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, vocab_size(tokenizer), cfg.run.seed)
    params = list(model.parameters())
    n = count_parameters(model)
    data = PackedStream(tokenizer, cfg.data, 0)
    trainer = InnerTrainer(model, cfg.train, data.next_batch, 0, torch.device("cpu"))
    trainer.step(0)  # AdamW state is allocated on the first step
    batch = data.next_batch()
    model(input_ids=batch, labels=batch).loss.backward()  # gradients, as they exist at the end of a backward
    grads = [p.grad for p in params if p.grad is not None]
    adam = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    outer_opt = outer.OuterOptimizer(outer.snapshot(params), 0.7, 0.9)
    delta = [torch.empty_like(t) for t in outer_opt.theta]
    data.close()
    per = {"parameters": _nbytes(params), "gradients": _nbytes(grads), "AdamW state": _nbytes(adam),
           "theta (outer)": _nbytes(outer_opt.theta), "outer momentum": _nbytes(outer_opt.momentum_buffers),
           "pseudo-gradient": _nbytes(delta)}
    per = {k: v / n for k, v in per.items()}
    for c in CODECS:
        per[f"payload {c}"] = get_codec(c).payload_bytes(n) / n
    return n, per


def codec_ns_per_value(n: int) -> dict[str, float]:
    x = torch.randn(n) * 1e-3
    out = {}
    for c in CODECS:
        codec, best = get_codec(c), float("inf")
        for _ in range(3):  # the fastest of 3: the first pays for allocation
            t0 = time.perf_counter()
            codec.round_trip(x)
            best = min(best, time.perf_counter() - t0)
        out[c] = best / n * 1e9
    return out


def peak_pss_per_peer(size: str, peers: int, tmp: Path) -> tuple[int, float]:
    """(parameters, the mean over peers of each peer's peak PSS) of a short real run.

    A peer is a ``join`` process of the launcher with every process under it (DHT, averager, p2pd,
    torch_shm_manager); its PSS is summed at each sample and the peak taken per peer: the peers' peaks need not
    coincide (one trains while the other syncs), so the peak of the whole swarm's sum would depend on how their
    phases happened to line up."""
    cmd = ["--peers", str(peers), "--max-rounds", str(ROUNDS), "--inner-steps", "5", "--run-id",
           f"scale-{size}-{int(time.time())}", "--data-seed", "1"]
    for item in [*SIZES[size], *COMMON]:
        cmd += ["--set", item]
    peaks: dict[int, int] = {}
    with swarm_process(cmd, tmp / f"{size}.log") as proc:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                children = root.children()
            except psutil.Error:
                break
            for peer in children:
                total = 0
                try:
                    if "join" not in peer.cmdline():  # (the launcher's other children: multiprocessing's helpers)
                        continue
                    tree = [peer, *peer.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in tree:
                    try:
                        total += p.memory_full_info().pss
                    except psutil.Error:
                        pass
                peaks[peer.pid] = max(peaks.get(peer.pid, 0), total)
            time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"swarm run failed ({proc.returncode}); see {tmp / f'{size}.log'}")
    if len(peaks) != peers:
        raise SystemExit(f"saw {len(peaks)} peer processes, expected {peers}; see {tmp / f'{size}.log'}")
    cfg = load_config(sets=[*SIZES[size], *COMMON])
    n = count_parameters(build_model(cfg.model, vocab_size(build_tokenizer(cfg.tokenizer)), 0))
    return n, sum(peaks.values()) / peers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=2, help="peers of the memory runs (2.)")
    ap.add_argument("--n-peers", type=int, default=4, help="swarm size N of the bandwidth arithmetic")
    ap.add_argument("--ranks", type=int, default=8, help="local ranks K of the per-GPU arithmetic")
    args = ap.parse_args()

    n, per = account("large")
    print(f"1. tensor accounting, {n:,} parameters (bytes per parameter):")
    for k, v in per.items():
        print(f"   {k:<18} {v:6.3f}")
    ns = codec_ns_per_value(n)
    print(f"3. codec encode + decode, ns per value (this CPU, {torch.get_num_threads()} threads, best of 3): "
          + ", ".join(f"{c} {v:.1f}" for c, v in ns.items()))

    with tempfile.TemporaryDirectory() as d:
        (n_s, m_s), (n_l, m_l) = (peak_pss_per_peer(s, args.peers, Path(d)) for s in ("small", "large"))
    slope = (m_l - m_s) / (n_l - n_s)
    print(f"2. whole-peer peak PSS: {n_s:,} params -> {m_s / 2**20:.0f} MiB, {n_l:,} params -> {m_l / 2**20:.0f} "
          f"MiB per peer; slope {slope:.1f} bytes per parameter")

    inner = per["parameters"] + per["gradients"] + per["AdamW state"]
    outer_side = slope - inner
    N, K = args.n_peers, args.ranks
    print(f"\nBudget (N = {N} peers of K = {K} ranks, fp32 master weights, outer.sharding = rank0, DDP):")
    print(f"   inner training per GPU (params + grads + AdamW, activations not counted): {inner:.0f} B/param")
    print(f"   outer side on rank 0's host (measured slope - inner): {outer_side:.1f} B/param")
    for name, p in TARGETS.items():
        print(f"   {name}: per GPU {inner * p / 1e9:,.0f} GB with DDP, {inner * p / K / 1e9:,.0f} GB if sharded "
              f"over {K} (FSDP); rank-0 host {outer_side * p / 1e9:,.0f} GB, {outer_side * p / K / 1e9:,.0f} GB "
              f"per rank if sharded")
    print("\nBytes sent per peer per round (2(N-1)/N x payload) and transfer time:")
    for name, p in TARGETS.items():
        for c in ("none", "int8"):
            sent = 2 * (N - 1) / N * per[f"payload {c}"] * p
            times = ", ".join(f"{link} {sent * 8 / bw:,.0f} s" for link, bw in LINKS.items())
            print(f"   {name} {c:<5} {sent / 1e9:8.1f} GB: {times}; codec {ns[c] * p / 1e9 / K:,.1f} s "
                  f"if split over {K} ranks")
    print(f"bytes_per_param_peer={slope:.1f}")


if __name__ == "__main__":
    main()
