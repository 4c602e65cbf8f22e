"""Subprocess peers for swarm tests: each `p2p-diloco` process runs in its own session/process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from p2p_diloco.cli.launcher import parse_join_line
from p2p_diloco.metrics import read_events

TAG_VAR = "P2P_DILOCO_TEST_TAG"
# The default tiny model and H (~6 s per round on 2 cores) with a smaller corpus and shorter matchmaking waits.
FAST = ["--set", "eval.batches=4", "--set", "data.max_bytes=1500000",
        "--set", "swarm.matchmaking_time=5.0", "--set", "swarm.request_timeout=2.0", "--set", "train.threads=1"]


class Proc:
    """A `python -m p2p_diloco ...` subprocess with its stdout collected by a thread."""

    def __init__(self, args: list[str], tag: str, cwd: Path | None = None, prefix: list[str] | None = None,
                 python_args: list[str] | None = None, module: str = "p2p_diloco"):
        if "join" in args[:3] and "--host-maddrs" not in args:  # a peer listens on every interface by default
            at = args.index("join") + 1
            args = [*args[:at], "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args[at:]]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{TAG_VAR: tag})
        env.pop("P2P_DILOCO_INITIAL_PEERS", None)
        # prefix: e.g. ``ip netns exec NS`` (it execs the command, so the pid and process group stay ours);
        # python_args: e.g. ``-m torch.distributed.run --nproc-per-node 2`` (a cluster peer; see torchrun_args)
        # module: tests.swarm.faulty_peer for a peer with fault hooks (its own arguments come first)
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, *(python_args or []), "-m", module, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL, cwd=cwd)
        self.lines: list[str] = []
        self.err_lines: list[str] = []
        self.joined = threading.Event()
        self.join_maddrs: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            parsed = parse_join_line(line)
            if parsed and not self.joined.is_set():
                self.join_maddrs = parsed[0]
                self.joined.set()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err_lines.append(line)

    @property
    def peer_id(self) -> str:
        return self.join_maddrs[0].rsplit("/p2p/", 1)[-1]

    def wait_joined(self, timeout: float = 90.0) -> list[str]:
        if not self.joined.wait(timeout):
            raise AssertionError(f"no join line within {timeout}s; stderr:\n{self.stderr_tail()}")
        return self.join_maddrs

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process still running after {timeout}s; stderr:\n{self.stderr_tail()}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill_group(self) -> None:
        self.signal_group(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """Signal the peer's whole process group (python, DHT, averager, p2pd), as a crash or freeze would."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stderr_tail(self, n: int = 40) -> str:
        return "".join(self.err_lines[-n:])


def wait_for_event(path: Path, predicate, timeout: float, proc: Proc | None = None) -> dict:
    """Poll an events.jsonl file until an event satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in read_events(path):
            if predicate(ev):
                return ev
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.proc.returncode}); stderr:\n{proc.stderr_tail()}")
        time.sleep(0.5)
    raise AssertionError(f"no matching event in {path} within {timeout}s")


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def eval_by_round(events: list[dict]) -> dict[int, float]:
    return {e["round"]: e["loss"] for e in events if e["event"] == "eval"}


# Fault tests: short rounds, and timeouts small enough that a lost peer costs seconds, not minutes.
FAULT = [*FAST, "--inner-steps", "20", "--set", "swarm.allreduce_timeout=20", "--set", "swarm.next_chunk_timeout=5",
         "--set", "swarm.part_size_bytes=16384"]


def events_of(log_dir: Path, proc: Proc) -> list[dict]:
    return read_events(log_dir / proc.peer_id / "events.jsonl")


def torchrun_args(ranks: int) -> list[str]:
    """Python arguments that run ``-m p2p_diloco`` as a peer of ``ranks`` local ranks (CPU, gloo)."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []


def start_peers(n: int, log_dir: Path, tag: str, run_id: str, rounds: int, extra: dict[int, list[str]] | None = None,
                min_peers: int | None = None, ranks: dict[int, int] | None = None) -> list[Proc]:
    """``n`` join processes of one run; peer 0 starts the swarm, the rest join it; all wait for ``min_peers``.
    ``ranks``: {peer index: local ranks} for peers launched with torchrun."""
    extra, ranks = extra or {}, ranks or {}
    common = ["--run-id", run_id, "--max-rounds", str(rounds), "--log-dir", str(log_dir),
              "--set", f"swarm.min_peers={min_peers or n}", *FAULT]
    first = Proc(["join", *common, "--summary-json", str(log_dir / "p0.json"), *extra.get(0, [])], tag,
                 python_args=torchrun_args(ranks.get(0, 1)))
    maddrs = first.wait_joined()
    procs = [first]
    for i in range(1, n):
        procs.append(Proc(["join", "--initial-peers", *maddrs, *common, "--summary-json", str(log_dir / f"p{i}.json"),
                           *extra.get(i, [])], tag, python_args=torchrun_args(ranks.get(i, 1))))
    for p in procs:
        p.wait_joined()
    return procs


def digests_by_round(log_dir: Path, procs: list[Proc]) -> dict[int, set[str]]:
    """Every digest each peer held after each round (from outer steps and state loads)."""
    out: dict[int, set[str]] = {}
    for p in procs:
        for e in events_of(log_dir, p):
            if e["event"] in ("outer_step", "state_loaded"):
                out.setdefault(e["round"], set()).add(e["digest"])
    return out
