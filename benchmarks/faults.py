"""Fault benchmark: a real p2p-diloco swarm on 127.0.0.1 whose peers are killed (kill -9) and restarted.

Method: ``--peers`` ``join`` processes, each in its own process group, train ``--rounds`` swarm rounds. Faults come
about every ``--fault-every`` rounds (seeded positions such as 2.4 = 40 % into round 3, turned into seconds with the
measured round time); ``--sync-share`` of them instead wait for the victim's ``allreduce_start`` (strike 0-1 s
later) or ``allreduce_running`` (0-0.2 s), so kills land in training, matchmaking, the all-reduce and the outer
step. A fault SIGKILLs the process group of a random live peer (python, DHT, averager, p2pd), never leaving fewer
than 2 live, and restarts it 2-8 s later with ``--resume`` from its last round-boundary checkpoint (fresh if it has
none). No fault lands in the last 1.5 rounds: a peer restarted after the others left would have nobody to sync with.

Figures, from the ``events.jsonl`` of every peer process (a restarted peer has a new peer id, hence a new file):
step efficiency = inner steps whose pseudo-gradient reached the global weights (sum of ``outer_step.inner_steps``)
/ inner steps run (completed rounds: the same; rounds ended by ``state_loaded``, a repair or a kill: the last
``inner_progress.inner_step`` seen in the round); rounds lost = (peer process, round) pairs that trained but never
reached an outer step; time to recover = kill -> next ``outer_step`` of another peer, and restart -> the restarted
peer's first ``state_loaded``/``outer_step`` (state back) and first ``outer_step`` (contributing again).

Limits: ``inner_progress`` comes every 10 steps, so a killed peer's lost work is undercounted by up to 9 steps per
kill (optimistic), while a peer killed just after its all-reduce but before its own outer step is counted as lost
although the others applied its pseudo-gradient (pessimistic); the time a peer is down or idle is not lost work;
work that reached a minority fork still counts (forks are shown per round); one machine and a loopback network, so
no latency or partition faults; more peers than cores make timings noisy; one seed is one sample.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from p2p_diloco.metrics.events import Event
from p2p_diloco.runtime.peer_process import PeerProcess, PeerStartError

FAST = ["--set", "eval.batches=2", "--set", "data.max_bytes=1500000", "--set", "swarm.matchmaking_time=5.0",
        "--set", "swarm.request_timeout=2.0", "--set", "train.threads=1", "--set", "swarm.allreduce_timeout=20",
        "--set", "swarm.next_chunk_timeout=5"]
TAG_VAR = "P2P_DILOCO_BENCH_TAG"  # set in every process we start (inherited by DHT, averager, p2pd): orphan sweep
PHASES = {Event.ROUND_START: "train", Event.INNER_PROGRESS: "train", Event.ALLREDUCE_START: "matchmaking",
          Event.ALLREDUCE_RUNNING: "all-reduce", Event.ALLREDUCE_FAILED: "all-reduce retry",
          Event.ALLREDUCE_DONE: "outer step", Event.STATE_DOWNLOAD_START: "state download",
          Event.STATE_LOADED: "catch-up", Event.DESYNC_DETECTED: "repair", Event.OUTER_STEP: "boundary",
          Event.CHECKPOINT_SAVED: "boundary", Event.EVAL: "boundary"}


@dataclass
class Life:
    """One process (incarnation) of a peer slot, and its fault if it was killed (or crashed)."""

    slot: int
    proc: PeerProcess
    t_start: float
    summary: Path
    killed_at: float | None = None
    phase: str = ""  # what the peer was doing when killed, from its last event
    restart_at: float | None = None  # time.monotonic()
    successor: Life | None = None

    @property
    def maddrs(self) -> list[str]:
        """The join line's multiaddrs (empty until it is printed)."""
        return self.proc.maddrs

    @property
    def peer_id(self) -> str | None:
        return self.proc.peer_id

    def alive(self) -> bool:
        return self.killed_at is None and self.proc.poll() is None


class Bench:
    """Runs the swarm and injects the faults; :meth:`cleanup` kills whatever it started."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.rng = args, random.Random(args.seed)
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="p2p-diloco-faults-"))
        self.logs, self.tag, self.run_id = self.work / "logs", uuid.uuid4().hex, f"faults-{args.seed}"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.lives: list[Life] = []
        self.current: dict[int, Life] = {}  # slot -> its newest process
        self.notes: list[str] = []
        self.t0, self.deadline, self.round = time.time(), time.monotonic() + args.timeout, 0

    @property
    def faults(self) -> list[Life]:
        return sorted((life for life in self.lives if life.killed_at is not None), key=lambda x: x.killed_at)

    def say(self, text: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {text}", flush=True)

    def spawn(self, slot: int, initial: list[str], resume: bool, min_peers: int = 1) -> Life:
        """Start one ``join`` process for ``slot`` in its own process group (command + stderr to a file).

        Args:
            slot: the peer slot (a restarted peer keeps its slot and checkpoint dir, and gets a new peer id).
            initial: multiaddrs to bootstrap from (none: a new swarm).
            resume: continue from the newest checkpoint of the slot.
            min_peers: ``swarm.min_peers`` (only the initial peers wait for each other).

        Returns:
            The new process's :class:`Life` (also ``self.current[slot]``).
        """
        n = sum(life.slot == slot for life in self.lives)
        summary, err_path = self.work / f"peer{slot}.{n}.summary.json", self.work / f"peer{slot}.{n}.stderr.log"
        cmd = ["join", "--run-id", self.run_id, "--log-dir", str(self.logs),
               "--max-rounds", str(self.args.rounds), "--inner-steps", str(self.args.inner_steps),
               "--summary-json", str(summary), "--checkpoint-dir", str(self.work / f"ckpt{slot}"), *FAST,
               "--set", f"swarm.min_peers={min_peers}"] + (["--resume"] if resume else [])
        cmd += ["--initial-peers", *initial] if initial else []
        proc = PeerProcess(cmd, env={TAG_VAR: self.tag, "P2P_DILOCO_INITIAL_PEERS": None}, stderr=err_path,
                           log_command=True)
        life = Life(slot, proc, time.time(), summary)
        self.lives.append(life)
        self.current[slot] = life
        return life

    def events(self, life: Life | None = None) -> dict[str, list[dict]]:
        """Events of every peer process that printed its join line (or of ``life`` only), by peer id."""
        return {x.peer_id: x.proc.events(self.logs) for x in ([life] if life else self.lives) if x.peer_id}

    def start(self) -> None:
        """Start peer 0, then the others bootstrapping from it; all wait for each other before round 1."""
        try:
            self.spawn(0, [], False, self.args.peers).proc.wait_joined(120)
        except PeerStartError:
            raise RuntimeError(f"peer0 did not start; see {self.work / 'peer0.0.stderr.log'}") from None
        for slot in range(1, self.args.peers):
            self.spawn(slot, self.lives[0].maddrs, False, self.args.peers)
        self.say(f"started {self.args.peers} peers; work dir {self.work}")

    def kill(self, life: Life) -> None:
        """SIGKILL the victim's process group, note the phase its last event shows, and schedule its restart."""
        last = (self.events(life).get(life.peer_id) or [{"event": "startup"}])[-1]
        life.proc.kill_group()
        life.killed_at, life.restart_at = time.time(), time.monotonic() + self.rng.uniform(2.0, 8.0)
        life.phase = PHASES.get(last["event"], f"after {last['event']}")
        life.phase += f" step {last['inner_step']}" if last["event"] == Event.INNER_PROGRESS else ""
        life.phase += f" of round {last['round']}" if "round" in last else ""
        self.say(f"KILL peer{life.slot} ({(life.peer_id or '?')[-8:]}) in {life.phase}; "
                 f"restart in {life.restart_at - time.monotonic():.1f}s")

    def kill_in_sync(self, life: Life, limit: float, running: bool) -> None:
        """Kill ``life`` 0-1 s after it starts matchmaking, or 0-0.2 s after its all-reduce starts ``running`` (or
        after ``limit`` s, whatever it is doing then)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and life.alive():
            last = (self.events(life).get(life.peer_id) or [{"event": ""}])[-1]
            if last["event"] == (Event.ALLREDUCE_RUNNING if running else Event.ALLREDUCE_START):
                time.sleep(self.rng.uniform(0.0, 0.2 if running else 1.0))
                break
            self.tick(0.1)
        if life.alive():
            self.kill(life)

    def tick(self, pause: float) -> None:
        """Sleep, then restart the victims whose time has come and notice peers that crashed."""
        time.sleep(pause)
        if time.monotonic() > self.deadline:
            raise TimeoutError
        for dead in self.faults:
            initial = [m for x in self.current.values() if x.alive() for m in x.maddrs[:1]]
            if dead.successor is None and time.monotonic() >= dead.restart_at and initial:
                resume = any((self.work / f"ckpt{dead.slot}").glob("round-*.pt"))
                self.spawn(dead.slot, initial, resume)
                dead.successor = self.current[dead.slot]
                self.say(f"RESTART peer{dead.slot} ({'--resume' if resume else 'fresh: no checkpoint'})")
        for slot, life in list(self.current.items()):
            if life.killed_at is None and life.proc.poll() not in (None, 0) and self.round < self.args.rounds:
                self.notes.append(f"peer{slot} ({life.peer_id}) exited by itself with {life.proc.returncode}")
                self.say(f"CRASH {self.notes[-1]}; restarting it")
                life.killed_at, life.restart_at, life.phase = time.time(), 0.0, f"crash ({life.proc.returncode})"

    def drive(self) -> None:
        """Follow the swarm's round (outer_step events), inject the faults and restarts, until max_rounds."""
        todo, x, shown, kill_at = [], self.rng.uniform(0.3, 1.0), 0, None
        while self.args.fault_every > 0 and x < self.args.rounds - 1.5:
            todo, x = todo + [x], x + self.args.fault_every * self.rng.uniform(0.5, 1.5)
        while True:
            done = round_times(self.events())
            rnd = self.round = max(done, default=0)
            if rnd > shown:
                shown = rnd
                self.say(f"swarm round {rnd} done")
            if rnd >= self.args.rounds and all(f.successor for f in self.faults):
                return
            if rnd >= self.args.rounds - 1:  # too late: a restarted peer might find nobody left to sync with
                todo, kill_at = [], None
            if todo and kill_at is None and rnd >= int(todo[0]):
                kill_at = time.monotonic() + (todo[0] % 1) * est_round_seconds(done)
            live = [life for life in self.current.values() if life.alive() and life.maddrs]
            if kill_at is not None and time.monotonic() >= kill_at and len(live) >= 3:
                victim, todo, kill_at = self.rng.choice(live), todo[1:], None
                aim = self.rng.random() / self.args.sync_share if self.args.sync_share > 0 else 1.0
                if aim < 1.0:
                    self.kill_in_sync(victim, 1.5 * est_round_seconds(done), running=aim < 0.5)
                else:
                    self.kill(victim)
            self.tick(1.0)

    def finish(self) -> None:
        """Wait (bounded by the deadline) for every live peer to reach max_rounds and exit."""
        for life in self.current.values():
            try:
                life.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError from None

    def cleanup(self) -> None:
        """Kill every process group we started, then (after a grace for torch_shm_manager, which runs in its own
        session and deletes the shared-memory files once its clients are gone) anything still carrying our tag."""
        for life in self.lives:
            life.proc.kill_group()
            try:
                life.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.notes.append(f"peer{life.slot} pid {life.proc.pid} did not die")
        _, left = psutil.wait_procs([p for p in psutil.process_iter() if _tagged(p, self.tag)], timeout=20)
        for p in left:
            try:
                self.notes.append(f"still alive 20 s after the end, killed: pid {p.pid} {p.name()}")
                p.kill()
            except psutil.Error:
                pass
        rows = [{"slot": x.slot, "peer_id": x.peer_id, "t_start": x.t_start, "killed_at": x.killed_at,
                 "phase": x.phase, "exit_code": x.proc.returncode} for x in self.lives]
        (self.work / "peers.json").write_text(json.dumps(rows, indent=1))


def _tagged(proc: psutil.Process, tag: str) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_VAR) == tag
    except psutil.Error:
        return False


def round_times(evs: dict[str, list[dict]]) -> dict[int, float]:
    """Swarm round -> time of its first ``outer_step`` on any peer."""
    out: dict[int, float] = {}
    for e in (e for lst in evs.values() for e in lst if e["event"] == Event.OUTER_STEP):
        out[e["round"]] = min(out.get(e["round"], e["t"]), e["t"])
    return out


def est_round_seconds(done: dict[int, float]) -> float:
    """Mean duration of the swarm rounds after the first (20 s until two rounds are done)."""
    return (max(done.values()) - min(done.values())) / (len(done) - 1) if len(done) >= 2 else 20.0


def account(evs: dict[str, list[dict]], killed: set[str], partial: bool) -> tuple[int, int, dict[str, int]]:
    """Count the work of every peer process, one segment per ``round_start``.

    Args:
        evs: events by peer id.
        killed: peer ids of the processes that the benchmark killed (or that crashed).
        partial: the run was cut short (timeout, Ctrl-C): the round each surviving peer was in is left out.

    Returns:
        (inner steps run, inner steps that reached an outer step, lost rounds by cause).
    """
    run = reached = 0
    lost: dict[str, int] = {}
    for pid, lst in evs.items():
        segs = []  # one per round_start: [round, last inner_progress, outer_step.inner_steps, how it ended]
        for e in lst:
            if e["event"] == Event.ROUND_START:
                segs.append([e["round"], 0, None, "killed" if pid in killed else "no outer step"])
            elif segs and e["round"] == segs[-1][0] and e["event"] == Event.INNER_PROGRESS:
                segs[-1][1] = max(segs[-1][1], e["inner_step"])
            elif segs and e["round"] == segs[-1][0] and e["event"] == Event.OUTER_STEP:
                segs[-1][2] = e["inner_steps"]
            elif segs and e["event"] in (Event.STATE_LOADED, Event.DESYNC_DETECTED):
                segs[-1][3] = e["event"]
        if partial and segs and segs[-1][2] is None and segs[-1][3] == "no outer step":
            segs.pop()
        for _, progress, steps, cause in segs:
            run += progress if steps is None else steps
            reached += steps or 0
            if steps is None:
                lost[cause] = lost.get(cause, 0) + 1
    return run, reached, lost


def report_faults(bench: Bench, evs: dict[str, list[dict]]) -> list[list[float]]:
    """One line per fault; returns the recovery times [kill -> others, restart -> state back, -> contributing]."""
    rec: list[list[float]] = [[], [], []]
    print("\nfaults:")
    for i, f in enumerate(bench.faults, 1):
        later = [e["t"] for pid, lst in evs.items() if pid != f.peer_id for e in lst
                 if e["event"] == Event.OUTER_STEP and e["t"] > f.killed_at]
        new = evs.get(f.successor.peer_id, []) if f.successor and f.successor.peer_id else []
        back = [e["t"] - f.successor.t_start for e in new if e["event"] in (Event.OUTER_STEP, Event.STATE_LOADED)]
        steps = [e["t"] - f.successor.t_start for e in new if e["event"] == Event.OUTER_STEP]
        times = [min(later) - f.killed_at if later else None, back[0] if back else None, steps[0] if steps else None]
        for lst, t in zip(rec, times):
            lst += [t] if t is not None else []
        shown = ["-" if t is None else f"{t:.1f}s" for t in times]
        print(f"  #{i} +{f.killed_at - bench.t0:6.1f}s peer{f.slot} {f.phase}; others' next outer step after "
              f"{shown[0]}; restarted peer: state back after {shown[1]}, first outer step after {shown[2]}")
    return rec


def report_rounds(bench: Bench, evs: dict[str, list[dict]]) -> None:
    """One line per swarm round (duration, group sizes, failed all-reduces, forks), then rounds with/without kill."""
    done, prev, took = round_times(evs), bench.t0, ([], [])
    print("rounds:")
    for r in sorted(done):
        pick = [e for lst in evs.values() for e in lst if e["round"] == r]
        digests = {e["digest"] for e in pick if e["event"] == Event.OUTER_STEP}
        sizes = sorted(e.get("group_size") for e in pick if e["event"] == Event.ALLREDUCE_DONE)
        kills = sum(prev < f.killed_at <= done[r] for f in bench.faults)
        print(f"  round {r:>3}: done at +{done[r] - bench.t0:6.1f}s (took {done[r] - prev:5.1f}s), kills {kills}, "
              f"groups {sizes}, failed all-reduces {sum(e['event'] == Event.ALLREDUCE_FAILED for e in pick)}, "
              f"state loads {sum(e['event'] == Event.STATE_LOADED for e in pick)}, "
              f"{'one digest' if len(digests) == 1 else f'FORK: {len(digests)} digests'}")
        if r > 1:
            took[kills > 0].append(done[r] - prev)
        prev = done[r]
    print(f"  round duration (round 1 excluded): {stats(took[1])} with a kill, {stats(took[0])} without")


def report(bench: Bench, status: str) -> int:
    """Print the report, the figures and the final ``step_efficiency=`` line; return the exit code."""
    evs, a = bench.events(), bench.args
    run, reached, lost = account(evs, {f.peer_id for f in bench.faults if f.peer_id}, status != "complete")
    rec = report_faults(bench, evs)
    report_rounds(bench, evs)
    summaries = []
    for life in bench.current.values():
        try:
            summaries.append(json.loads(life.summary.read_text()))
        except (OSError, json.JSONDecodeError):
            summaries.append({"global_digest": None, "rounds_completed": None})
    digests = {s.get("global_digest") for s in summaries}
    agree, exits = len(digests) == 1 and None not in digests, [x.proc.returncode for x in bench.current.values()]
    print(f"figures ({status}; {len(bench.faults)} faults, {a.peers} peers, {a.rounds} rounds, H={a.inner_steps}, "
          f"seed {a.seed}, runtime {time.time() - bench.t0:.0f}s, work dir {bench.work}):")
    print(f"  inner steps run {run}, reached the global weights {reached} (lost work of killed peers is "
          f"undercounted by up to 9 steps per kill)")
    print(f"  rounds lost: {sum(lost.values())} {lost}")
    print(f"  time to recover, kill -> others' next outer step: {stats(rec[0])}")
    print(f"  time to recover, restart -> state back (state_loaded or outer_step): {stats(rec[1])}")
    print(f"  time to recover, restart -> first outer_step (contributing again): {stats(rec[2])}")
    print(f"  final peers: rounds {[s.get('rounds_completed') for s in summaries]}, exit codes {exits}, "
          f"digests {'agree' if agree else 'DISAGREE'}: {sorted(str(d)[:12] for d in digests)}")
    for note in bench.notes:
        print(f"  note: {note}")
    print(f"step_efficiency={reached / run if run else 0.0:.3f}", flush=True)
    return 0 if status == "complete" and agree and all(c == 0 for c in exits) else 1


def stats(xs: list[float]) -> str:
    """Mean and max of durations in seconds."""
    return f"mean {statistics.mean(xs):.1f}s, max {max(xs):.1f}s (n={len(xs)})" if xs else "n/a"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; ``--quick`` only changes the defaults of ``--rounds`` and ``--timeout``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="12 rounds, 900 s limit (default: 30 rounds, 2400 s)")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rounds", type=int, help="swarm rounds (max_rounds)")
    p.add_argument("--fault-every", type=float, default=2.0, help="mean rounds between faults; 0 = no faults")
    p.add_argument("--sync-share", type=float, default=0.4, help="share of faults aimed at matchmaking/all-reduce")
    p.add_argument("--inner-steps", type=int, default=100, help="H (100: a round lasts about as long as a restart)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, help="overall limit in seconds; then every peer is killed")
    p.add_argument("--work-dir", help="logs, checkpoints, summaries (default: a new temp dir)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (12 if args.quick else 30)
    args.timeout = args.timeout or (900.0 if args.quick else 2400.0)
    if args.peers < 3 and args.fault_every > 0:
        p.error("--peers must be >= 3 to kill peers while keeping 2 live")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 only if it completed, the final digests agree and every final peer exited 0."""
    args = parse_args(argv)
    bench, status = Bench(args), "complete"
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM = Ctrl-C: stop, clean up, report
    try:
        bench.start()
        bench.drive()
        bench.say("swarm reached max_rounds; waiting for the peers to exit")
        bench.finish()
    except TimeoutError:
        status = f"TIMEOUT after {args.timeout:.0f}s: every peer was killed, figures are partial"
    except (RuntimeError, OSError) as e:
        status = f"FAILED ({e}): every peer was killed, figures are partial"
    except KeyboardInterrupt:
        status = "INTERRUPTED: every peer was killed, figures are partial"
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not skip the cleanup
            signal.signal(sig, signal.SIG_IGN)
        bench.cleanup()
    code = report(bench, status)
    return 130 if status.startswith("INTERRUPTED") else code


if __name__ == "__main__":
    sys.exit(main())
