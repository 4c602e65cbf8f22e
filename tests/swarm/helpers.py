"""Subprocess peers for swarm tests: each `p2p-diloco` process runs in its own session/process group."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from p2p_diloco.metrics import read_events
from p2p_diloco.metrics.events import Event
from p2p_diloco.runtime.peer_process import PeerProcess, PeerStartError, child_env
from p2p_diloco.swarm.planned import plan_peer
from tests import zygote

TAG_VAR = "P2P_DILOCO_TEST_TAG"
# The default tiny model and H (~6 s per round on 2 cores) with a smaller corpus and shorter matchmaking waits.
FAST = ["--set", "eval.batches=4", "--set", "data.max_bytes=1500000",
        "--set", "swarm.matchmaking_time=5.0", "--set", "swarm.request_timeout=2.0", "--set", "train.threads=1"]


def _netns_of(prefix: list[str] | None) -> str | None:
    """The namespace of an ``ip netns exec NAME`` prefix (which a zygote's child can enter itself), else None."""
    if prefix and len(prefix) == 4 and list(prefix[:3]) == ["ip", "netns", "exec"]:
        return prefix[3]
    return None


class Proc(PeerProcess):
    """A `python -m p2p_diloco ...` subprocess of a test: tagged (``TAG_VAR``, for the ``reap`` fixture), stdout and
    stderr collected by threads, and failures raised as AssertionError with the stderr tail.

    Args:
        args: the module's arguments; a ``join`` without ``--host-maddrs`` listens on 127.0.0.1 only.
        tag: the test's tag (the ``reap`` fixture).
        cwd: working directory.
        prefix: e.g. ``ip netns exec NS`` (it execs the command, so the pid and process group stay ours; a process
            forked from the zygote enters namespace NS itself).
        python_args: e.g. ``-m torch.distributed.run --nproc-per-node 2`` (a cluster peer; see torchrun_args).
        module: tests.swarm.faulty_peer for a peer with fault hooks (its own arguments come first).
        fork: forked from the test process's zygote when it can be (tests/zygote.py: the imports done); False starts
            the process itself, for a test of what happens while it imports.
    """

    def __init__(self, args: list[str], tag: str, cwd: Path | None = None, prefix: list[str] | None = None,
                 python_args: list[str] | None = None, module: str = "p2p_diloco", fork: bool = True):
        if "join" in args[:3] and "--host-maddrs" not in args:  # a peer listens on every interface by default
            at = args.index("join") + 1
            args = [*args[:at], "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args[at:]]
        netns = _netns_of(prefix)
        self._fork = (module, list(args), tag, netns) if fork and (not prefix or netns) and not python_args else None
        super().__init__(args, module=module, python_args=python_args or (), prefix=prefix or (), cwd=cwd,
                         env={TAG_VAR: tag, "P2P_DILOCO_INITIAL_PEERS": None})

    def _start(self, extra_env, cwd, stdin, log_command):
        """From the test process's zygote (tests/zygote.py) when there is one and it can run this command."""
        if self._fork is None or log_command:
            return super()._start(extra_env, cwd, stdin, log_command)
        module, args, tag, netns = self._fork
        err = open(self.stderr_path, "w") if self.stderr_path is not None else None
        try:
            child = zygote.spawn(module, args, child_env(extra_env), tag, cwd=cwd, stdin=stdin, stderr=err,
                                 netns=netns)
        finally:
            if err is not None:
                err.close()
        return child if child is not None else super()._start(extra_env, cwd, stdin, log_command)

    @property
    def join_maddrs(self) -> list[str]:
        """The join line's multiaddrs (empty before it)."""
        return self.maddrs

    def wait_joined(self, timeout: float = 90.0) -> list[str]:
        try:
            return super().wait_joined(timeout)
        except PeerStartError as e:
            raise AssertionError(str(e)) from None

    def wait(self, timeout: float | None = None) -> int:
        try:
            return super().wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process still running after {timeout}s; stderr:\n{self.stderr_tail()}\n"
                                 f"where its threads are:\n{python_stacks(self.pid)}") from None


def python_stacks(pid: int) -> str:
    """Every thread's Python stack in a running process (``py-spy dump``): what a test that found a process stuck
    reports, so that a rare hang can be told from a slow exit."""
    try:
        out = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=30)
        return out.stdout or out.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(py-spy could not tell: {e!r})"


def wait_for_event(path: Path, predicate, timeout: float, proc: Proc | None = None) -> dict:
    """Poll an events.jsonl file until an event satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in read_events(path):
            if predicate(ev):
                return ev
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}); stderr:\n{proc.stderr_tail()}")
        time.sleep(0.5)
    raise AssertionError(f"no matching event in {path} within {timeout}s")


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def eval_by_round(events: list[dict]) -> dict[int, float]:
    return {e["round"]: e["loss"] for e in events if e["event"] == Event.EVAL}


# Fault tests: short rounds, and timeouts small enough that a lost peer costs seconds, not minutes.
# A lone peer confirms for a record lifetime (peer_ttl + one heartbeat, 7 s by default) that no round-mate is live
# before every solo step: a short lifetime keeps tests of one peer short.
LONE = ["--set", "swarm.peer_ttl=2", "--set", "swarm.heartbeat_period=0.5"]
FAULT = [*FAST, "--inner-steps", "20", "--set", "swarm.allreduce_timeout=20", "--set", "swarm.next_chunk_timeout=5",
         "--set", "swarm.part_size_bytes=16384"]


def events_of(log_dir: Path, proc: Proc) -> list[dict]:
    return proc.events(log_dir)


def torchrun_args(ranks: int) -> list[str]:
    """Python arguments that run ``-m p2p_diloco`` as a peer of ``ranks`` local ranks (CPU, gloo)."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []


def planned_first(directory: Path) -> tuple[list[str], list[str]]:
    """Peer 0's address fixed before it starts (p2p_diloco/swarm/planned.py, as ``p2p-diloco swarm`` does), so that
    its joiners start with it: ``(peer 0's join arguments, a joiner's: --initial-peers and --initial-peers-wait)``."""
    directory.mkdir(parents=True, exist_ok=True)
    first = plan_peer(directory)
    return first.join_args(), ["--initial-peers", first.maddr, "--initial-peers-wait", "90"]


def start_peers(n: int, log_dir: Path, tag: str, run_id: str, rounds: int, extra: dict[int, list[str]] | None = None,
                min_peers: int | None = None, ranks: dict[int, int] | None = None) -> list[Proc]:
    """``n`` join processes of one run, started at once: peer 0 starts the swarm at a planned address, the rest
    join it; all wait for ``min_peers``. ``ranks``: {peer index: local ranks} for peers launched with torchrun."""
    extra, ranks = extra or {}, ranks or {}
    common = ["--run-id", run_id, "--max-rounds", str(rounds), "--log-dir", str(log_dir),
              "--set", f"swarm.min_peers={min_peers or n}", *FAULT]
    first_args, joining = planned_first(log_dir)
    procs = [Proc(["join", *(first_args if i == 0 else joining), *common, "--summary-json",
                   str(log_dir / f"p{i}.json"), *extra.get(i, [])], tag, python_args=torchrun_args(ranks.get(i, 1)))
             for i in range(n)]
    for p in procs:
        p.wait_joined()
    return procs


def digests_by_round(log_dir: Path, procs: list[Proc]) -> dict[int, set[str]]:
    """Every digest each peer held after each round (from outer steps and state loads)."""
    out: dict[int, set[str]] = {}
    for p in procs:
        for e in events_of(log_dir, p):
            if e["event"] in (Event.OUTER_STEP, Event.STATE_LOADED):
                out.setdefault(e["round"], set()).add(e["digest"])
    return out
