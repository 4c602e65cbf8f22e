"""Compute utilisation of a 2-peer swarm on a 100 Mbit/s link: blocking vs overlapped sync, per wire codec.

Method: two network namespaces joined by a veth pair, each end capped with ``tc ... tbf`` (``--rate``, default
100mbit; netem is not available here). One ``p2p-diloco join`` peer per namespace, listening on its namespace IP
(so the libp2p DHT and the direct-TCP data plane both cross the capped link), trains a ~3.3M-parameter Llama
(hidden 256, 4 layers, byte vocab; a 13 MB fp32 pseudo-gradient, ~1 s each way at 100 Mbit/s) for ``--rounds``
rounds of ``--inner-steps`` steps, one torch thread each. One run per (codec, mode): mode ``blocking`` is the
default round, ``overlap`` adds ``--set outer.overlap=true``.

Figures, from each peer's ``events.jsonl``: inner time of a round = its ``round_start`` -> the ``inner_progress``
with ``inner_step == H``; wall = first ``round_start`` -> last ``outer_step``; utilisation = inner time / wall, per
peer, then the mean of both peers. The window ends with the last sync, which overlap cannot hide (nothing is left
to train), so ``steady`` also shows inner time / (first -> last ``round_start``): whole rounds only, no drain.
``sync s/rd`` = mean ``allreduce_done.seconds`` (matchmaking included; failed attempts not counted); ``MB in/rd``
= ``bytes_received`` per round; ``MB/s`` = that / (``allreduce_running`` -> ``allreduce_done``, codec time
included), the inbound rate of the link, to check that the cap holds.
Eval runs only after the last round (outside the window), so what is not inner time is sync and outer-step work.

Usage (root: it creates namespaces): ``sudo .venv/bin/python -m benchmarks.utilization [--quick] [--rounds R]
[--inner-steps H] [--rate 100mbit] [--codecs none,int8] [--modes blocking,overlap] [--json PATH]``. ``--quick``
runs codecs none and int8 in both modes, 3 rounds (~3 min on 2 cores); the full run does every codec in both modes,
5 rounds (~10 min). The last line is ``utilization_overlap=<x>``: the int8 overlapped row (or the best overlapped
codec if int8 was not run; ``nan`` if none succeeded). A failed row prints its error and the script exits 1 at the
end (also when the measured rate exceeds the cap). Namespaces and every process started are removed on any
exit (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2p_diloco.metrics.events import Event
from p2p_diloco.outer.codecs import CODECS
from p2p_diloco.runtime.peer_process import PeerProcess, PeerStartError, stop_all

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.77.0"
MODEL = ["--set", "model.hidden_size=256", "--set", "model.num_layers=4", "--set", "model.intermediate_size=688"]
FAST = ["--set", "train.threads=1", "--set", "data.max_bytes=1500000", "--set", "eval.batches=2",
        "--set", "eval.every_rounds=1000000", "--set", "swarm.min_peers=2", "--set", "swarm.matchmaking_time=5.0",
        "--set", "swarm.request_timeout=2.0"]
QUICK_CODECS = ["none", "int8"]
HEADLINE_CODEC = "int8"


def sh(*cmd: str, check: bool = True) -> str:
    """Run an ``ip``/``tc`` command; raise with its stderr on failure (when ``check``)."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


class Net:
    """Two namespaces ``<a>``/``<b>`` joined by a veth pair, both ends shaped with tbf to ``rate``."""

    def __init__(self, rate: str):
        pid = os.getpid()
        self.ns = [f"p2pdutil-a-{pid}", f"p2pdutil-b-{pid}"]
        self.dev = [f"vu{pid}a", f"vu{pid}b"]
        self.ip = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.rate = rate
        self.created: list[str] = []

    def setup(self) -> None:
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.ns[0], "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1],
           "netns", self.ns[1])
        for ns, dev, ip in zip(self.ns, self.dev, self.ip):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
               "burst", "32kbit", "latency", "400ms")

    def pids(self) -> list[str]:
        return [pid for ns in self.created for pid in sh("ip", "netns", "pids", ns, check=False).split()]

    def kill_leftovers(self, wait: float = 0.0) -> int:
        """SIGKILL every process still inside our namespaces after ``wait`` s (torch_shm_manager, outside the peer's
        process group, deletes the peer's /dev/shm files a moment after the peer exits); returns how many."""
        deadline = time.monotonic() + wait
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        n = 0
        for ns in self.created:
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    n += 1
                except (ProcessLookupError, ValueError):
                    pass
        return n

    def teardown(self) -> None:
        self.kill_leftovers()
        time.sleep(0.2)
        for ns in reversed(self.created):
            sh("ip", "netns", "del", ns, check=False)  # deletes the veth pair with it
        self.created.clear()


def rate_mbytes(rate: str) -> float:
    """``100mbit`` -> 12.5 (MB/s); tc units kbit/mbit/gbit/bps."""
    units = {"gbit": 1e9 / 8, "mbit": 1e6 / 8, "kbit": 1e3 / 8, "bit": 1 / 8, "gbps": 1e9, "mbps": 1e6,
             "kbps": 1e3, "bps": 1.0}
    low = rate.lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return float(low[: -len(unit)]) * scale / 1e6
    return float(low) / 8e6


def spawn(net: Net, index: int, args: argparse.Namespace, sets: list[str], log_dir: Path,
          initial: list[str]) -> PeerProcess:
    """One ``join`` process in namespace ``index``, in its own process group (``ip netns exec`` execs it)."""
    cmd = ["join", "--host-maddrs", f"/ip4/{net.ip[index]}/tcp/0", "--run-id", f"util-{os.getpid()}",
           "--max-rounds", str(args.rounds), "--inner-steps", str(args.inner_steps), "--log-dir", str(log_dir),
           "--summary-json", str(log_dir / f"peer{index}.json"), *MODEL, *FAST, *sets]
    if initial:
        cmd += ["--initial-peers", *initial]
    if getattr(args, "data_seed", None) is not None:  # fixed data orders (overlap.py compares losses across runs)
        cmd += ["--data-seed", str(args.data_seed + index)]
    return PeerProcess(cmd, prefix=["ip", "netns", "exec", net.ns[index]], env={"P2P_DILOCO_INITIAL_PEERS": None},
                       cwd=REPO, stderr=log_dir / f"peer{index}.stderr.log")


def last_error(log_dir: Path, index: int) -> str:
    lines = [ln for ln in (log_dir / f"peer{index}.stderr.log").read_text().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no stderr)"])[-1].strip()[:300]


def run_peers(net: Net, args: argparse.Namespace, sets: list[str], log_dir: Path) -> list[PeerProcess]:
    """Start both peers, wait until they end (or the row times out), stop and sweep them whatever happens."""
    peers: list[PeerProcess] = []
    timeout = 120 + args.rounds * (args.inner_steps * 1.5 + 60)
    try:
        peers.append(spawn(net, 0, args, sets, log_dir, []))
        try:
            peers[0].wait_joined(120)
        except PeerStartError:
            raise RuntimeError(f"peer0 did not start: {last_error(log_dir, 0)}") from None
        peers.append(spawn(net, 1, args, sets, log_dir, peers[0].maddrs))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in peers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"row did not finish within {timeout:.0f}s")
            time.sleep(0.5)
        for index, p in enumerate(peers):
            if p.returncode != 0:
                raise RuntimeError(f"peer{index} exited {p.returncode}: {last_error(log_dir, index)}")
        return peers
    finally:
        stop_all(peers, grace=20)
        net.kill_leftovers(wait=10)


def peer_figures(events: list[dict], H: int) -> dict:
    """Utilisation and sync figures of one peer from its events (see the module docstring)."""
    starts = {e["round"]: e["t"] for e in events if e["event"] == Event.ROUND_START}
    ends = {e["round"]: e["t"] for e in events if e["event"] == Event.INNER_PROGRESS and e.get("inner_step") == H}
    outer = [e for e in events if e["event"] == Event.OUTER_STEP]
    done = [e for e in events if e["event"] == Event.ALLREDUCE_DONE and not e.get("lone")]
    if not starts or not outer:
        raise RuntimeError("no complete round in events.jsonl")
    t0, t1, t_last = min(starts.values()), max(e["t"] for e in outer), max(starts.values())
    inner = sum(min(ends[r], t1) - starts[r] for r in starts if r in ends and starts[r] < t1)
    steady = sum(ends[r] - starts[r] for r in starts if r in ends and ends[r] <= t_last)
    running = {}
    transfer = 0.0
    for e in events:
        if e["event"] == Event.ALLREDUCE_RUNNING:
            running[e["round"]] = e["t"]
        elif e["event"] == Event.ALLREDUCE_DONE and not e.get("lone") and e["round"] in running:
            transfer += e["t"] - running.pop(e["round"])
    received = sum(e["bytes_received"] for e in done)  # bytes_sent can miss a reply still draining (it is
    # counted after writer.drain() in fastpath.serve, and the stats may be read before that); received is exact
    return {"rounds": len(outer), "wall_s": t1 - t0, "inner_s": inner, "utilization": inner / (t1 - t0),
            "steady_utilization": steady / (t_last - t0) if t_last > t0 else None,
            "sync_s": sum(e["seconds"] for e in done), "syncs": len(done), "lone_steps": sum(
                1 for e in events if e["event"] == Event.ALLREDUCE_DONE and e.get("lone")),
            "bytes_received": received, "transfer_s": transfer,
            "mb_per_s": received / transfer / 1e6 if transfer else None}


def run_row(net: Net, args: argparse.Namespace, codec: str, mode: str, root: Path) -> dict:
    """One (codec, mode) run; returns its figures, or ``{"error": ...}`` if it failed."""
    row = {"codec": codec, "mode": mode}
    log_dir = root / f"{codec}-{mode}"
    log_dir.mkdir(parents=True)
    sets = ["--set", f"outer.compression={codec}"] + (["--set", "outer.overlap=true"] if mode == "overlap" else [])
    t = time.monotonic()
    try:
        peers = run_peers(net, args, sets, log_dir)
        figs = [peer_figures(p.events(log_dir), args.inner_steps) for p in peers]
    except Exception as e:  # a failed row is reported, the others still run
        return {**row, "error": str(e) if isinstance(e, RuntimeError) else repr(e), "log_dir": str(log_dir)}
    rates = [f["mb_per_s"] for f in figs if f["mb_per_s"]]
    rounds = max(f["rounds"] for f in figs)
    steady = [f["steady_utilization"] for f in figs if f["steady_utilization"] is not None]
    return {**row, "utilization": statistics.mean(f["utilization"] for f in figs),
            "steady_utilization": statistics.mean(steady) if steady else None,
            "solo_steps": sum(f["lone_steps"] for f in figs),
            "round_s": statistics.mean(f["wall_s"] for f in figs) / rounds,
            "inner_s_per_round": statistics.mean(f["inner_s"] for f in figs) / rounds,
            "sync_s_per_sync": statistics.mean(f["sync_s"] / max(f["syncs"], 1) for f in figs),
            "mb_in_per_round": statistics.mean(f["bytes_received"] for f in figs) / rounds / 1e6,
            "link_mb_per_s": max(rates) if rates else None, "peers": figs,
            "row_wall_s": time.monotonic() - t, "log_dir": str(log_dir)}


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['codec']:<6} {r['mode']:<9} FAILED: {r['error']}"
    mbs = f"{r['link_mb_per_s']:.2f}" if r["link_mb_per_s"] else "-"
    steady = f"{r['steady_utilization']:.3f}" if r["steady_utilization"] is not None else "-"
    per_peer = "/".join(f"{p['utilization']:.3f}" for p in r["peers"])
    solo = f"  ({r['solo_steps']} solo steps!)" if r["solo_steps"] else ""
    return (f"{r['codec']:<6} {r['mode']:<9} {r['utilization']:>6.3f} {per_peer:>13} {steady:>6} "
            f"{r['round_s']:>8.2f} {r['inner_s_per_round']:>8.2f} {r['sync_s_per_sync']:>9.2f} "
            f"{r['mb_in_per_round']:>8.2f} {mbs:>7} {r['row_wall_s']:>6.0f}{solo}")


HEADER = (f"{'codec':<6} {'mode':<9} {'util':>6} {'per peer':>13} {'steady':>6} {'round s':>8} {'inner s':>8} "
          f"{'sync s/rd':>9} {'MB in/rd':>8} {'MB/s':>7} {'run s':>6}")


def headline(rows: list[dict]) -> tuple[str, float]:
    """(codec, utilisation) of the overlapped row shown last: int8 if it ran, else the best overlapped codec."""
    ok = [r for r in rows if r["mode"] == "overlap" and "error" not in r]
    pick = [r for r in ok if r["codec"] == HEADLINE_CODEC] or sorted(ok, key=lambda r: -r["utilization"])[:1]
    return (pick[0]["codec"], pick[0]["utilization"]) if pick else ("-", float("nan"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"codecs {','.join(QUICK_CODECS)} only, fewer rounds")
    ap.add_argument("--rounds", type=int, help="rounds per run (default 3 with --quick, else 5)")
    ap.add_argument("--inner-steps", type=int, default=20, help="inner steps per round (H)")
    ap.add_argument("--rate", default="100mbit", help="tbf rate of each direction of the link (tc syntax)")
    ap.add_argument("--codecs", help=f"comma-separated subset of {','.join(CODECS)}")
    ap.add_argument("--modes", default="blocking,overlap", help="comma-separated subset of blocking,overlap")
    ap.add_argument("--json", help="write every row's figures to this JSON file")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.codecs = args.codecs.split(",") if args.codecs else (QUICK_CODECS if args.quick else list(CODECS))
    args.modes = args.modes.split(",")
    bad = [c for c in args.codecs if c not in CODECS] + [m for m in args.modes if m not in ("blocking", "overlap")]
    if bad:
        ap.error(f"unknown codec or mode: {', '.join(bad)}")
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def report(args: argparse.Namespace, rows: list[dict]) -> int:
    cap = rate_mbytes(args.rate)
    rates = [r["link_mb_per_s"] for r in rows if r.get("link_mb_per_s")]
    held = "yes" if rates and max(rates) <= 1.05 * cap else ("NO" if rates else "unknown")
    print(f"link cap {args.rate} = {cap:.2f} MB/s per direction; fastest measured transfer "
          f"{max(rates) if rates else float('nan'):.2f} MB/s; cap holds: {held}")
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"error in {r['codec']}/{r['mode']}: {r['error']} (logs: {r['log_dir']})", file=sys.stderr)
    codec, util = headline(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "headline_codec": codec,
                                               "utilization_overlap": util}, indent=2) + "\n")
    print(f"headline: overlapped sync with codec {codec} ({HEADLINE_CODEC} if it ran, else the best codec)"
          if codec != "-" else "headline: no overlapped row succeeded")
    print(f"utilization_overlap={util:.3f}", flush=True)
    return 1 if failed or held == "NO" else 0


def in_namespaces(rate: str, body, name: str) -> int:
    """Set up the two namespaces, run ``body(net)``, and remove them and every process in them whatever happens
    (Ctrl-C and SIGTERM included). Returns 0, 130 if interrupted, 1 if the network set-up failed."""
    net = Net(rate)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: it may start ignored (nohup, &)
        signal.signal(sig, _raise_interrupt)
    try:
        net.setup()
        body(net)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e or 'SIGINT'}): cleaning up", file=sys.stderr, flush=True)
        return 130
    except RuntimeError as e:  # the network set-up failed
        print(f"{name}: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not skip the cleanup
        net.teardown()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_interrupt)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("utilization.py: needs root (ip netns, tc); run it with sudo", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="p2p-diloco-util-"))
    print(f"{len(args.codecs) * len(args.modes)} runs: codecs {','.join(args.codecs)} x {','.join(args.modes)}; "
          f"{args.rounds} rounds of H={args.inner_steps}; link {args.rate}; logs in {root}", flush=True)
    rows: list[dict] = []

    def body(net: Net) -> None:
        print(HEADER, flush=True)
        for codec in args.codecs:
            for mode in args.modes:
                rows.append(run_row(net, args, codec, mode, root))
                print(format_row(rows[-1]), flush=True)

    rc = in_namespaces(args.rate, body, "utilization.py")
    if rc:
        return rc
    return report(args, rows)


if __name__ == "__main__":
    sys.exit(main())
