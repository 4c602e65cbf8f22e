"""A malicious peer in a 4-peer swarm: the honest peers' final eval loss per attack and aggregation method.

Every arm runs 4 real peers (``p2p-diloco join`` subprocesses on 127.0.0.1) with fixed data seeds, so the honest
peers see the same data in every arm; in all but the ``honest`` arms peer 3 sends a corrupted pseudo-gradient every
round (``--debug-corrupt-pseudo-gradient``; ``inverse:9.9`` sends its own pseudo-gradient negated and 9.9x as
large: just under the norm bound, the insider's best guess of the negated honest direction). Reported per arm:
the final eval loss of the global weights (one value: θ is bit-identical on every peer, checked), its ratio to
the honest-only ``mean`` run, and the number of ``contribution_excluded`` events. The ``scale:1000 / no bound``
arm turns validation off (``outer.norm_bound=0``) to show what the defence is for. ``train.total_steps`` is
rounds x H: the inner lr decays over the run.

Every arm names its ``outer.aggregation`` (the default is ``trimmed_mean``); the baseline of every ratio is the
honest-only ``mean`` run (the plain average: the cost of a robust method counts too).

The line before the last: ``loss_over_honest=<the largest ratio over the defended arms>``; the last line:
``worst_loss_over_honest=<the largest ratio over the attack arms run with the default settings>``.

Usage: ``python -m benchmarks.attacks`` (14 arms, about 30 s each on 2 cores); ``--quick`` runs 5 of them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from p2p_diloco.metrics import read_events
from p2p_diloco.outer.aggregation import Policy
from p2p_diloco.metrics.events import Event
from p2p_diloco.runtime.peer_process import PeerProcess, PeerStartError, stop_all

DEFAULT = Policy().method  # outer.aggregation's default: trimmed_mean


def _arm(corruption: str, method: str) -> tuple[str, str, list[str]]:
    """(name, corruption of peer 3 or "", --set items for every peer); ``method`` "no bound": the default method
    with validation off."""
    sets = ["outer.norm_bound=0"] if method == "no bound" else [f"outer.aggregation={method}"]
    return f"{corruption or 'honest'} / {method}", corruption, sets


ARMS = [_arm(corruption, method) for corruption, method in [
    ("", "mean"), ("", DEFAULT), ("", "centered_clip"),
    ("nan", DEFAULT), ("scale:1000", "no bound"), ("scale:1000", DEFAULT), ("scale:1000", "mean"),
    ("scale:1000", "centered_clip"), ("random", DEFAULT), ("random", "mean"), ("random", "centered_clip"),
    ("inverse:9.9", DEFAULT), ("inverse:9.9", "mean"), ("inverse:9.9", "centered_clip")]]
QUICK = {"honest / mean", f"nan / {DEFAULT}", "scale:1000 / no bound", f"random / {DEFAULT}",
         f"inverse:9.9 / {DEFAULT}"}
COMMON = ["--set", "eval.batches=4", "--set", "data.max_bytes=1500000", "--set", "swarm.matchmaking_time=5.0",
          "--set", "swarm.request_timeout=2.0", "--set", "train.threads=1", "--set", "swarm.min_peers=4"]


def _run_peers(procs: list[PeerProcess], index: int, corruption: str, run: list[str], out: Path) -> None:
    """Start the arm's four peers (``procs`` gets each as it starts) and wait until they all exit 0."""
    maddrs = None
    for i in range(4):
        extra = ["--data-seed", str(i)] + (["--debug-corrupt-pseudo-gradient", corruption] if corruption and i == 3
                                           else [])
        procs.append(PeerProcess(["join", *run, *extra, *(["--initial-peers", *maddrs] if maddrs else [])],
                                 stderr=out / f"arm{index}-p{i}.log"))
        try:
            procs[-1].wait_joined(120)
        except PeerStartError:
            raise SystemExit(f"arm {index}: peer {i} did not start; see {out}") from None
        maddrs = maddrs or list(procs[-1].maddrs)
    for i, proc in enumerate(procs):
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"arm {index}: peer {i} failed; see {out / f'arm{index}-p{i}.log'}")


def run_arm(index: int, corruption: str, sets: list[str], args: argparse.Namespace, out: Path) -> dict:
    """Four peers of one run; returns the final eval loss and the exclusions seen."""
    log_dir = out / f"arm{index}"
    run = ["--run-id", f"attacks-{index}-{int(time.time())}", "--max-rounds", str(args.rounds), "--inner-steps",
           str(args.h), "--set", f"train.total_steps={args.rounds * args.h}",  # cosine decay over the run
           "--log-dir", str(log_dir), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *COMMON]
    for item in sets:
        run += ["--set", item]
    procs: list[PeerProcess] = []
    try:
        _run_peers(procs, index, corruption, run, out)
    finally:
        stop_all(procs, grace=30)
    finals, excluded = set(), 0
    for events_file in log_dir.glob("*/events.jsonl"):
        events = read_events(events_file)
        finals.add(max((e["round"], e["loss"]) for e in events if e["event"] == Event.EVAL)[1])
        excluded += sum(e["event"] == Event.CONTRIBUTION_EXCLUDED for e in events)
    if len(finals) != 1:
        raise SystemExit(f"arm {index}: peers ended with different eval losses {finals}")
    return {"loss": finals.pop(), "excluded": excluded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--h", type=int, default=20, help="inner steps per round")
    parser.add_argument("--quick", action="store_true", help="5 arms instead of 14")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="attacks-"))
    arms = [a for a in ARMS if not args.quick or a[0] in QUICK]
    results = {}
    for index, (name, corruption, sets) in enumerate(arms):
        results[name] = run_arm(index, corruption, sets, args, out)
        print(f"{name:28s} final eval loss {results[name]['loss']:.4f}  exclusions {results[name]['excluded']}",
              flush=True)
    honest = results["honest / mean"]["loss"]
    print("\n| arm | final eval loss | / honest mean | exclusions |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['loss']:.4f} | {r['loss'] / honest:.3f} | {r['excluded']} |")
    defended = [r["loss"] / honest for name, r in results.items() if "no bound" not in name]
    print(f"loss_over_honest={max(defended):.4f}")
    defaults = [r["loss"] / honest for name, r in results.items() if name.endswith(f"/ {DEFAULT}") and
                not name.startswith("honest")]  # every attack arm run with the default settings
    print(f"worst_loss_over_honest={max(defaults):.4f}")


if __name__ == "__main__":
    main()
