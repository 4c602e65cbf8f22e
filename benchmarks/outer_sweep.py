"""Outer-optimizer sweep: DiLoCo's arithmetic for N workers, simulated in one process, no network.

Why this exists: choosing the outer step (lr, momentum) needs many runs, and the real swarm spends most of a tiny
run on process start-up and matchmaking. This script runs the *same* code a peer runs, minus the swarm: N
:class:`~p2p_diloco.training.inner.InnerTrainer` s (each with its own AdamW state and data order ``DATA_SEED + i``, as
``p2p-diloco swarm --data-seed 1`` gives), :func:`~p2p_diloco.outer.optimizer.pseudo_gradient`, the uniform mean, and
:class:`~p2p_diloco.outer.optimizer.OuterOptimizer`. Only the summation order of the mean differs from the swarm's
butterfly all-reduce, so losses agree with ``convergence.py``'s swarm arms up to float noise, not bit for bit.
``convergence.py`` stays the benchmark of record; this is the instrument for sweeps.

Usage::

    python -m benchmarks.outer_sweep --steps 600 --h 20 100 --outer 0.7:0.9 1.0:0 [--set data.batch_size=32]

``--outer LR:MOMENTUM`` (Nesterov whenever momentum > 0). ``--codecs NAME ...`` (default none): every worker's
pseudo-gradient goes through that codec's encoding (``topk``: of pseudo-gradient + its error feedback,
``--density``, ``--bits``; ``--transform``: of a transform's coefficients, ``benchmarks/transforms.py``) and the
mean once more, as a reducer sends it back; the swarm's reducer keeps its own part unencoded, so codec arms agree
with the swarm's only roughly. ``--ref`` adds the single-worker and N x batch data parallel arms of
``convergence.py``. One line per run: ``sweep h=<H> outer=<lr>:<m> final=<loss> curve=...``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from benchmarks.convergence import DATA_SEED, local_arm
from benchmarks.transforms import TRANSFORMS, transformed
from p2p_diloco.outer import optimizer as outer
from p2p_diloco.outer.codecs import Codec, get_codec
from p2p_diloco.outer.error_feedback import ErrorFeedback
from p2p_diloco.outer.fragments import mix_into, partition
from p2p_diloco.config import Config, load_config
from p2p_diloco.training.data import PackedStream, eval_batches
from p2p_diloco.training.inner import InnerTrainer, evaluate
from p2p_diloco.training.model import build_model, count_parameters
from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

CPU = torch.device("cpu")


def _setup(cfg: Config, peers: int, steps: int, lr: float, momentum: float, data_seed: int):
    """The model (it holds theta for evaluation), the eval batches, theta, the outer optimizer, and N workers as
    (replica, data stream, inner trainer), worker i reading data order ``data_seed + i``."""
    tok = build_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, vocab_size(tok), cfg.run.seed)
    evals = eval_batches(tok, cfg.data, cfg.eval.batches)
    theta = outer.snapshot(model.parameters())
    opt = outer.OuterOptimizer(theta, lr, momentum, nesterov=momentum > 0)
    workers = []
    for i in range(peers):
        replica = copy.deepcopy(model)
        stream = PackedStream(tok, cfg.data, data_seed + i)
        workers.append((replica, stream, InnerTrainer(replica, cfg.train, stream.next_batch, steps, CPU)))
    return model, evals, theta, opt, workers


def simulate(cfg: Config, peers: int, steps: int, h: int, lr: float, momentum: float,
             data_seed: int = DATA_SEED, codec: Codec | None = None, decay: float = 1.0,
             gather: bool = False) -> list[float]:
    """T/H rounds of DiLoCo with N simulated workers; returns the eval loss of theta after every round (and at 0).
    ``codec``: every pseudo-gradient and the mean go through it (module docstring); ``decay``: the error
    feedback's; ``gather``: the mean is not encoded again (every member receives every part, an all-gather)."""
    model, evals, theta, opt, workers = _setup(cfg, peers, steps, lr, momentum, data_seed)
    delta = [torch.zeros_like(t) for t in theta]
    part = [torch.zeros_like(t) for t in theta]
    feedback = [ErrorFeedback(codec, theta, decay) if codec is not None and codec.align > 1 else None for _ in workers]
    curve = [evaluate(model, evals, CPU)]
    for rnd in range(steps // h):
        for d in delta:
            d.zero_()
        for (replica, _, trainer), ef in zip(workers, feedback):
            outer.load_into(replica.parameters(), theta)
            for k in range(h):
                trainer.step(rnd * h + k)
            outer.pseudo_gradient(theta, replica.parameters(), part)
            sent = part if codec is None else _encoded(codec, ef, part)
            for d, p in zip(delta, sent):
                d.add_(p)
        for d in delta:
            d.div_(peers)
        opt.step(delta if codec is None or gather else _encoded(codec, None, delta))
        outer.load_into(model.parameters(), theta)
        curve.append(evaluate(model, evals, CPU))
    for _, stream, _ in workers:
        stream.close()
    return curve


def simulate_overlap(cfg: Config, peers: int, steps: int, h: int, lr: float, momentum: float,
                     data_seed: int = DATA_SEED, start: str = "own") -> list[float]:
    """:func:`simulate` with ``outer.overlap``'s schedule (peer/overlap.py): round r's average lands one round late,
    and each worker starts round r + 1 from its own estimate of theta(r + 1) (``start``): ``own`` = the outer step
    from theta(r) with its own pseudo-gradient as the average (what a peer does today); ``eager`` = with its own
    pseudo-gradient weighted 1/N and the last landed average (N - 1)/N (Kale et al.'s eager update,
    https://arxiv.org/abs/2502.12996, the others' stale pseudo-gradients standing in for their fresh ones);
    ``stale`` = theta(r) itself. Returns the eval loss of theta after each landing (theta(R) last)."""
    model, evals, theta, opt, workers = _setup(cfg, peers, steps, lr, momentum, data_seed)
    begins = [[t.clone() for t in theta] for _ in workers]  # each worker's start of this round
    pending, landed = None, [torch.zeros_like(t) for t in theta]
    curve = [evaluate(model, evals, CPU)]
    for rnd in range(steps // h):
        parts = []
        for (replica, _, trainer), begin in zip(workers, begins):
            outer.load_into(replica.parameters(), begin)
            for k in range(h):
                trainer.step(rnd * h + k)
            part = [torch.zeros_like(t) for t in theta]
            outer.pseudo_gradient(begin, replica.parameters(), part)
            parts.append(part)
        if pending is not None:  # round r - 1's average lands: theta(r)
            opt.step(pending)
            landed = pending
            outer.load_into(model.parameters(), theta)
            curve.append(evaluate(model, evals, CPU))
        pending = [sum(ps) / peers for ps in zip(*parts)]
        for begin, part in zip(begins, parts):
            if start == "stale":
                for b, t in zip(begin, theta):
                    b.copy_(t)
                continue
            guess = part if start == "own" else [p / peers + a * (peers - 1) / peers for p, a in zip(part, landed)]
            opt.lookahead(guess, begin)
    opt.step(pending)
    outer.load_into(model.parameters(), theta)
    curve.append(evaluate(model, evals, CPU))
    for _, stream, _ in workers:
        stream.close()
    return curve


def simulate_streaming(cfg: Config, peers: int, steps: int, h: int, lr: float, momentum: float,
                       data_seed: int = DATA_SEED, fragments: int = 2, alpha: float = 0.5,
                       delay: int = 0, codec: Codec | None = None, decay: float = 1.0) -> list[float]:
    """Streaming DiLoCo (https://arxiv.org/abs/2501.18512) with ``fragments`` = F: every H/F inner steps one
    fragment (:func:`~p2p_diloco.outer.fragments.partition`, in turn) is averaged and outer-stepped, so each
    fragment is synced every H steps; its new theta lands ``delay`` inner steps later (the sync hidden behind them)
    as ``local = alpha * local + (1 - alpha) * theta``. ``codec``: each fragment's pseudo-gradients and their mean
    go through it as in :func:`simulate` (topk: with one error feedback per worker and fragment, as a peer keeps).
    Returns the eval loss of theta every H steps (and at 0)."""
    if h % fragments or not 0 <= delay <= h // fragments:
        raise ValueError(f"H = {h} needs a multiple of F = {fragments} and 0 <= delay <= H/F")
    model, evals, theta, opt, workers = _setup(cfg, peers, steps, lr, momentum, data_seed)
    runs, every = partition(theta, fragments), h // fragments
    feedback = [[ErrorFeedback(codec, [theta[i] for i in run], decay) if codec is not None and codec.align > 1
                 else None for run in runs] for _ in workers]
    landing: dict[int, list[int]] = {}  # inner step -> fragments whose new theta lands after it
    curve = [evaluate(model, evals, CPU)]
    for t in range(1, steps + 1):
        for _, _, trainer in workers:
            trainer.step(t - 1)
        if t % every == 0:
            f = (t // every - 1) % fragments
            run = runs[f]
            mine = [theta[i] for i in run]
            delta = [torch.zeros_like(x) for x in mine]
            for (replica, _, _), ef in zip(workers, feedback):
                local = list(replica.parameters())
                part = [x - local[i].detach() for x, i in zip(mine, run)]
                for d, p in zip(delta, part if codec is None else _encoded(codec, ef[f], part)):
                    d.add_(p)
            mean = [d / peers for d in delta]
            mean = mean if codec is None else _encoded(codec, None, mean)
            opt.step_on(mine, [opt.momentum_buffers[i] for i in run], mean)
            landing.setdefault(t + delay, []).extend(run)
        for i in landing.pop(t, []):
            for replica, _, _ in workers:
                mix_into([list(replica.parameters())[i]], [theta[i]], alpha)
        if t % h == 0:
            outer.load_into(model.parameters(), theta)
            curve.append(evaluate(model, evals, CPU))
    for _, stream, _ in workers:
        stream.close()
    return curve


def _encoded(codec: Codec, feedback: ErrorFeedback | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a receiver decodes of ``tensors`` (with ``feedback``: of tensors + the error, which it then keeps)."""
    if feedback is not None:
        sent = feedback.compensate(tensors)
        feedback.accept()
        return sent
    flat = codec.round_trip(torch.cat([t.reshape(-1) for t in tensors]))
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def parse_outer(text: str) -> tuple[float, float]:
    lr, _, m = text.partition(":")
    return float(lr), float(m or 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600, help="T: inner steps per worker")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--h", type=int, nargs="+", default=[20, 100])
    ap.add_argument("--outer", type=parse_outer, nargs="+", default=[(0.7, 0.9), (1.0, 0.0)], metavar="LR:M")
    ap.add_argument("--data-seed", type=int, default=DATA_SEED, help="worker i reads data order S + i")
    ap.add_argument("--ref", action="store_true", help="also the single-worker and data-parallel arms")
    ap.add_argument("--overlap", nargs="+", default=[], choices=("own", "eager", "stale"),
                    help="also outer.overlap's schedule, with each of these starts (simulate_overlap)")
    ap.add_argument("--codecs", nargs="*", default=["none"],
                    help="outer.compression of each blocking arm (none given: no blocking arm)")
    ap.add_argument("--density", type=float, default=1 / 64, help="topk's density")
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4, 8), help="topk's value bits")
    ap.add_argument("--ef-decay", type=float, default=1.0, help="topk: the error feedback's decay (SparseLoCo: 0.95)")
    ap.add_argument("--gather", action="store_true", help="codec arms: the mean is not encoded again (all-gather)")
    ap.add_argument("--transform", default="", metavar="NAME:SIZE",
                    help=f"topk arms: top-k of the coefficients of a transform ({', '.join(TRANSFORMS)}; "
                         "benchmarks/transforms.py), e.g. dct:64, dct2:8")
    ap.add_argument("--streaming", nargs="+", default=[], metavar="F:ALPHA:DELAY",
                    help="also Streaming DiLoCo with F fragments, merge factor alpha, delay in inner steps")
    ap.add_argument("--streaming-codec", default="none", help="the streaming arms' outer.compression (--density, "
                    "--bits, --ef-decay as for --codecs)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args()
    cfg = load_config(None, args.sets)
    torch.set_num_threads(2)
    model = build_model(cfg.model, vocab_size(build_tokenizer(cfg.tokenizer)), cfg.run.seed)
    params, shapes = count_parameters(model), [tuple(p.shape) for p in model.parameters()]
    print(f"{params:,} parameters; T = {args.steps}, N = {args.peers}, batch {cfg.data.batch_size} x "
          f"{cfg.data.seq_len}; data seed {args.data_seed}; sets {args.sets}", flush=True)
    if args.ref:
        for name, n in [("single", 1), (f"dp-{args.peers}x", args.peers)]:
            arm = local_arm(name, cfg, n, args.steps, min(args.h), args.data_seed)
            print(f"ref {name} final={arm.final:.4f} wall={arm.wall_s:.0f}s", flush=True)
    for h in args.h:
        if args.steps % h:
            ap.error(f"--steps {args.steps} is not a multiple of H = {h}")
        for (lr, m), name in [(o, c) for o in args.outer for c in args.codecs]:
            t0 = time.monotonic()
            codec = None if name == "none" else get_codec(name, args.density, args.bits)
            if args.transform and name == "topk":
                codec = transformed(codec, args.transform, shapes)
            curve = simulate(cfg, args.peers, args.steps, h, lr, m, args.data_seed, codec, args.ef_decay, args.gather)
            print(f"sweep h={h} outer={lr}:{m} codec={codec.name if codec else name} decay={args.ef_decay} "
                  f"gather={args.gather} "
                  f"final={curve[-1]:.4f} wall={time.monotonic() - t0:.0f}s "
                  f"curve={' '.join(f'{c:.3f}' for c in curve)}", flush=True)
        for (lr, m), mode in [(o, x) for o in args.outer for x in args.overlap]:
            t0 = time.monotonic()
            curve = simulate_overlap(cfg, args.peers, args.steps, h, lr, m, args.data_seed, mode)
            print(f"sweep h={h} outer={lr}:{m} overlap={mode} final={curve[-1]:.4f} "
                  f"wall={time.monotonic() - t0:.0f}s curve={' '.join(f'{c:.3f}' for c in curve)}", flush=True)
        for (lr, m), spec in [(o, x) for o in args.outer for x in args.streaming]:
            t0 = time.monotonic()
            f, a, d = spec.split(":")
            codec = None if args.streaming_codec == "none" else get_codec(args.streaming_codec, args.density, args.bits)
            curve = simulate_streaming(cfg, args.peers, args.steps, h, lr, m, args.data_seed, int(f), float(a), int(d),
                                       codec, args.ef_decay)
            print(f"sweep h={h} outer={lr}:{m} streaming={spec} codec={args.streaming_codec} decay={args.ef_decay} "
                  f"final={curve[-1]:.4f} "
                  f"wall={time.monotonic() - t0:.0f}s curve={' '.join(f'{c:.3f}' for c in curve)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
