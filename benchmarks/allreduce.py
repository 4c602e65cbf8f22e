"""All-reduce benchmark: gloo vs stock hivemind vs p2p-diloco's exact averager (every codec), on 127.0.0.1.

Method. For each N in ``--peers`` the parent starts N worker processes (this script with ``--worker``, each in its
own session; see ``benchmarks/_allreduce_worker.py``). Every worker holds the same payload: ``--mb`` MB of fp32
(default 40 MB = 10M floats) in 4 tensors (50/25/15/10 %), seeded per peer, identical for every method. One worker
per peer runs all methods in sequence (imports and the DHT start once), driven by the parent over stdin/stdout:

1. gloo: ``torch.distributed`` rendezvous over ``tcp://127.0.0.1`` (not timed), a warm-up all-reduce, a barrier,
   then ``--repeats`` timed all-reduces (a barrier before each; one ``all_reduce`` per tensor, the 4 timed
   together). Figure: the max over ranks of each rank's median.
2. stock hivemind: ``DecentralizedAverager`` (default codec and part size) on each peer's ``hivemind.DHT``.
3. ours: ``ExactAverager`` with ``compression_for(codec)`` for codec in none (fp32), fp16, bf16, int8, int4, on
   each transport: ``ours:<codec>`` = libp2p streams through p2pd, ``ours:<codec>/tcp`` = the direct-TCP data
   plane (``swarm/fastpath.py``, the default ``swarm.transport``, each member authenticated: data_auth.py), and
   ``ours:none/tcp+enc`` the same encrypted (``swarm.encrypt_data``); ``set_round_params`` gets a fresh 24-bit
   group key before every step, so no two steps can match each other.

For 2 and 3 a new averager is started per method (not timed). Before each step every worker restores its original
tensors (not timed); the parent gives all workers the same wall-clock start time, they call ``step(wait=False,
timeout=60, allow_retries=False)`` (stock hivemind too, so a failure is seen rather than retried inside the step)
and poll the StepControl every 1 ms. ``data s`` = ``began_allreduce`` -> ``done()``: the all-reduce once the group
is formed (the analogue of gloo's all_reduce after rendezvous; includes hivemind's load balancing and the copy into
the averaged tensors). ``total s`` = ``step()`` call -> done, matchmaking included. Both: max over ranks of the
per-rank median over repeats. MB/s = payload MB / data s; ``vs gloo`` = data s / gloo s at the same N; ``MB
sent/peer`` = payload bytes our averager counts as sent (mean over peers); ``CPU s/peer`` = CPU seconds of all of
a peer's processes (main, DHT, averager, p2pd) during one whole step (gloo: its process over the timed loop), mean
over peers and repeats, and ``p2pd %`` its share in p2pd. A failed step is printed and counted, and that repeat is
retried once (``retried``); ``max err`` is rank 0's max |result - exact mean| (ours: - the default aggregation of
the payloads, ``trimmed_mean``; ``--no-verify`` skips it). Worker
logs (stderr) and ``timings_n<N>.json`` (every worker's raw timings) go to ``--out-dir``.

Limits: one machine, loopback only (no latency, no bandwidth limit but CPU); N peers (each a python process, a DHT
process, a p2pd daemon and an averager process) share the machine's cores, so on 2 cores the figures measure CPU
cost and contention as much as the algorithms; each worker uses 1 torch thread; few repeats (medians of 2-3).

Profile: ``--profile`` runs N=4 (or ``--peers``) with gloo and codec none only, worker rank 1 under ``.venv/bin/
py-spy record --subprocesses --rate 200 --format raw`` (``--profile-format flamegraph`` for an SVG instead), and
summarises the raw stacks of its averager process: blocking waits (py-spy's idle filter misses them here), the
uvloop run loop (C), and the top python functions of the rest. ``--profile-native`` adds ``--native`` (C frames;
it slows the averager about 2x). p2pd (Go) is invisible to py-spy: see the ``p2pd %`` column. By hand:
``py-spy record -o prof.svg --subprocesses --rate 200 -- .venv/bin/python -m benchmarks.allreduce --worker 1 ...``.

The commit step (``benchmarks/_commit_cost.py``): after every successful ``ours:none/tcp`` step, all workers run
the peer's own commit step (sign, publish, read every member's signature over the DHT with the run's validators),
and once per N the outer step is timed as it was and as it is now; the line before the last gives the growth of
the round's sync time, ``sync_growth_n<N>=<s>``.

Usage: ``python -m benchmarks.allreduce [--quick] [--peers 2 4 8] [--mb 40] [--repeats 3] [--profile]``.
``--quick``: N in {2, 4}, 2 repeats, all methods and codecs. The last line is ``ratio_vs_gloo_n4_fp32=<x>``
(ours:none/tcp data s / gloo s at N=4, i.e. our default fp32 sync path; ``nan``, with the reason on the line
before, if N=4 was not measured).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks._allreduce_worker import REPO, TAG_VAR, Peer, call_all, free_port, sweep, main as worker_main

CODECS = ("none", "fp16", "bf16", "int8", "int4")
PY_SPY = REPO / ".venv" / "bin" / "py-spy"


@dataclass
class Options:
    """What to run."""

    peers: list[int]
    repeats: int
    mb: float
    seed: int
    codecs: tuple[str, ...]
    stock: bool
    profile: str | None  # py-spy output format, or None
    native: bool  # py-spy --native (C/C++ frames too)
    out_dir: Path
    verify: bool


@dataclass
class Row:
    """One line of the table: one method at one N."""

    n: int
    method: str
    data_s: float | None = None
    total_s: float | None = None
    mb_sent: float | None = None
    failures: list[str] = field(default_factory=list)
    retried: int = 0
    max_err: float | None = None
    cpu_s: float | None = None  # CPU seconds per peer per step (all its processes), whole step
    p2pd_share: float | None = None  # share of that CPU spent in p2pd
    commit_s: float | None = None  # the commit step's signature exchange (ours:none/tcp only)
    outer_old_s: float | None = None  # the outer step and digest before the commit step existed
    outer_new_s: float | None = None  # ... and with it (computed aside, digest of theta and momentum)


def start_peers(opts: Options, n: int, env: dict) -> list[Peer]:
    """Start N workers; with ``--profile`` rank 1 runs under py-spy."""
    peers = []
    for rank in range(n):
        args = ["--worker", str(rank), "--peers", str(n), "--mb", str(opts.mb), "--seed", str(opts.seed)] + (
            [] if opts.verify else ["--no-verify"])
        prefix = []
        if opts.profile and rank == 1:
            ext = {"raw": "txt", "flamegraph": "svg", "speedscope": "json"}[opts.profile]
            prefix = [str(PY_SPY), "record", "-o", str(opts.out_dir / f"profile_n{n}_rank1.{ext}"), "--format",
                      opts.profile, "--subprocesses", "--rate", "200"] + ["--native"] * opts.native + ["--"]
        peers.append(Peer(rank, args, env, opts.out_dir / f"worker_n{n}_rank{rank}.log", prefix))
    return peers


def median_max(answers_per_repeat: list[list[dict]], key: str) -> float | None:
    """Max over ranks of each rank's median of ``key`` over the successful repeats."""
    per_rank = collections.defaultdict(list)
    for answers in answers_per_repeat:
        for a in answers:
            if a.get(key) is not None:
                per_rank[a["rank"]].append(a[key])
    return max(statistics.median(v) for v in per_rank.values()) if per_rank else None


def run_gloo(peers: list[Peer], opts: Options) -> Row:
    """Time gloo's all-reduce on every worker (its own rendezvous on a fresh port)."""
    answers = call_all(peers, 300, cmd="gloo", port=free_port(), repeats=opts.repeats)
    row = Row(len(peers), "gloo", max_err=answers[0].get("max_err"), cpu_s=statistics.mean(a["cpu"] for a in answers))
    row.data_s = row.total_s = max(statistics.median(a["times"]) for a in answers)
    return row


def run_averager(peers: list[Peer], opts: Options, kind: str, codec: str | None, keys, roles: dict,
                 transport: str = "p2p", ids: list[str] | None = None) -> Row:
    """Start one averager per peer, time ``opts.repeats`` steps (each retried once on failure), close it. For our
    default path (``none``/``tcp``) each successful step is followed by a commit step among ``ids``."""
    started = call_all(peers, 120, cmd="averager", kind=kind, codec=codec, transport=transport)
    roles[started[1]["averager_pid"] if len(started) > 1 else -1] = "averager"
    method = "hivemind" if kind == "stock" else f"ours:{codec}" + ("" if transport == "p2p" else f"/{transport}")
    row, done, commits = Row(len(peers), method), [], []
    for k in range(opts.repeats):
        for attempt in (0, 1):
            answers = call_all(peers, 180, cmd="step", at=time.time() + 0.5, bits=format(next(keys), "024b"),
                               attempt=attempt)
            failed = [a for a in answers if not a["ok"]]
            if not failed:
                done.append(answers)
                if ids and method == "ours:none/tcp":
                    commits.append(call_all(peers, 120, cmd="commit", at=time.time() + 0.3, round=k, members=ids,
                                            outer=k == 0))
                break
            row.failures += [f"repeat {k} try {attempt} rank {a['rank']}: {a['error']}" for a in failed]
            print(f"  FAILED N={len(peers)} {row.method} repeat {k} try {attempt}: {failed[0]['error']}", flush=True)
            row.retried += attempt == 0
    call_all(peers, 60, cmd="close")
    row.data_s, row.total_s = median_max(done, "data_s"), median_max(done, "total_s")
    sent = [a["bytes_sent"] for answers in done for a in answers if "bytes_sent" in a]
    row.mb_sent = statistics.mean(sent) / 1e6 if sent else None
    cpu = [a["cpu"] for answers in done for a in answers if "cpu" in a]
    if cpu:
        row.cpu_s = statistics.mean(sum(c.values()) for c in cpu)
        row.p2pd_share = sum(c.get("p2pd", 0.0) for c in cpu) / max(1e-9, sum(sum(c.values()) for c in cpu))
    errs = [a["max_err"] for answers in done for a in answers if a.get("max_err") is not None]
    row.max_err = max(errs) if errs else None
    failed = [a["error"] for answers in commits for a in answers if not a["ok"]]
    row.failures += [f"commit: {e}" for e in failed]
    row.commit_s = median_max([[a for a in answers if a["ok"]] for answers in commits], "commit_s")
    row.outer_old_s = median_max(commits[:1], "outer_old_s")
    row.outer_new_s = median_max(commits[:1], "outer_new_s")
    return row


def run_swarm(opts: Options, n: int, env: dict, roles: dict) -> list[Row]:
    """All methods for one N; kills every process group it started, whatever happens.

    ``roles`` gets ``{pid: role}`` for the processes of worker rank 1 (the one ``--profile`` records).
    """
    peers = start_peers(opts, n, env)
    try:
        hello = [p.expect("hello", 300) for p in peers]
        roles[hello[min(1, n - 1)]["pid"]] = "worker main"
        rows = [run_gloo(peers, opts)]
        print(f"  N={n} gloo {rows[0].data_s:.3f} s", flush=True)
        started = call_all(peers[:1], 120, cmd="dht", initial_peers=[])
        first = started[0]["maddrs"]
        others = call_all(peers[1:], 120, cmd="dht", initial_peers=first)
        ids = [a["peer_id"] for a in started + others]
        roles[others[0]["dht_pid"] if others else -1] = "dht"
        keys = iter(range(1, 2**24))
        methods = ([("stock", None, "p2p")] if opts.stock else []) + [
            ("exact", c, t) for t in ("p2p", "tcp") for c in opts.codecs] + [
            ("exact", "none", "tcp+enc")] * ("none" in opts.codecs and not opts.profile)
        for kind, codec, transport in methods:
            rows.append(run_averager(peers, opts, kind, codec, keys, roles, transport, ids))
            print(f"  N={n} {rows[-1].method} data {fmt(rows[-1].data_s)} s total {fmt(rows[-1].total_s)} s",
                  flush=True)
        call_all(peers, 120, cmd="exit")
        timings = [p.expect("timings", 60) for p in peers]
        (opts.out_dir / f"timings_n{n}.json").write_text(json.dumps(timings))
        for p in peers:
            p.wait(timeout=60)  # lets py-spy write its profile
        return rows
    finally:
        for p in peers:
            p.kill_group()


def fmt(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted, or ``-`` when missing."""
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], payload_mb: float) -> None:
    """The results table: one line per (N, method)."""
    gloo = {r.n: r.data_s for r in rows if r.method == "gloo"}
    head = f"{'N':>3} {'method':<10} {'data s':>8} {'total s':>8} {'MB/s':>8} {'vs gloo':>8} {'MB sent/peer':>13}" \
           f" {'retried':>7} {'failed':>6} {'max err':>9} {'CPU s/peer':>10} {'p2pd %':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        mbps = payload_mb / r.data_s if r.data_s else None
        ratio = r.data_s / gloo[r.n] if r.data_s and gloo.get(r.n) else None
        print(f"{r.n:>3} {r.method:<10} {fmt(r.data_s):>8} {fmt(r.total_s):>8} {fmt(mbps, '.1f'):>8} "
              f"{fmt(ratio, '.2f'):>8} {fmt(r.mb_sent, '.1f'):>13} {r.retried:>7} {len(r.failures):>6} "
              f"{fmt(r.max_err, '.2e'):>9} {fmt(r.cpu_s, '.2f'):>10} "
              f"{fmt(r.p2pd_share and 100 * r.p2pd_share, '.0f'):>6}")
    for r in rows:
        for failure in r.failures:
            print(f"failure: N={r.n} {r.method} {failure}")


def commit_lines(rows: list[Row]) -> None:
    """The commit step's cost next to the sync it follows (issue 17: at most +0.1 s at N=4, 40 MB)."""
    for r in rows:
        if r.commit_s is None or r.outer_old_s is None or r.outer_new_s is None:
            continue
        growth = r.commit_s + r.outer_new_s - r.outer_old_s
        print(f"commit step N={r.n}: signature exchange {r.commit_s:.3f} s, outer step + digest "
              f"{r.outer_old_s:.3f} s -> {r.outer_new_s:.3f} s; round sync {fmt(r.total_s)} s -> "
              f"{fmt(r.total_s and r.total_s + growth)} s (+{growth:.3f} s)")
    print(" ".join(f"sync_growth_n{r.n}={r.commit_s + r.outer_new_s - r.outer_old_s:.3f}" for r in rows
                   if None not in (r.commit_s, r.outer_old_s, r.outer_new_s)) or "sync_growth: not measured")


def ratio_line(rows: list[Row]) -> str:
    """The last line: our fp32 data time / gloo time at N=4 (nan, with the reason on the line before, if absent)."""
    at4 = {r.method: r.data_s for r in rows if r.n == 4}
    if at4.get("gloo") and at4.get("ours:none/tcp"):  # our default sync path: direct TCP, no codec
        return f"ratio_vs_gloo_n4_fp32={at4['ours:none/tcp'] / at4['gloo']:.2f}"
    why = "N=4 was not run" if not at4 else "no successful N=4 gloo or ours:none/tcp measurement"
    print(f"note: ratio_vs_gloo_n4_fp32 is nan: {why}")
    return "ratio_vs_gloo_n4_fp32=nan"


# Leaf frames that are blocking waits: py-spy's idle filter misses them here (checked with --native: futex,
# read, accept4, epoll_pwait). The averager's event loop is uvloop (C), so its time shows in run_until_complete.
WAITS = ("thread.py:81)", "Connection._recv", "_wait_for_tstate_lock", "socket.accept", "selectors.py",
         "Condition.wait", "Event.wait", "Queue.get")
LOOP = "DecentralizedAverager._run_internal (hivemind/averaging/averager.py:327)"
GENERIC = ("threading.py", "asyncio/", "concurrent/futures", "multiprocessing/", "allreduce", "_run_internal",
           "DecentralizedAverager.run ", "run_in_background", "__init__", "<module>")  # plumbing frames


def summarize_profile(path: Path, roles: dict[int, str], top: int = 12) -> None:
    """Samples per process, then the averager process's samples split into waits / event loop / python work,
    and the top functions of the python work, from a py-spy ``--format raw`` file."""
    per_proc, kinds, self_t, incl = (collections.Counter() for _ in range(4))
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        procs = [f for f in stack.split(";") if f.startswith("process ")]
        if not count.isdigit() or not frames or not procs:
            continue
        role = roles.get(int(procs[-1].split(":", 1)[0].split()[1]), "other")
        per_proc[role] += int(count)
        if role != "averager":
            continue
        kind = "wait" if any(w in frames[-1] for w in WAITS) else "loop" if frames[-1] == LOOP else "work"
        kinds[kind] += int(count)
        if kind == "work":
            names = [f.rsplit(":", 1)[0] + ")" for f in frames]  # without line numbers
            self_t[names[-1]] += int(count)
            incl.update({name: int(count) for name in set(names) if not any(g in name for g in GENERIC)})
    total, work = sum(per_proc.values()) or 1, kinds["work"] or 1
    print(f"profile {path}: {total} samples at 200 Hz (python stacks of worker rank 1's processes, whole run)")
    print("  " + ", ".join(f"{role} {100 * c / total:.1f} %" for role, c in per_proc.most_common()))
    av = per_proc["averager"] or 1
    print(f"  averager process: blocking waits {100 * kinds['wait'] / av:.1f} %, uvloop run loop (C) "
          f"{100 * kinds['loop'] / av:.1f} %, python work {100 * kinds['work'] / av:.1f} % of its {av} samples")
    for title, counter in (("self", self_t), ("inclusive", incl)):
        print(f"  top {title}, % of the averager's python work ({work} samples):")
        for name, c in counter.most_common(top):
            print(f"  {100 * c / work:5.1f} %  {name[:120]}")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Options | None]:
    """The arguments, and the run's :class:`Options` (``None`` in the ``--worker`` role)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--quick", action="store_true", help="N in {2, 4}, 2 repeats, all codecs (a few minutes)")
    ap.add_argument("--mb", type=float, default=40.0, help="payload per peer, MB of fp32 (10^6 bytes)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 3; 2 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    ap.add_argument("--no-stock", action="store_true", help="skip stock hivemind")
    ap.add_argument("--no-verify", action="store_true", help="skip checking results against the exact mean")
    ap.add_argument("--profile", action="store_true", help="N=4, gloo + ours:none only, worker rank 1 under py-spy")
    ap.add_argument("--profile-format", default="raw", choices=("raw", "flamegraph", "speedscope"))
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native: C/C++ frames too")
    ap.add_argument("--out-dir", type=Path, default=None, help="worker logs and profile (default: a new temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return args, None
    peers = [2, 4] if args.quick and args.peers == [2, 4, 8] else args.peers
    repeats = args.repeats or (2 if args.quick else 3)
    codecs, stock = tuple(args.codecs), not args.no_stock
    if args.profile:
        peers = [4] if args.peers == [2, 4, 8] else args.peers
        codecs, stock = ("none",), False
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="allreduce_bench_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    return args, Options(peers, repeats, args.mb, args.seed, codecs, stock,
                         args.profile_format if args.profile else None, args.profile_native, out_dir.resolve(),
                         not args.no_verify)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one worker) and print the table and the ratio line."""
    args, opts = parse_args(sys.argv[1:] if argv is None else argv)
    if opts is None:
        worker_main(args.worker, args.peers[0], args.mb, args.seed, not args.no_verify)
        return 0
    tag = f"{os.getpid()}-{time.time():.0f}"
    env = {TAG_VAR: tag}  # added to the workers' environment
    print(f"payload {opts.mb:g} MB fp32/peer; N={opts.peers}; {opts.repeats} repeats; logs in {opts.out_dir}",
          flush=True)
    t0, rows, roles = time.monotonic(), [], {}
    try:
        for n in opts.peers:
            try:
                rows += run_swarm(opts, n, env, roles.setdefault(n, {}))
            except Exception as e:  # one N failing must not hide the others' figures
                print(f"ERROR: N={n} aborted: {type(e).__name__}: {e}", flush=True)
    finally:
        leftovers = sweep(tag)
        if leftovers:
            print(f"note: swept {len(leftovers)} processes outside their group (pid:name:pgid; torch_shm_manager "
                  f"is expected, it calls setsid): {leftovers}")
    print(f"runtime {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    print_table(rows, opts.mb)
    for n in opts.peers if opts.profile == "raw" else []:
        if (prof := opts.out_dir / f"profile_n{n}_rank1.txt").exists():
            summarize_profile(prof, roles.get(n, {}))
    commit_lines(rows)
    print(ratio_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
