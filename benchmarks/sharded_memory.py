"""Where the outer state lives: peak memory of each local rank in ``outer.sharding = "rank0"`` vs ``"sharded"``.

Two peers of K = 2 ranks (torchrun, gloo, DDP or ``--parallelism fsdp``) train the 3.3M- and the 12.9M-parameter
models of benchmarks/scale.py for 2 rounds, in each mode, all in one run of this script. For each rank of peer 0
the peak PSS (proportional set size: hivemind's shared-memory copies are counted once) of the rank's process and
everything it started (its DHT, averagers and p2pd), sampled every 0.2 s, is taken; the slope between the two
model sizes is what one more parameter costs that rank (fixed costs, a few hundred MiB per process, cancel out).

In ``rank0`` mode rank 0 holds theta, the momentum, the pseudo-gradient and the averager's copies for the whole
model; in ``sharded`` mode (``outer.shards = 2``) each rank holds them for its half. The figures to look at are
rank 0's slope in each mode, and the two ranks' slopes in sharded mode.

Last line: ``rank0_slope_ratio_sharded_over_rank0=<x>``. Usage: ``python -m benchmarks.sharded_memory`` (about 6
minutes on 2 cores).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.scale import COMMON, SIZES  # the same model and settings as benchmarks/scale.py
from p2p_diloco.config import load_config
from p2p_diloco.runtime.peer_process import PeerProcess, PeerStartError, stop_all
from p2p_diloco.training.model import build_model, count_parameters
from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

SETS = [*COMMON, "swarm.min_peers=2", "outer.shards=2"]


def _rank_of(proc: psutil.Process) -> int | None:
    try:
        return int(proc.environ().get("LOCAL_RANK", ""))
    except (ValueError, psutil.Error):
        return None


def _sample(agent: psutil.Process, peaks: dict[int, int], done: threading.Event) -> None:
    """Peak PSS of each rank's process tree (the torchrun agent's children are the ranks)."""
    while not done.is_set():
        try:
            ranks = {r: p for p in agent.children() if (r := _rank_of(p)) is not None}
        except psutil.Error:
            ranks = {}
        for r, p in ranks.items():
            total = 0
            try:
                tree = [p, *p.children(recursive=True)]
            except psutil.Error:
                continue
            for q in tree:
                try:
                    total += q.memory_full_info().pss
                except psutil.Error:
                    pass
            peaks[r] = max(peaks.get(r, 0), total)
        done.wait(0.2)


def run_mode(mode: str, size: str, tmp: Path, parallelism: str = "ddp") -> dict[int, int]:
    """Two 2-rank peers in ``mode`` with the ``size`` model; the peak PSS of each rank of peer 0."""
    run_id = f"shmem-{mode}-{size}-{int(time.time())}"
    base = ["join", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", run_id, "--max-rounds", "2",
            "--inner-steps", "5", "--data-seed", "1"]
    for item in [*SIZES[size], *SETS, f"outer.sharding={mode}", f"train.parallelism={parallelism}"]:
        base += ["--set", item]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    peers = [PeerProcess(base, python_args=torchrun, stderr=tmp / f"{mode}-0.log")]
    peaks: dict[int, int] = {}
    done = threading.Event()
    sampler = threading.Thread(target=_sample, args=(psutil.Process(peers[0].pid), peaks, done), daemon=True)
    sampler.start()
    try:
        try:
            peers[0].wait_joined(600)
        except PeerStartError:
            raise SystemExit(f"{mode}: no join line; see {tmp / f'{mode}-0.log'}") from None
        peers.append(PeerProcess([*base, "--initial-peers", *peers[0].maddrs], python_args=torchrun,
                                 stderr=tmp / f"{mode}-1.log"))
        codes = tuple(p.wait(600) for p in peers)
    finally:
        done.set()
        sampler.join()
        stop_all(peers, grace=30)
    if codes != (0, 0):
        raise SystemExit(f"{mode}: peers exited with {codes}; see the logs in {tmp}")
    return peaks


def _params(size: str) -> int:
    cfg = load_config(sets=[*SIZES[size], *SETS])
    return count_parameters(build_model(cfg.model, vocab_size(build_tokenizer(cfg.tokenizer)), 0))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp", help="inside each peer")
    args = ap.parse_args()
    sizes = {size: _params(size) for size in ("small", "large")}
    peaks = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("rank0", "sharded"):  # the two modes alternate per size, so a drift of the VM hits both
            for size in sizes:
                peaks[mode, size] = run_mode(mode, size, Path(d), args.parallelism)
    print(f"peak PSS of each rank of a 2-rank peer ({args.parallelism}), 2 peers, 2 rounds; {sizes['small']:,} and "
          f"{sizes['large']:,} parameters:")
    slopes = {}
    for mode in ("rank0", "sharded"):
        cells = []
        for r in (0, 1):
            small, large = peaks[mode, "small"][r], peaks[mode, "large"][r]
            slopes[mode, r] = (large - small) / (sizes["large"] - sizes["small"])
            cells.append(f"rank {r} {small / 2**20:.0f} -> {large / 2**20:.0f} MiB, "
                         f"slope {slopes[mode, r]:.1f} B/param")
        print(f"   {mode:<8} " + "; ".join(cells))
    print(f"rank0_slope_ratio_sharded_over_rank0={slopes['sharded', 0] / slopes['rank0', 0]:.3f}")


if __name__ == "__main__":
    main()
