"""``p2p-diloco swarm``: N ``join`` processes on 127.0.0.1, progress on the terminal, a table at the end.

Each peer runs in its own process group (its python, DHT and averager processes), so the group can be killed as a
unit: nothing is left behind after a normal end, a peer crash, or Ctrl-C. (Each p2pd runs in a group of its own and
dies with the DHT process that started it: :mod:`p2p_diloco.swarm.starting`.)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .live import SWARM_REFRESH, SwarmView
from .plot import plot_if_available
from .util import write_json_atomic
from ..errors import RunError
from ..metrics import short_id
from ..runtime.signals import Interrupted, interrupted_exit_code
from ..runtime.peer_process import JOIN_LINE, PeerProcess, PeerStartError, parse_join_line, stop_all

if TYPE_CHECKING:
    from ..swarm.planned import PlannedPeer

__all__ = ["JOIN_LINE", "STARTUP_TIMEOUT", "STOP_GRACE", "cmd_swarm", "format_table", "parse_join_line",
           "stop_peers"]

STARTUP_TIMEOUT = 120.0
STOP_GRACE = 40.0


def _join_args(args: argparse.Namespace, index: int, log_dir: Path, first: PlannedPeer) -> list[str]:
    threads = max(1, (os.cpu_count() or 1) // args.peers)
    # peer 0 listens at the address planned for it; the others start at the same time and keep trying it
    where = first.join_args() if index == 0 else ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--initial-peers",
                                                    first.maddr, "--initial-peers-wait", str(STARTUP_TIMEOUT)]
    cmd = ["join", *where,
           "--log-dir", str(log_dir), "--summary-json", str(_summary_path(log_dir, index)),
           "--set", f"train.threads={threads}", "--set", f"swarm.min_peers={args.peers}"]
    if args.config:
        cmd += ["--config", args.config]
    for item in args.sets:
        cmd += ["--set", item]
    for flag in ("run_id", "max_rounds", "inner_steps"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    delays = getattr(args, "debug_step_delay", None)
    if delays:
        cmd += ["--debug-step-delay", str(delays[index] if len(delays) > 1 else delays[0])]
    if getattr(args, "data_seed", None) is not None:  # reproducible runs, still a different order per peer
        cmd += ["--data-seed", str(args.data_seed + index)]
    return cmd


def _summary_path(log_dir: Path, index: int) -> Path:
    return log_dir / f"peer{index}.summary.json"


def _spawn(args: argparse.Namespace, index: int, log_dir: Path, first: PlannedPeer) -> PeerProcess:
    # -P: the user's working directory stays off the peers' import path (a stray grp.py there broke every peer)
    return PeerProcess(_join_args(args, index, log_dir, first), python_args=("-P",),
                       stderr=log_dir / f"peer{index}.stderr.log")


def stop_peers(peers: list[PeerProcess], grace: float = STOP_GRACE) -> None:
    """Ask every peer to stop (SIGTERM to its main process), then kill each whole process group
    (:func:`p2p_diloco.runtime.peer_process.stop_all`)."""
    stop_all(peers, grace)


def _start_all(args: argparse.Namespace, log_dir: Path, peers: list[PeerProcess]) -> None:
    """Start every peer at once: peer 0 at an address planned for it (:mod:`p2p_diloco.swarm.planned`), the
    others joining it; then wait for peer 0's join line. ``peers`` gets each one as it starts (so that whatever
    was started is stopped, even if this is interrupted)."""
    from ..swarm.planned import plan_peer

    first = plan_peer(log_dir)
    for i in range(args.peers):
        peers.append(_spawn(args, i, log_dir, first))
    try:
        peers[0].wait_joined(STARTUP_TIMEOUT)
    except PeerStartError as e:
        lines = [line for line in str(e).splitlines()[1:] if line.strip()]  # the stderr tail: its last line says why
        why = f": {lines[-1].strip()}" if lines else ""
        raise RunError(f"peer0 did not start{why} (see {log_dir / 'peer0.stderr.log'})") from None


def _summaries(peers: list[PeerProcess], log_dir: Path) -> list[dict]:
    out = []
    for index, p in enumerate(peers):
        try:
            s = json.loads(_summary_path(log_dir, index).read_text())
        except (OSError, json.JSONDecodeError):
            s = {"peer_id": p.peer_id, "rounds_completed": None, "global_digest": None}
        s["exit_code"] = p.returncode
        out.append(s)
    return out


def format_table(summaries: list[dict]) -> str:
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    rows = [f"{'peer':<10} {'rounds':>6} {'eval loss first->last':>22} {'tokens':>10} {'MB sent':>8} "
            f"{'MB recv':>8} {'digest':<14} exit"]
    for s in summaries:
        loss = f"{f(s.get('eval_loss_first'), '.4f')} -> {f(s.get('eval_loss_last'), '.4f')}"
        rows.append(
            f"{short_id(s.get('peer_id')):<10} {f(s.get('rounds_completed'), 'd'):>6} {loss:>22} "
            f"{f(s.get('tokens_trained'), ',d'):>10} {f((s.get('bytes_sent') or 0) / 1e6, '.2f'):>8} "
            f"{f((s.get('bytes_received') or 0) / 1e6, '.2f'):>8} {(s.get('global_digest') or '-')[:12]:<14} "
            f"{s.get('exit_code')}"
        )
    return "\n".join(rows)


def _interrupt_on(*signals: int) -> None:
    """Turn these signals into KeyboardInterrupt, whatever we inherited: a launcher started in the background by
    a non-interactive shell inherits SIGINT *ignored* (seen: Ctrl-C's SIGINT then did nothing), and SIGTERM's
    default action would kill us without stopping the peers, which live in their own sessions."""

    def handler(signum, frame):
        raise Interrupted(signum)

    for sig in signals:
        signal.signal(sig, handler)


def cmd_swarm(args: argparse.Namespace) -> int:
    from .parser import load_join_config

    from ..errors import UsageError

    if args.peers < 1:
        raise UsageError("--peers must be >= 1")
    delays = args.debug_step_delay or []
    if len(delays) not in (0, 1, args.peers) or any(d < 0 for d in delays):
        raise UsageError(f"--debug-step-delay takes one value >= 0, or one per peer ({args.peers}), got {delays}")
    load_join_config(argparse.Namespace(**{**vars(args), "initial_peers": None}))  # fail fast on bad config
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="p2p-diloco-swarm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"swarm of {args.peers} peers; logs in {log_dir}", flush=True)
    peers: list[PeerProcess] = []
    interrupted: int | None = None  # the signal that stopped us
    _interrupt_on(signal.SIGINT, signal.SIGTERM)
    try:
        _start_all(args, log_dir, peers)
        print("  join this swarm with: " + " ".join(shlex.quote(a) for a in
              ["p2p-diloco", "join", "--initial-peers", *peers[0].maddrs, "--run-id", peers[0].run_id or ""]),
              flush=True)  # all a joiner needs: it adopts the run's config (cli/adopt.py)
        with SwarmView(peers, log_dir) as view:  # rows updated in place on a terminal, plain lines otherwise
            while any(p.poll() is None for p in peers):
                time.sleep(SWARM_REFRESH)
                view.update()
    except KeyboardInterrupt as e:
        interrupted = getattr(e, "signum", signal.SIGINT)
        print("interrupted: stopping every peer", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        stop_peers(peers)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    summaries = _summaries(peers, log_dir)
    digests = {s.get("global_digest") for s in summaries}
    all_equal = len(digests) == 1 and None not in digests
    print(format_table(summaries))
    print(f"all digests agree: {'yes' if all_equal else 'NO'}", flush=True)
    if args.summary_json:
        write_json_atomic(args.summary_json, {"peers": summaries, "all_digests_equal": all_equal})
    if (png := plot_if_available(log_dir)) is not None:  # matplotlib is optional
        print(f"plot: {png}", flush=True)
    if interrupted is not None:  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        return interrupted_exit_code(interrupted)
    failed = any(s["exit_code"] != 0 for s in summaries) or len(summaries) < args.peers
    return 1 if failed or not all_equal else 0
