"""Stop signals during a peer's start-up: the first SIGINT/SIGTERM aborts at once (nothing to save yet), the exit
code is the shell's (128 + the signal's number), and no process of the peer (DHT, averager, p2pd) is left."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from p2p_diloco.metrics.events import Event
from p2p_diloco.swarm.swarm import SHUTDOWN_STEPS
from tests.conftest import TAG_VAR, survivors, tagged_processes
from tests.swarm.helpers import FAST, LONE, Proc, wait_for_event

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]
MADE_UP_PEER = "12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"


def stop_and_time(proc: Proc, sig: int, limit: float, group: bool = False) -> float:
    """Send ``sig`` to the peer's main process (``group``: to its whole process group, as a terminal's Ctrl-C
    does); the seconds it took to exit (AssertionError past ``limit``)."""
    t0 = time.monotonic()
    proc.signal_group(sig) if group else proc.signal(sig)
    proc.wait(limit)
    return time.monotonic() - t0


def wait_for_p2pd(tag: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any("p2pd" in " ".join(p.cmdline()) for p in tagged_processes(tag)):
        assert proc.poll() is None, f"exited ({proc.returncode}) before starting p2pd:\n{proc.stderr_tail()}"
        assert time.monotonic() < deadline, "p2pd did not start"
        time.sleep(0.1)


def test_sigint_3s_after_launch_stops_the_peer(reap):
    """Ctrl-C 3 s after `join` starts (imports, model build or DHT start, whichever it is in): exit 130 within
    seconds, nothing left. (Before: SIGINT was ignored while the DHT started, and the peer trained to the end.)"""
    proc = Proc(["join", "--run-id", "t-sig-early", "--max-rounds", "2", *FAST], reap, fork=False)
    time.sleep(3.0)
    took = stop_and_time(proc, signal.SIGINT, 30)
    assert proc.returncode == 130, proc.stderr_tail()
    assert took < 15, took
    assert "Traceback" not in proc.stderr_tail()
    assert not survivors(reap)


def test_sigint_while_p2pd_tries_to_reach_the_initial_peer(reap):
    """The initial peer is a local port that accepts connections and never answers: p2pd tries it for seconds.
    A SIGINT then stops the peer at once, with exit 130 and no p2pd left (before: ignored until p2pd gave up, then
    exit 2)."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes the handshake; nobody speaks
    try:
        port = silent.getsockname()[1]
        proc = Proc(["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{MADE_UP_PEER}",
                     "--startup-timeout", "60", "--run-id", "t-sig-dht", *FAST], reap)
        wait_for_p2pd(reap, proc, 60)
        took = stop_and_time(proc, signal.SIGINT, 30)
        assert proc.returncode == 130, proc.stderr_tail()
        assert took < 10, took
        assert not survivors(reap)
    finally:
        silent.close()


def test_sigterm_before_the_first_round_aborts_at_once(reap):
    """A peer whose swarm is up waits for a second peer (swarm.min_peers=2): SIGTERM ends it at once with exit 143
    and nothing left (before: it took the signal as "stop at the next safe point" and exited 0)."""
    proc = Proc(["join", "--run-id", "t-sig-wait", "--set", "swarm.min_peers=2", *FAST], reap)
    proc.wait_joined()
    took = stop_and_time(proc, signal.SIGTERM, 30)
    assert proc.returncode == 143, proc.stderr_tail()
    assert took < 15, took
    assert not survivors(reap)


def test_sigterm_before_the_first_round_is_bounded_when_the_peers_processes_are_frozen(reap):
    """The same with the peer's DHT and averager processes frozen (SIGSTOP: what a starved or wedged process looks
    like to it): its DHT calls all wait out their timeouts. The stop is still bounded, by the shutdown's steps
    (Swarm.shutdown), with exit 143 and nothing left. (Before: 43.5 s, each step waiting its own timeout.)"""
    proc = Proc(["join", "--run-id", "t-sig-frozen", "--set", "swarm.min_peers=2", *FAST], reap)
    proc.wait_joined()
    forks = [p for p in psutil.Process(proc.pid).children() if p.name().startswith("python")]
    assert len(forks) == 2, [(p.pid, p.name()) for p in psutil.Process(proc.pid).children()]  # DHT, averager
    for fork in forks:
        fork.suspend()
    time.sleep(1.0)  # the heartbeat and the wait for peers are now stuck in calls to the DHT
    took = stop_and_time(proc, signal.SIGTERM, 60)
    assert proc.returncode == 143, proc.stderr_tail()
    assert took < sum(SHUTDOWN_STEPS.values()) + 5, took
    assert not survivors(reap)


def test_ctrl_c_in_a_terminal_stops_a_running_peer_at_the_next_step(tmp_path, reap):
    """A terminal's Ctrl-C signals the whole foreground process group (python, DHT, averager, p2pd): only the main
    process acts on it, stops after the current step and shuts the others down in order: exit 130, no traceback,
    nothing left. (Before: p2pd took the SIGINT and died at once; the shutdown then printed hivemind's traceback.)"""
    proc = Proc(["join", "--run-id", "t-sig-run", "--max-rounds", "50", "--log-dir", str(tmp_path), *FAST, *LONE],
                reap)
    proc.wait_joined()
    wait_for_event(tmp_path / proc.peer_id / "events.jsonl", lambda e: e["event"] == Event.OUTER_STEP, 120, proc)
    took = stop_and_time(proc, signal.SIGINT, 60, group=True)
    err = "".join(proc.err_lines)
    assert proc.returncode == 130, err[-3000:]
    assert took < 20, took
    assert "stopping after the current step" in err and "Traceback" not in err, err[-3000:]
    assert "did not shut down" not in err, err[-3000:]  # the DHT and the averager were stopped in order
    assert not survivors(reap)


def test_p2pd_is_out_of_the_terminal_group_and_dies_with_its_dht_process(reap):
    """p2pd takes SIGINT itself, so it runs in a process group of its own (out of reach of a terminal's Ctrl-C);
    the kernel kills it when the DHT process that started it dies, so a killed peer still leaves no p2pd."""
    script = textwrap.dedent("""
        import os, signal, time
        import psutil
        from p2p_diloco.swarm.starting import start_dht
        dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=30)
        p2pd = next(p for p in psutil.Process(dht.pid).children() if "p2pd" in p.name())
        assert os.getpgid(p2pd.pid) == p2pd.pid != os.getpgid(0), (os.getpgid(p2pd.pid), p2pd.pid)
        os.kill(dht.pid, signal.SIGKILL)
        p2pd.wait(10)
        print("p2pd gone")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **{TAG_VAR: reap}))
    assert r.returncode == 0 and "p2pd gone" in r.stdout, r.stderr[-3000:]
    assert not survivors(reap)

