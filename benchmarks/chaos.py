"""Chaos benchmark: N >= 16 real p2p-diloco peers on 127.0.0.1 under a seeded stream of random events.

Method: ``--peers`` ``join`` processes (each in its own process group, on loopback: no network namespaces, so no
capped links; see the report) train the tiny model with :mod:`benchmarks.faults`'s fast settings for ``--rounds``
swarm rounds, the first round waiting for all of them (``swarm.min_peers``). Every ``--event-every`` s (x 0.5-1.5)
one event hits a random peer: ``kill`` (SIGKILL of its process group, restart 7-8 s later with ``--resume``),
``freeze`` (SIGSTOP of its whole process tree, p2pd included, SIGCONT 2-6 s later), ``leave`` (SIGTERM; half of the
leavers rejoin with ``--resume`` 5-15 s later), ``join`` (a new peer, fresh, bootstrapping from the 3 oldest live
peers), ``restart`` (SIGTERM, then ``--resume`` from its checkpoint once it exited, 7 s later). A peer slot keeps its
``--identity-path`` across restarts, as a user does (hence the 7 s: its old record must expire, or its id is
refused as already live); ``--new-identity`` gives it a new id instead (then kills come back after 2-8 s, restarts
at once). Kill, freeze and leave are deaths, only dealt while more than ``--min-live`` peers are live; no event in
the last 2 rounds.

Figures, from every peer process's ``events.jsonl``: the swarm's chain of committed states
(:func:`benchmarks._chaos_report.main_chain`; a newcomer that trains alone commits a side chain) and its rounds;
forks (rounds with more than one ``outer_step`` digest, side chains included); step efficiency as
:mod:`benchmarks.faults` defines it, counting as reached only the steps in commits on the swarm's chain; time from
each death to the next commit on the chain by another peer (it includes the rest of the round in which the death
fell: compare with the round time; a death with no commit after it counts the time to the end of the run, a lower
bound); all-reduces thrown away (exact bytes: completed ones, and failed ones from their events); round time;
peak memory per peer (sum of PSS and of RSS over its process tree: python, DHT, averager, p2pd, sampled every
``--rss-every`` s). ``--no-faults --sizes 4,8,16`` instead runs a few fault-free rounds at each N and reports where a
round's sync goes (:func:`benchmarks._chaos_report.sync_breakdown`) and its growth in N.

Limits: one machine, 2 cores for N peers, so timings are CPU-bound and noisy (a peer starved of CPU looks slow
to the others); the time to the next commit depends on when in the round a death falls; one seed is one sample.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from benchmarks import _chaos_report as rep
from benchmarks.faults import FAST, TAG_VAR, Bench, Life, account, round_times
from p2p_diloco.runtime.peer_process import PeerProcess

KINDS = ("kill", "freeze", "leave", "join", "restart")
DEATHS = ("kill", "freeze", "leave")
EXTRA = ["--set", "swarm.min_peers_timeout=600"]  # N peers on 2 cores take minutes to start


class ChaosBench(Bench):
    """:class:`benchmarks.faults.Bench` with the chaos events, RSS sampling and joins of new peer slots."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(argparse.Namespace(**{**vars(args), "work_dir": args.work_dir or tempfile.mkdtemp(
            prefix=f"p2p-diloco-chaos-n{args.peers}-")}))
        self.args = args
        self.run_id = f"chaos-{args.seed}-{args.peers}"
        self.log: list[dict] = []  # one per event: t, kind, slot, peer_id, phase
        self.rss: dict[int, tuple[int, int]] = {}  # Life index -> peak (PSS, RSS) bytes of its process tree
        self.frozen: dict[int, float] = {}  # slot -> monotonic time of its SIGCONT
        self.next_slot, self.last_rss = args.peers, 0.0

    def spawn(self, slot: int, initial: list[str], resume: bool, min_peers: int = 1) -> Life:
        """As :meth:`Bench.spawn`, with :data:`EXTRA` settings and the run's inner steps."""
        n = sum(life.slot == slot for life in self.lives)
        summary, err = self.work / f"peer{slot}.{n}.summary.json", self.work / f"peer{slot}.{n}.stderr.log"
        cmd = ["join", "--run-id", self.run_id, "--log-dir", str(self.logs), "--max-rounds", str(self.args.rounds),
               "--inner-steps", str(self.args.inner_steps), "--summary-json", str(summary),
               "--checkpoint-dir", str(self.work / f"ckpt{slot}"), *FAST, *EXTRA,
               "--set", f"swarm.min_peers={min_peers}"] + (["--resume"] if resume else [])
        cmd += ["--initial-peers", *initial] if initial else []
        cmd += [] if self.args.new_identity else ["--identity-path", str(self.work / f"id{slot}.key")]
        proc = PeerProcess(cmd, env={TAG_VAR: self.tag, "P2P_DILOCO_INITIAL_PEERS": None}, stderr=err,
                           log_command=True)
        life = Life(slot, proc, time.time(), summary)
        self.lives.append(life)
        self.current[slot] = life
        return life

    def live(self) -> list[Life]:
        """Peers running, joined and not frozen."""
        return [x for x in self.current.values() if x.alive() and x.maddrs and x.slot not in self.frozen]

    def note(self, kind: str, life: Life) -> None:
        last = (self.events(life).get(life.peer_id) or [{"event": "startup"}])[-1]
        phase = f"{last['event']}" + (f" r{last['round']}" if "round" in last else "")
        self.log.append({"t": time.time(), "kind": kind, "slot": life.slot, "peer_id": life.peer_id, "phase": phase})
        self.say(f"{kind.upper()} peer{life.slot} ({(life.peer_id or '?')[-8:]}) in {phase}")

    def inject(self, kind: str) -> None:
        """Deal one event of ``kind`` (a death only if enough peers stay live)."""
        live = self.live()
        if kind in DEATHS and len(live) <= self.args.min_live:
            kind = "join"
        if kind == "join":
            if len(live) >= self.args.peers + 2 or not live:
                return
            oldest = sorted(live, key=lambda x: x.t_start)[:3]  # a newcomer trusts what its initial peers signed
            life = self.spawn(self.next_slot, [m for x in oldest for m in x.maddrs[:1]], False)
            self.next_slot += 1
            self.note("join", life)
            return
        victim = self.rng.choice(live)
        self.note(kind, victim)
        if kind == "kill":
            self.kill(victim)
            victim.restart_at = max(victim.restart_at, time.monotonic() + self.back_after())
        elif kind == "freeze":
            self.freeze(victim, signal.SIGSTOP)
            self.frozen[victim.slot] = time.monotonic() + self.rng.uniform(2.0, 6.0)
        else:  # leave or restart: a graceful stop; restart comes back at once, half of the leavers later
            victim.proc.signal(signal.SIGTERM)
            back = self.back_after() if kind == "restart" else (
                self.rng.uniform(5.0, 15.0) if self.rng.random() < 0.5 else None)
            victim.killed_at, victim.phase = time.time(), kind
            victim.restart_at = float("inf") if back is None else time.monotonic() + back

    def back_after(self) -> float:
        """Least seconds before a stopped peer comes back: with its identity kept, its record must expire first
        (``swarm.peer_ttl`` 6 s), or the swarm refuses the id as already live."""
        return 0.0 if self.args.new_identity else 7.0

    def freeze(self, life: Life, sig: int) -> None:
        """Send ``sig`` to the peer's whole tree (p2pd runs in a group of its own, so the group is not enough)."""
        try:
            root = psutil.Process(life.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                p.send_signal(sig)
        except psutil.Error:
            pass

    def sample_rss(self) -> None:
        """Peak memory of each running peer's process tree (python, DHT, averager, p2pd, torch_shm_manager): the sum
        of PSS (RSS would count the pages the forked DHT and averager share with the main process 3 times)."""
        for i, life in enumerate(self.lives):
            if life.proc.returncode is not None or life.killed_at is not None:
                continue
            try:
                root = psutil.Process(life.proc.pid)
                mem = [p.memory_full_info() for p in [root, *root.children(recursive=True)]]
            except psutil.Error:
                continue
            old = self.rss.get(i, (0, 0))
            self.rss[i] = (max(old[0], sum(m.pss for m in mem)), max(old[1], sum(m.rss for m in mem)))

    def tick(self, pause: float) -> None:
        """Sleep; thaw frozen peers, restart the stopped ones whose time came (once exited), sample RSS."""
        time.sleep(pause)
        if time.monotonic() > self.deadline:
            raise TimeoutError
        for slot, until in list(self.frozen.items()):
            if time.monotonic() >= until:
                self.freeze(self.current[slot], signal.SIGCONT)
                del self.frozen[slot]
        for dead in self.faults:
            initial = [m for x in self.live() for m in x.maddrs[:1]]
            if (dead.successor is None and time.monotonic() >= dead.restart_at and initial
                    and dead.proc.poll() is not None):
                resume = any((self.work / f"ckpt{dead.slot}").glob("round-*.pt"))
                dead.successor = self.spawn(dead.slot, initial, resume)
                self.say(f"RESTART peer{dead.slot} ({'--resume' if resume else 'fresh: no checkpoint'})")
        for slot, life in list(self.current.items()):
            if life.killed_at is None and life.proc.poll() not in (None, 0) and self.round < self.args.rounds:
                self.notes.append(f"peer{slot} ({life.peer_id}) exited by itself with {life.proc.returncode}")
                self.say(f"CRASH {self.notes[-1]}; restarting it")
                life.killed_at, life.phase = time.time(), f"crash ({life.proc.returncode})"
                life.restart_at = time.monotonic() + self.back_after()
        if time.monotonic() - self.last_rss >= self.args.rss_every:
            self.last_rss = time.monotonic()
            self.sample_rss()

    def drive(self) -> None:
        """Follow the swarm's rounds and deal the events until it reaches max_rounds."""
        shown, next_at = 0, None
        while True:
            rnd = self.round = max(rep.main_chain(self.events()), default=0)
            if rnd > shown:
                shown = rnd
                self.say(f"swarm round {rnd} done; {len(self.live())} live")
            late = rnd >= self.args.rounds - 2
            if late:  # a peer back now might find nobody to sync with: no more events, no more rejoins
                for f in self.faults:
                    f.restart_at = float("inf") if f.successor is None and f.proc.poll() is not None else f.restart_at
            if rnd >= self.args.rounds and not self.frozen:
                return
            if self.args.event_every > 0 and rnd >= 1 and not late:
                next_at = next_at or time.monotonic() + self.args.event_every * self.rng.uniform(0.5, 1.5)
                if time.monotonic() >= next_at:
                    self.inject(self.rng.choice(KINDS))
                    next_at = None
            self.tick(1.0)

    def finish(self) -> None:
        """Wait (bounded by the deadline) for every peer process still running to exit."""
        for life in self.current.values():
            try:
                life.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError from None


def run(args: argparse.Namespace) -> tuple[ChaosBench, str]:
    """Start the swarm, drive it, clean up; returns the bench and the run's status."""
    bench, status = ChaosBench(args), "complete"
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
        for slot in list(bench.frozen):
            bench.freeze(bench.current[slot], signal.SIGCONT)
        bench.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.default_int_handler)
    return bench, status


def memory(bench: ChaosBench) -> str:
    """Median and max over peer processes of their tree's peak PSS, and the max of its RSS sum (which counts the
    pages that the forked DHT and averager share with the main process once per process)."""
    pss, rss = sorted(v[0] / 2**20 for v in bench.rss.values()), [v[1] / 2**20 for v in bench.rss.values()]
    return (f"PSS median {pss[len(pss) // 2]:.0f} MiB, max {pss[-1]:.0f} MiB; RSS sum max {max(rss):.0f} MiB "
            f"(n={len(pss)})") if pss else "n/a"


def report_chaos(bench: ChaosBench, status: str) -> int:
    """Print the figures and the final ``peers= rounds= ...`` line; 0 only if complete without forks."""
    evs, a = bench.events(), bench.args
    killed = {f.peer_id for f in bench.faults if f.peer_id}
    run_steps, reached, lost = account(evs, killed, status != "complete")
    forked, chain = rep.forks(evs), rep.main_chain(evs)
    durations, side = rep.round_durations(evs, chain), rep.side_chains(evs, chain)
    deaths = [x for x in bench.log if x["kind"] in DEATHS]
    d2c = rep.death_to_commit([(x["t"], x["peer_id"]) for x in deaths], evs, chain)
    censored = sum(d is None for d in d2c)  # no commit of the swarm came after it: count the time to the end
    d2c = [time.time() - x["t"] if d is None else d for d, x in zip(d2c, deaths)]
    reached -= rep.off_chain_steps(evs, chain)
    print(f"\nfigures ({status}; {a.peers} peers on loopback, {a.rounds} rounds, H={a.inner_steps}, seed {a.seed}, "
          f"runtime {time.time() - bench.t0:.0f}s, work dir {bench.work}):")
    print(f"  events: {len(bench.log)} " + str({k: sum(x['kind'] == k for x in bench.log) for k in KINDS}))
    print(f"  rounds committed by the swarm (its chain of states): {len(chain)}; by anyone: "
          f"{max(round_times(evs), default=0)}; forks (rounds with 2+ committed states): {len(forked)} {forked or ''}")
    print(f"  off the swarm's chain, per round [(peer processes, most signers)]: {side or 'none'}")
    print(f"  inner steps run {run_steps}, reached the swarm's global weights {reached}; rounds lost "
          f"{sum(lost.values())} {lost}")
    for kind in DEATHS:
        got = [d for d, x in zip(d2c, deaths) if x["kind"] == kind]
        print(f"  death -> next commit of the swarm by another peer, {kind}: {rep.mean_max(got)}")
    print(f"  {censored} of {len(deaths)} deaths had no commit of the swarm after them: counted as the time to the end "
          f"of the run, a lower bound")
    print(f"  death -> next commit, all deaths: {rep.mean_max(d2c)}; round time (round 1 excluded): "
          f"{rep.mean_max(list(durations.values()))}")
    cost = [c for c in rep.death_cost([(x["t"], x["peer_id"]) for x in deaths], evs, chain) if c is not None]
    print(f"  death -> next commit, from when the survivors were ready to sync (the sync that followed the death, "
          f"a bound on its cost; the line above adds the rest of the round): {rep.mean_max(cost)}")
    w = rep.resent_attempts(evs)
    print(f"  all-reduces thrown away: {w['exact'] / 2**20:.1f} MiB sent in completed ones then refused or not "
          f"certified; {w['failed'] / 2**20:.1f} MiB sent by {w['mid_counted']:.0f} attempts that failed mid-transfer "
          f"(from their events); {w['mid_transfer']:.0f} more failed mid-transfer without a byte count (bound: a "
          f"whole all-reduce = {w['full'] / 2**20:.2f} MiB per peer), {w['before']:.0f} in matchmaking; resent per "
          f"death <= {w['bound'] / 2**20 / max(1, len(deaths)):.2f} MiB, a whole all-reduce being "
          f"{w['full'] / 2**20:.2f} MiB per peer (fault-free runs also throw some away)")
    print(f"  deaths mid-transfer repaired in the same attempt: {w['repaired']:.0f}, re-reducing the dead member's "
          f"slice sent {w['repair_bytes'] / 2**20:.2f} MiB again in all")
    print(f"  peak memory per peer process tree: {memory(bench)}")
    for x in bench.log:
        print(f"    +{x['t'] - bench.t0:6.1f}s {x['kind']:<7} peer{x['slot']} in {x['phase']}")
    for n in bench.notes:
        print(f"  note: {n}")
    print(rep.summary_line(a.peers, len(chain), len(bench.log), len(forked), reached / run_steps
                           if run_steps else 0.0, d2c), flush=True)
    return 0 if status == "complete" and not forked else 1


def no_faults(args: argparse.Namespace) -> int:
    """Fault-free runs at each N of ``--sizes``: where a round's sync goes, and how matchmaking grows with N."""
    rows, code = [], 0
    for n in args.sizes:
        sub = argparse.Namespace(**{**vars(args), "peers": n, "event_every": 0.0, "work_dir": None,
                                    "timeout": args.timeout or 120.0 + 30.0 * n})
        t0 = time.time()
        bench, status = run(sub)
        evs = bench.events()
        b, w = rep.sync_breakdown(evs), rep.resent_attempts(evs)
        rt = list(rep.round_durations(evs, rep.main_chain(evs)).values())
        rows.append((n, b))
        code |= status != "complete" or bool(rep.forks(evs))
        print(f"N={n}: {status}; wall {time.time() - t0:.0f}s; round time {rep.mean_max(rt)}; peak memory per peer "
              f"{memory(bench)}; sync, mean over {b['samples']:.0f} peer-rounds of "
              f"{b['rounds']:.0f} rounds: {b['sync']:.2f}s = pre-sync {b['pre']:.2f}s + failed attempts "
              f"{b['failed']:.2f}s + the attempt that worked {b['attempt']:.2f}s + commit {b['commit']:.2f}s; that "
              f"attempt, where split (n={b['n_matchmaking']:.0f}): matchmaking {b['matchmaking']:.2f}s, transfer "
              f"{b['transfer']:.2f}s; all ready -> first allreduce_done {b['ready_to_done']:.2f}s; all-reduces "
              f"thrown away {w['exact'] / 2**20:.1f} MiB + {w['failed'] / 2**20:.1f} MiB of failed attempts, "
              f"attempts failed {w['mid_counted'] + w['mid_transfer']:.0f} mid-transfer and "
              f"{w['before']:.0f} in matchmaking", flush=True)
    sizes = [n for n, _ in rows]
    for key in ("matchmaking", "ready_to_done", "transfer", "commit", "failed", "sync"):
        print(f"  growth exponent of {key} in N: {rep.growth_exponent(sizes, [b[key] for _, b in rows]):.2f} "
              f"(1 = linear; {', '.join(f'{b[key]:.2f}s' for _, b in rows)})")
    print(" ".join(f"sync_s_n{n}={b['sync']:.2f}" for n, b in rows) + " matchmaking_exponent="
          f"{rep.growth_exponent(sizes, [b['matchmaking'] for _, b in rows]):.2f}", flush=True)
    return int(code)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; ``--quick`` changes the defaults of ``--rounds`` and ``--timeout``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="20 rounds, 800 s limit (default: 40 rounds, 3000 s)")
    p.add_argument("--peers", type=int, default=16)
    p.add_argument("--rounds", type=int, help="swarm rounds (max_rounds); with --no-faults default 4")
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--event-every", type=float, default=6.0, help="mean seconds between events")
    p.add_argument("--min-live", type=int, help="no death while this many peers or fewer are live (default N/2)")
    p.add_argument("--rss-every", type=float, default=3.0, help="seconds between RSS samples")
    p.add_argument("--new-identity", action="store_true", help="a peer back from a stop gets a new peer id (as in "
                   "benchmarks.faults); default: each peer slot keeps its --identity-path, as a restarted user does")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, help="limit in seconds of a run (of each N with --no-faults); then "
                   "every peer is killed and the figures are partial")
    p.add_argument("--work-dir", help="logs, checkpoints, summaries (default: a new temp dir)")
    p.add_argument("--no-faults", action="store_true", help="fault-free runs at each N of --sizes")
    p.add_argument("--sizes", default="4,8,16", help="with --no-faults: the values of N")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes takes numbers separated by commas, not {args.sizes!r}")
    args.rounds = args.rounds or (4 if args.no_faults else 20 if args.quick else 40)
    if not args.no_faults:  # with --no-faults, per N: 120 s + 30 s per peer unless given
        args.timeout = args.timeout or (800.0 if args.quick else 3000.0)
    args.min_live = args.min_live if args.min_live is not None else max(3, args.peers // 2)
    if min([args.peers, *args.sizes]) < 2 or args.rounds < 3:
        p.error("needs 2+ peers and 3+ rounds")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or the fault-free sizes); 0 only if every run completed without forks."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM = Ctrl-C: stop, clean up, report
    if args.no_faults:
        return no_faults(args)
    bench, status = run(args)
    code = report_chaos(bench, status)
    return 130 if status.startswith("INTERRUPTED") else code


if __name__ == "__main__":
    sys.exit(main())
