"""The harness that runs a peer process: ``python -m p2p_diloco ...`` in its own session and process group.

A peer is several processes (its python, the DHT, the averager, the Go ``p2pd``), so it is started as the leader of a
new session: the whole group can be signalled or killed as a unit, and nothing of it outlives a launcher, a test or
a benchmark. Its stdout is read by a thread that keeps every line and recognizes the join line every peer (and
bootstrap node) prints once it listens; its stderr is either collected the same way or written to a file. Once
the process has exited (:meth:`PeerProcess.wait`, :meth:`PeerProcess.poll`), every line it wrote is in the lists
(pipe_lines.py).

Used by ``p2p-diloco swarm`` (:mod:`p2p_diloco.cli.launcher`), the swarm tests and the benchmarks.
"""

from __future__ import annotations

import os
import re
import shlex
import signal as signals
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..metrics import read_events, short_id
from .pipe_lines import LineReader
from .processes import kill_group, wait_group_gone

# A peer prints it with its run id; a bootstrap node (no run of its own) without.
JOIN_LINE = re.compile(r"^p2p-diloco join --initial-peers (?P<maddrs>.+?)(?: --run-id (?P<run_id>\S+))?\s*$")


def child_env(extra_env: Mapping[str, str | None]) -> dict[str, str]:
    """The environment a peer process starts with: ours, unbuffered, with ``extra_env`` set (None: removed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, value in extra_env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def parse_join_line(line: str) -> tuple[list[str], str | None] | None:
    """Parse the line a peer (or a bootstrap node) prints on start.

    Args:
        line: one line of a peer's stdout.

    Returns:
        ``(maddrs, run_id)`` (``run_id`` is None for a bootstrap node), or None if ``line`` is not a join line.
    """
    m = JOIN_LINE.match(line.strip())
    return (m.group("maddrs").split(), m.group("run_id")) if m else None


class PeerStartError(RuntimeError):
    """The process ended, or stayed silent, without printing its join line."""


class PeerProcess:
    """One ``python [python_args] -m module args`` process, leader of its own session and process group.

    Args:
        args: the module's arguments, e.g. ``["join", "--run-id", "r1"]``.
        module: the module run with ``-m`` (a test's peer with fault hooks: ``tests.swarm.faulty_peer``).
        python_args: interpreter arguments before ``-m module``, e.g. ``-m torch.distributed.run
            --nproc-per-node 2`` for a peer of several local ranks.
        prefix: a command that execs the rest, e.g. ``ip netns exec NS`` or ``py-spy record ... --`` (it execs
            python, so the pid and the process group stay this object's).
        env: variables added to this process's environment; a value of None removes the variable.
            ``PYTHONUNBUFFERED=1`` is always set, so lines arrive as they are printed.
        cwd: working directory of the process.
        stderr: a file to write stderr to (truncated); None: stderr lines are collected in :attr:`err_lines`.
        log_command: write the command line as the first line of the ``stderr`` file.
        stdin: keep a pipe to the process's stdin (see :meth:`write_line`); default: stdin is /dev/null.

    Attributes:
        cmd: the command line started.
        popen: the ``subprocess.Popen``.
        lines: every stdout line so far (newlines kept).
        err_lines: every stderr line so far, when ``stderr`` is None.
        maddrs: the multiaddrs of the join line, once printed (else empty).
        run_id: the run id of the join line (None for a bootstrap node, or before it is printed).
        stderr_path: the ``stderr`` file, or None.
    """

    def __init__(self, args: Sequence[str], *, module: str = "p2p_diloco", python_args: Sequence[str] = (),
                 prefix: Sequence[str] = (), env: Mapping[str, str | None] | None = None,
                 cwd: str | Path | None = None, stderr: str | Path | None = None, log_command: bool = False,
                 stdin: bool = False):
        self.cmd = [*prefix, sys.executable, *python_args, "-m", module, *args]
        self.lines: list[str] = []
        self.err_lines: list[str] = []
        self.maddrs: list[str] = []
        self.run_id: str | None = None
        self.stderr_path = Path(stderr) if stderr is not None else None
        self._joined = threading.Event()  # set on the join line, or at EOF of stdout
        self.popen = self._start(env or {}, cwd, stdin, log_command)
        # stderr has its own reader and end: stdout closing says nothing about what stderr still holds
        self._out = LineReader(self.popen.stdout, self.lines, self._take_line, self._take_eof)
        self._err = LineReader(self.popen.stderr, self.err_lines) if self.stderr_path is None else None
        threading.Thread(target=self._read_stdout, daemon=True).start()
        if self._err is not None:
            threading.Thread(target=self._read_stderr, daemon=True).start()

    def _start(self, extra_env: Mapping[str, str | None], cwd, stdin: bool, log_command: bool) -> subprocess.Popen:
        common = dict(stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                      env=child_env(extra_env),
                      cwd=cwd, start_new_session=True)  # binary pipes: LineReader decodes
        if self.stderr_path is None:
            return subprocess.Popen(self.cmd, stderr=subprocess.PIPE, **common)
        with open(self.stderr_path, "w") as err:
            if log_command:
                err.write(shlex.join(self.cmd) + "\n")
                err.flush()
            return subprocess.Popen(self.cmd, stderr=err, **common)

    def _read_stdout(self) -> None:
        self._out.run()

    def _read_stderr(self) -> None:
        self._err.run()

    def _take_line(self, line: str) -> None:
        if not self._joined.is_set() and (parsed := parse_join_line(line)) is not None:
            self.maddrs, self.run_id = parsed
            self._joined.set()
        self.on_line(line)

    def _take_eof(self) -> None:
        self._joined.set()  # the end of stdout: the process ended (maybe before printing its join line)
        self.on_eof()

    def _drain(self) -> None:
        """Called once the main process has exited: what it wrote is now in the pipes; read it into the lists."""
        for reader in (self._out, self._err):
            if reader is not None:
                reader.drain()

    def on_line(self, line: str) -> None:
        """Called for every stdout line, in order, after it is kept (by the reader thread, or by the thread that
        saw the exit in :meth:`wait`/:meth:`poll`, under the reader's lock: it must not wait for another thread
        that may be in those); a subclass's protocol hook."""

    def on_eof(self) -> None:
        """Called once stdout is closed by all its writers (the process exited, or closed it), after the last line."""

    @property
    def pid(self) -> int:
        """The main process's pid, which is also the process group's id (and the session's)."""
        return self.popen.pid

    @property
    def peer_id(self) -> str | None:
        """The peer id of the join line (the last component of its first multiaddr), or None before it."""
        return self.maddrs[0].rsplit("/p2p/", 1)[-1] if self.maddrs else None

    @property
    def joined(self) -> bool:
        """True once the join line was printed."""
        return bool(self.maddrs)

    @property
    def returncode(self) -> int | None:
        """The main process's exit status, or None while it runs (or before :meth:`poll`/:meth:`wait` saw it)."""
        return self.popen.returncode

    def wait_joined(self, timeout: float) -> list[str]:
        """Wait for the join line.

        Args:
            timeout: seconds to wait.

        Returns:
            The join line's multiaddrs.

        Raises:
            PeerStartError: the process ended, or printed no join line within ``timeout`` s (with the stderr tail).
        """
        self._joined.wait(timeout)
        if not self.maddrs:
            if self._out.eof.is_set():  # stdout closed: the process is exiting
                try:
                    self.wait(timeout=5)  # (and its last stderr lines, the reason it failed, are read)
                except subprocess.TimeoutExpired:
                    pass
            why = (f"no join line within {timeout}s" if self.poll() is None
                   else f"exited ({self.returncode}) without printing its join line")
            raise PeerStartError(f"{why}; stderr:\n{self.stderr_tail()}")
        return self.maddrs

    def events(self, log_dir: str | Path) -> list[dict]:
        """The events this peer wrote so far to ``log_dir/<peer id>/events.jsonl`` (empty before its join line)."""
        return read_events(Path(log_dir) / self.peer_id / "events.jsonl") if self.peer_id else []

    def poll(self) -> int | None:
        """The main process's exit status, or None while it runs. Once it has exited, every line it wrote is in
        :attr:`lines` and :attr:`err_lines` (an unfinished last line only once the pipe ends)."""
        code = self.popen.poll()
        if code is not None:
            self._drain()
        return code

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the main process to exit and return its status; every line it wrote is then in :attr:`lines`
        and :attr:`err_lines` (an unfinished last line only once the pipe ends). Its other processes may hold the
        pipes and write on: :meth:`wait_output` waits for the pipes' end.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` s.
        """
        code = self.popen.wait(timeout=timeout)
        self._drain()
        return code

    def wait_output(self, timeout: float | None = None) -> bool:
        """Wait until stdout and stderr are closed by all their writers and every line is in :attr:`lines` and
        :attr:`err_lines`; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._out.eof.wait(timeout):
            return False
        return self._err is None or self._err.eof.wait(
            None if deadline is None else max(0.0, deadline - time.monotonic()))

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the main process only (a peer stops gracefully on SIGINT/SIGTERM)."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (python, DHT, averager: what a terminal's Ctrl-C reaches; p2pd has
        a group of its own and dies with the DHT process, see swarm/starting.py), ignoring a group already gone."""
        kill_group(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the whole process group, as a crash of the machine would; a group already gone is ignored."""
        kill_group(self.pid, signals.SIGKILL)

    def write_line(self, text: str) -> None:
        """Write ``text`` and a newline to the process's stdin (only with ``stdin=True``)."""
        self.popen.stdin.write((text + "\n").encode())
        self.popen.stdin.flush()

    def stderr_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of stderr (from :attr:`err_lines`, or from the ``stderr`` file)."""
        if self.stderr_path is None:
            return "".join(self.err_lines[-n:])
        try:
            with open(self.stderr_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "running" if self.popen.returncode is None else f"exited {self.popen.returncode}"
        return f"<PeerProcess pid={self.pid} {short_id(self.peer_id)} {state}>"


def stop_all(procs: Iterable[PeerProcess], grace: float) -> None:
    """Stop peer processes and leave nothing of them: SIGTERM, then kill what is left of each process group.

    Every main process still running gets SIGTERM (a peer then leaves the swarm and shuts its parts down) and
    ``grace`` s, all together, to exit. Then, per peer: a wait of up to 10 s for its group to empty by itself
    (torch's ``torch_shm_manager`` deletes the /dev/shm files of the peer's tensors only after the main process
    exited, and killing it first leaks them), SIGKILL to whatever is left of the group (DHT, averager; p2pd dies
    with its DHT process), and
    a last bounded wait for the main process and the group.

    Args:
        procs: the processes to stop (any state: running, exited, never joined).
        grace: seconds for the main processes to exit after SIGTERM.
    """
    procs = list(procs)
    for p in procs:
        p.signal(signals.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        wait_group_gone(p.pid, timeout=10)  # torch_shm_manager cleans /dev/shm after the main process exits
        p.kill_group()  # leftovers of the group: DHT, averager (and with the DHT, its p2pd)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        wait_group_gone(p.pid, timeout=5)
