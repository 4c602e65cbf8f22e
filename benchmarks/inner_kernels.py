"""Two inner-loop choices measured on this machine: AdamW's kernel (default loop, foreach, fused) and
``train.compile``. The figures behind ``adamw_kernel`` and compile's default (docs/gpu.md).

1. AdamW: 40 steps of forward + backward + optimizer step on the model of the config, per kernel, twice
   (alternated); printed: the mean step and the optimizer step alone, in ms.
2. Compile: :class:`~p2p_diloco.training.inner.InnerTrainer` steps with ``train.compile`` false and true, twice
   (alternated): the first step (the compile) and the mean of 40 steps after 5.

Usage: ``python -m benchmarks.inner_kernels [--set model.hidden_size=256 ...]`` (2 torch threads; CPU).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from p2p_diloco.config import load_config
from p2p_diloco.training.inner import InnerTrainer
from p2p_diloco.training.model import build_model
from p2p_diloco.training.part import prepare_model

KERNELS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def adamw(cfg, kind: str, steps: int = 40) -> tuple[float, float]:
    """(seconds per step, seconds per optimizer step) with AdamW's ``kind`` kernel."""
    model = build_model(cfg.model, 257, 0)
    batch = torch.randint(0, 257, (cfg.data.batch_size, cfg.data.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **KERNELS[kind])
    model(input_ids=batch, labels=batch).loss.backward()
    t_opt, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        model(input_ids=batch, labels=batch).loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_opt += time.perf_counter() - t1
    return (time.perf_counter() - t0) / steps, t_opt / steps


def compiled(sets: list[str], compile_: bool, steps: int = 40) -> tuple[float, float]:
    """(seconds of the first step, seconds per step after 5 more) with ``train.compile = compile_``."""
    cfg = load_config(None, sets + [f"train.compile={str(compile_).lower()}"])
    model = build_model(cfg.model, 257, 0)
    prepare_model(model, cfg.train)
    batch = torch.randint(0, 257, (cfg.data.batch_size, cfg.data.seq_len))
    trainer = InnerTrainer(model, cfg.train, lambda: batch, 0, torch.device("cpu"))
    t0 = time.perf_counter()
    trainer.step(0)
    first = time.perf_counter() - t0
    for i in range(5):
        trainer.step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        trainer.step(i)
    return first, (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    cfg = load_config(None, args.sets)
    for _ in range(2):
        for kind in KERNELS:
            step, optimizer = adamw(cfg, kind)
            print(f"adamw {kind:8} step {step * 1000:7.1f} ms  optimizer {optimizer * 1000:6.2f} ms", flush=True)
    for _ in range(2):
        for compile_ in (False, True):
            first, step = compiled(args.sets, compile_)
            print(f"compile={compile_}: first step {first:.1f} s, then {step * 1000:.1f} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
