"""Workers of ``benchmarks.allreduce``: one process per peer, driven by the parent over stdin/stdout.

The parent starts one worker per peer (``python -m benchmarks.allreduce --worker ...``) and sends it one JSON
command per line; the worker answers every command with one JSON line on stdout (``{"event": <command>, "ok": ...,
...}``) and, when it exits, prints one last line ``{"event": "timings", "timings": [...]}`` with every timing it
measured. Commands:

* ``gloo``: rendezvous (not timed), one warm-up all-reduce, a barrier, then ``repeats`` timed all-reduces.
* ``dht``: start this peer's ``hivemind.DHT`` (joining ``initial_peers``); answers its visible maddrs.
* ``averager``: start a stock ``DecentralizedAverager`` (``kind="stock"``) or our ``ExactAverager`` with a codec.
* ``commit``: one commit step's signature exchange among all workers (and the outer step's cost): see
  ``benchmarks/_commit_cost.py``.
* ``step``: restore the original tensors, set the round's group bits (ours), wait for the wall-clock time ``at``,
  start one averaging step and time it (see :func:`timed_step`).
* ``close``: shut the averager down. ``exit``: shut everything down and leave.

The parent's side is :class:`Peer` (a :class:`~p2p_diloco.runtime.peer_process.PeerProcess`: own session, stderr to
a log, the whole process group killed at the end), :func:`call_all` and the sweep of processes that left their group
(:func:`sweep`). Heavy imports (torch, hivemind, the training code) happen inside the worker's functions, so the
parent that imports this module never loads them.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from p2p_diloco.runtime.peer_process import PeerProcess

SPLIT = (0.5, 0.25, 0.15, 0.10)  # share of the payload in each tensor (a model has a few tensors of unequal size)
STEP_TIMEOUT = 60.0  # matchmaking timeout given to averager.step
STEP_DEADLINE = 150.0  # the worker gives up on a step after this long (the parent waits 180 s)
POLL_S = 0.001
TAG_VAR = "P2P_DILOCO_ALLREDUCE_BENCH"  # inherited by every process we start: the orphan sweep finds them by it
REPO = Path(__file__).resolve().parent.parent


def make_tensors(rank: int, mb: float, seed: int) -> list:
    """The payload of peer ``rank``: ``mb`` MB (10^6 bytes) of fp32 in ``len(SPLIT)`` tensors, seeded per peer."""
    import torch

    numel = int(mb * 1e6 / 4)
    sizes = [int(numel * share) for share in SPLIT[:-1]]
    sizes.append(numel - sum(sizes))
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randn(n, generator=gen) for n in sizes]


def expected_mean(peers: int, mb: float, seed: int) -> list:
    """The exact average of every peer's payload (to check that a method really averaged)."""
    total = make_tensors(0, mb, seed)
    for rank in range(1, peers):
        for acc, t in zip(total, make_tensors(rank, mb, seed)):
            acc.add_(t)
    return [t.div_(peers) for t in total]


def expected_aggregate(peers: int, mb: float, seed: int) -> list:
    """What our averager's reducers compute from every peer's payload with the default ``outer.aggregation``
    (trimmed_mean: coordinate-wise, so reducing slice by slice gives the same values)."""
    from p2p_diloco.outer.aggregation import Contribution, Policy, combine

    payloads = [make_tensors(rank, mb, seed) for rank in range(peers)]
    return [combine([Contribution(rank, t, 1.0) for rank, t in enumerate(ts)], Policy()) for ts in zip(*payloads)]


def max_error(tensors, reference) -> float:
    """Largest absolute difference between two lists of tensors."""
    return max(float((a - b).abs().max()) for a, b in zip(tensors, reference))


def emit(**fields) -> None:
    """One JSON line to the parent."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def sleep_until(wall_time: float) -> None:
    """Sleep until ``time.time() >= wall_time`` (returns at once if it has passed)."""
    while (left := wall_time - time.time()) > 0:
        time.sleep(min(left, 0.05) if left > 0.06 else left)


def timed_step(averager, step_kwargs: dict) -> dict:
    """Start ``averager.step(wait=False, ...)`` and poll its StepControl every millisecond.

    Returns:
        ``total_s`` (step call -> done, matchmaking included), ``data_s`` (``began_allreduce`` seen -> done: the
        all-reduce itself, plus hivemind's load balancing and the copy into the averaged tensors), and the step's
        result (raises whatever the step raised).
    """
    t_call = time.perf_counter()
    control = averager.step(wait=False, timeout=STEP_TIMEOUT, **step_kwargs)
    t_begin, deadline = None, t_call + STEP_DEADLINE
    while True:
        if t_begin is None and control.began_allreduce:
            t_begin = time.perf_counter()
        if control.done():
            break
        if time.perf_counter() > deadline:  # stock hivemind has no all-reduce timeout of its own
            control.cancel()
            raise TimeoutError(f"step not done after {STEP_DEADLINE:.0f} s")
        time.sleep(POLL_S)
    t_end = time.perf_counter()
    began = control.began_allreduce
    result = control.result()  # raises on failure
    data_s = t_end - (t_begin if t_begin is not None else t_end)  # began and finished within one poll
    return {"total_s": t_end - t_call, "data_s": data_s if began else None, "result": result}


class Peer(PeerProcess):
    """One worker process (``python -m benchmarks.allreduce --worker ...``, in its own session) and the JSON lines
    it prints.

    Args:
        rank: the worker's rank.
        args: the worker's arguments (``--worker RANK ...``).
        env: variables added to the environment (the sweep's tag).
        log: the worker's stderr.
        prefix: a command that execs the worker, e.g. ``py-spy record ... --``.
    """

    def __init__(self, rank: int, args: list[str], env: dict, log: Path, prefix: Sequence[str] = ()):
        self.rank, self.log, self.messages = rank, log, queue.Queue()
        super().__init__(args, module="benchmarks.allreduce", prefix=prefix, env=env, cwd=REPO, stderr=log,
                         stdin=True)

    def on_line(self, line: str) -> None:
        """Reader thread: queue the worker's JSON lines."""
        if line.startswith("{"):
            self.messages.put(json.loads(line))

    def on_eof(self) -> None:
        self.messages.put(None)

    def send(self, **command) -> None:
        """Write one command line to the worker's stdin."""
        self.write_line(json.dumps(command))

    def expect(self, event: str, timeout: float) -> dict:
        """The next line of type ``event`` (raises if the worker exits or is silent for ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"worker {self.rank}: no {event!r} in {timeout:.0f} s (log: {self.log})") from None
            if msg is None:
                raise RuntimeError(f"worker {self.rank} exited (rc={self.wait()}); log: {self.log}")
            if msg.get("event") == event:
                return msg


def call_all(peers: list[Peer], timeout: float, **command) -> list[dict]:
    """Send ``command`` to every worker and collect the answers; raise if a command (not a step) failed."""
    for p in peers:
        p.send(**command)
    answers = [p.expect(command["cmd"], timeout) for p in peers]
    bad = [a for a in answers if not a["ok"]]
    if bad and command["cmd"] != "step":
        raise RuntimeError(f"{command['cmd']} failed: " + "; ".join(f"rank {a['rank']}: {a['error']}" for a in bad))
    return answers


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep(tag: str) -> list[str]:
    """SIGKILL any live process still carrying our tag (one that left its process group); returns them."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.pid != os.getpid() \
                    and proc.environ().get(TAG_VAR) == tag:
                proc.kill()
                found.append(f"{proc.pid}:{proc.info['name']}:{os.getpgid(proc.pid)}")
        except psutil.Error:
            pass
    return found


@dataclass
class Worker:
    """One peer: its payload, and the DHT / averager it runs."""

    rank: int
    peers: int
    mb: float
    seed: int
    verify: bool
    originals: list = field(default_factory=list)
    reference: list | None = None  # the exact mean; only rank 0 holds it (verification is rank 0's job)
    aggregate: list | None = None  # what our reducers compute with the default aggregation (rank 0 too)
    dht: object = None
    swarm: object = None  # the DHT with Swarm's blob methods (the commit step)
    averager: object = None
    kind: str = ""
    timings: list = field(default_factory=list)

    def __post_init__(self):
        import torch

        from p2p_diloco.runtime.processes import keep_freed_memory

        torch.set_num_threads(1)  # N peers share the machine's cores
        # The allocator setting a p2p-diloco peer runs with (Swarm.start), applied to the whole worker before any
        # method runs, so gloo, stock hivemind and ours are timed with the same allocator.
        keep_freed_memory()
        self.originals = make_tensors(self.rank, self.mb, self.seed)
        if self.verify and self.rank == 0:
            self.reference = expected_mean(self.peers, self.mb, self.seed)
            self.aggregate = expected_aggregate(self.peers, self.mb, self.seed)

    def cmd_gloo(self, port: int, repeats: int) -> dict:
        """Time ``repeats`` gloo all-reduces of the payload (one all_reduce per tensor, summed)."""
        from torch import distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                world_size=self.peers)
        try:
            bufs = [t.clone() for t in self.originals]
            for b in bufs:  # warm-up (connections, buffers)
                dist.all_reduce(b)
            dist.barrier()
            times, cpu0 = [], sum(os.times()[:2])
            for _ in range(repeats):
                for b, t in zip(bufs, self.originals):
                    b.copy_(t)
                dist.barrier()
                t0 = time.perf_counter()
                for b in bufs:
                    dist.all_reduce(b)
                times.append(time.perf_counter() - t0)
            cpu = (sum(os.times()[:2]) - cpu0) / repeats  # includes the copies and barriers
            err = max_error([b / self.peers for b in bufs], self.reference) if self.reference else None
        finally:
            dist.destroy_process_group()
        self.timings.append({"method": "gloo", "times": times})
        return {"times": times, "max_err": err, "cpu": cpu}

    def cmd_dht(self, initial_peers: list) -> dict:
        """Start the DHT, with a peer's identity and record validators (as ``Swarm`` does); answer its visible
        multiaddrs and peer id."""
        import hivemind

        from benchmarks._commit_cost import BareSwarm, dht_options

        identity, options = dht_options()
        self.dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=initial_peers or None, **options)
        self.swarm, self.identity = BareSwarm(self.dht, identity), identity
        return {"maddrs": [str(m) for m in self.dht.get_visible_maddrs()], "dht_pid": self.dht.pid,
                "peer_id": identity.peer_id}

    def cmd_commit(self, at: float, round: int, members: list, outer: bool = False) -> dict:
        """At ``at``, one commit step's signature exchange with ``members`` (benchmarks/_commit_cost.py); with
        ``outer``, also the outer step before and after the commit step existed."""
        from benchmarks._commit_cost import commit_seconds, outer_step_seconds

        sleep_until(at)
        out = {"commit_s": commit_seconds(self.swarm, members, round)}
        if outer and self.rank == 0:  # one process at a time: a peer's outer step runs on its own machine
            out["outer_old_s"], out["outer_new_s"] = outer_step_seconds(self.originals)
        return out

    def cmd_averager(self, kind: str, codec: str | None = None, transport: str = "p2p") -> dict:
        """Start a stock (``kind="stock"``) or exact (``kind="exact"``, with ``codec``) averager on the payload;
        ``transport="tcp"`` gives ours the direct-TCP data plane, as ``Swarm`` does."""
        tensors = [t.clone() for t in self.originals]
        self.gather = {}
        common = dict(prefix="bench", target_group_size=self.peers, min_group_size=self.peers,
                      min_matchmaking_time=3.0, request_timeout=1.0, start=True)
        if kind == "stock":
            from hivemind.averaging import DecentralizedAverager

            self.averager = DecentralizedAverager(tensors, self.dht, **common)
        else:
            from p2p_diloco.swarm.exact_averager import ExactAverager
            from p2p_diloco.swarm.compression import compression_for

            common["start"] = False
            self.averager = ExactAverager(tensors, self.dht, allreduce_timeout=60, next_chunk_timeout=10,
                                          part_size_bytes=2**20, compression=compression_for(codec), **common)
            if transport in ("tcp", "tcp+enc"):  # as Averagers does: a data port and our signed entry
                from p2p_diloco.outer.codecs import get_codec
                from p2p_diloco.swarm.data_auth import DataKey, DataPeer, advertise
                from p2p_diloco.swarm.fastpath import listen_socket

                av = self.averager
                av.codec, av.data_socket, av.data_key = get_codec(codec), listen_socket("127.0.0.1"), DataKey()
                me = DataPeer(self.identity.peer_id, f"127.0.0.1:{av.data_socket.getsockname()[1]}",
                              av.data_key.public, encrypt=transport == "tcp+enc")
                self.gather = {"data": advertise(self.identity.sign, self.identity.public_key, av.prefix, me)}
            self.averager.run_in_background(await_ready=True, timeout=60)
        self.kind = kind if kind == "stock" else f"{codec}/{transport}"
        return {"averager_pid": self.averager.pid}

    def cmd_step(self, at: float, bits: str, attempt: int = 0) -> dict:
        """Restore the payload, wait until ``at``, run one step; report its times (or its failure)."""
        av = self.averager
        with av.get_tensors() as tensors:
            for t, original in zip(tensors, self.originals):
                t.copy_(original)
        kwargs = {"allow_retries": False}
        if self.kind != "stock":
            av.set_round_params(bits, self.peers, timeout=10)
            kwargs["weight"] = 1.0
            kwargs["gather"] = self.gather
        sleep_until(at)
        record = {"method": self.kind, "bits": bits, "attempt": attempt}
        cpu_before = self.cpu_seconds()
        try:
            out = timed_step(av, kwargs)
        except Exception as e:  # reported, never hidden: the parent counts it and retries once
            record.update(ok=False, error=f"{type(e).__name__}: {e!r}"[:500])
            self.timings.append(record)
            return record
        record["cpu"] = {k: v - cpu_before.get(k, 0.0) for k, v in self.cpu_seconds().items()}
        result = out.pop("result")
        record.update(ok=True, **out)
        if isinstance(result, dict) and "bytes_sent" in result:
            record.update(bytes_sent=result["bytes_sent"], bytes_received=result["bytes_received"])
        if self.reference is not None:
            with av.get_tensors() as tensors:
                record["max_err"] = max_error(tensors, self.reference if self.kind == "stock" else self.aggregate)
        self.timings.append(record)
        return record

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by this peer's processes, by role (p2pd is a Go daemon)."""
        import psutil

        me, out = psutil.Process(), {}
        roles = {os.getpid(): "main", self.dht.pid: "dht", getattr(self.averager, "pid", None): "averager"}
        for proc in [me] + me.children(recursive=True):
            try:
                times, name = proc.cpu_times(), proc.name()
            except psutil.Error:
                continue
            role = "p2pd" if name.startswith("p2pd") else roles.get(proc.pid, "other")
            out[role] = out.get(role, 0.0) + times.user + times.system
        return out

    def cmd_close(self) -> dict:
        """Shut the current averager down."""
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        return {}

    def cmd_exit(self) -> dict:
        """Shut the averager and the DHT down."""
        self.cmd_close()
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        return {}


def serve(worker: Worker) -> None:
    """Answer commands from stdin until ``exit`` (or EOF), then print the timings line."""
    emit(event="hello", rank=worker.rank, pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        name = command.pop("cmd")
        try:
            answer = {"ok": True, **getattr(worker, f"cmd_{name}")(**command)}
        except Exception as e:  # the parent decides what a failed command means
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        emit(event=name, rank=worker.rank, **answer)
        if name == "exit":
            break
    worker.cmd_exit()
    emit(event="timings", rank=worker.rank, timings=worker.timings)


def main(rank: int, peers: int, mb: float, seed: int, verify: bool) -> None:
    """Entry point of the ``--worker`` role."""
    serve(Worker(rank=rank, peers=peers, mb=mb, seed=seed, verify=verify))
