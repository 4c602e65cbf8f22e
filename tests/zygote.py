"""Peer processes for tests without paying the imports each time: a *zygote* imports torch, transformers, hivemind
and p2p_diloco once, then forks every test peer from that state.

Why: a peer process spends ~10 s of CPU importing before it does anything (``import torch,
transformers.models.llama.modeling_llama`` alone: 9.2 s user on the 2-core CI machine), most of the CPU a short
swarm test uses, and the suite is CPU-bound on 2 cores. A forked child runs exactly the code a started one runs
(``python -m <module> <args>`` through :mod:`runpy`), in its own session, with its own stdin/stdout/stderr, working
directory and environment; only the imports are shared.

What differs from ``exec`` and how it is handled:

* hivemind creates process-shared locks at import (``MPFuture``'s): every child makes its own, or a peer killed
  while holding one would block every other peer.
* ``/proc/<pid>/environ`` of a child shows the zygote's environment, not the one it runs with: tests find a
  child's processes by its session (tests/conftest.py: ``tagged_processes``), since each child is a session leader.
* Variables read at import (``TORCH_*``, ``OMP_*``, ``HIVEMIND_*``, ...) cannot change per child: a request whose
  environment differs there is refused, and :class:`ZygoteProcess`'s caller starts the process as before.
* Python's ``random`` is reseeded at a fork by Python itself, numpy's global generator here.

Protocol (a ``SOCK_SEQPACKET`` Unix socket): the client sends one JSON request (module, args, env, cwd) with the
child's stdin, stdout and stderr descriptors attached; the zygote answers the child's pid, and later its exit
status as :class:`subprocess.Popen` gives it (``-N`` for a signal), then closes the connection.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

IMPORTED_AT_START = ("TORCH", "PYTORCH", "OMP_", "MKL", "HIVEMIND", "TRANSFORMERS", "HF_", "PYTHON")
HEAVY = ("p2p_diloco.cli", "p2p_diloco.peer.build", "p2p_diloco.swarm.swarm", "p2p_diloco.training.model",
         "transformers.models.llama.modeling_llama", "p2p_diloco.cli.launcher", "p2p_diloco.local.cluster")


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that the imports read."""
    return {k: v for k, v in env.items() if k.startswith(IMPORTED_AT_START)}


# ----------------------------------------------------------------------------------------------------------- server
def serve(path: str) -> None:
    started_with = import_time_env(dict(os.environ))  # before the imports set any (torch sets TORCHINDUCTOR_...)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # as the CLI does before hivemind is imported
    import importlib

    for name in HEAVY:
        importlib.import_module(name)
    # A fork copies one thread: a lock another one held would stay held in every child. The imports start no Python
    # thread; the two native ones are numpy's and scipy's OpenBLAS pools (seen with gdb), which OpenBLAS stops
    # before a fork and restarts after it (pthread_atfork).
    if threading.active_count() != 1:
        sys.exit(f"zygote: threads {[t.name for t in threading.enumerate()]} after the imports; cannot fork safely")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    print(json.dumps({"ready": True, "env": started_with}), flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _report_exits(children)
        if listener in readable:
            conn, _ = listener.accept()
            pid = _start_child(conn, [listener, *children.values()], (wake_r, wake_w))
            if pid is not None:
                conn.send(json.dumps({"pid": pid}).encode())
                children[pid] = conn
            _report_exits(children)  # one that ended before it was registered


def _report_exits(children: dict[int, socket.socket]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # (reaped by no one else: never seen)
            done, status = pid, 255 << 8
        if done:
            conn = children.pop(pid)
            try:
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            conn.close()


def _start_child(conn: socket.socket, ours: list[socket.socket], wake: tuple[int, int]) -> int | None:
    """Fork the child ``conn`` asks for; its pid (None if the request was refused). ``ours``: the zygote's sockets
    (listener, other children's connections), which the child closes: a copy kept open would hide the zygote's end
    from a client."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(msg)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"error": f"expected 3 descriptors, got {len(fds)}"}).encode())
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sock in (*ours, conn):
                sock.close()
            code = _run_child(request, fds, wake)
        except BaseException:  # noqa: BLE001 (the child must never go back to the server's loop)
            import traceback

            traceback.print_exc()
        raise ChildExit(code)
    for fd in fds:
        os.close(fd)
    return pid


def _run_child(request: dict, fds: list[int], wake: tuple[int, int]) -> int:
    signal.set_wakeup_fd(-1)
    for fd in wake:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("netns"):
        _enter_netns(request["netns"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from hivemind.utils.mpfuture import MPFuture
    import numpy

    MPFuture.reset_backend()  # process-shared locks made at import: each peer its own
    numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move this process into network namespace ``name``, as ``ip netns exec NAME`` does for the command it runs
    (the mount namespace ``ip`` also makes, for a /sys of that namespace, is not needed by a peer). Its children,
    p2pd among them, inherit it."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class ChildExit(SystemExit):
    """Ends a child: up through the server's frames (none of them holds anything) to the interpreter's own exit,
    which then does what a started process's exit does (non-daemon threads, atexit handlers, flushes)."""


# ----------------------------------------------------------------------------------------------------------- client
class Refused(Exception):
    """The zygote cannot run this request (its environment differs where the imports read it)."""


class ZygoteProcess:
    """A child of the zygote, with the part of :class:`subprocess.Popen`'s interface that ``PeerProcess`` uses.

    Args:
        path: the zygote's socket.
        zygote_env: the variables its imports read (what it printed when ready).
        module, args, env, cwd: what ``python -m module args`` would run, where and with which environment.
        stdin: a pipe to write to (True) or /dev/null.
        stderr: a file to write stderr to, or None for a pipe.
        netns: the network namespace to run in (what ``ip netns exec NETNS`` would run it in), or None.
        text: ``stdout`` (and a piped ``stderr``) as text, as ``subprocess.Popen(text=True)`` gives them.
    """

    def __init__(self, path: str, zygote_env: dict, module: str, args: list[str], env: dict[str, str],
                 cwd: str | None, stdin: bool = False, stderr=None, netns: str | None = None, text: bool = False):
        if import_time_env(env) != zygote_env:
            raise Refused("the environment differs where the imports read it")
        self.args, self.returncode = [module, *args], None
        out_r, out_w = os.pipe()
        theirs: list[int] = []
        if stdin:
            in_r, in_w = os.pipe()
            theirs.append(in_r)
            self.stdin = os.fdopen(in_w, "wb")
        else:
            theirs.append(os.open(os.devnull, os.O_RDONLY))
            self.stdin = None
        theirs.append(out_w)
        if stderr is None:
            err_r, err_w = os.pipe()
            theirs.append(err_w)
            self.stderr = os.fdopen(err_r, "r" if text else "rb")
        else:
            theirs.append(os.dup(stderr.fileno()))
            self.stderr = None
        self.stdout = os.fdopen(out_r, "r" if text else "rb")
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(path)
            request = {"module": module, "args": list(args), "env": env, "cwd": str(cwd) if cwd else os.getcwd(),
                       "netns": netns}
            socket.send_fds(self._conn, [json.dumps(request).encode()], theirs)
            reply = json.loads(self._conn.recv(1 << 16) or b"{}")
        except OSError as e:  # the zygote has ended
            reply = {"error": repr(e)}
        finally:
            for fd in theirs:  # the child's copies are in the zygote's child now
                os.close(fd)
        if "pid" not in reply:
            raise Refused(reply.get("error", "the zygote did not answer"))
        self.pid = reply["pid"]

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        return self.returncode

    def _read_exit(self) -> None:
        reply = json.loads(self._conn.recv(1 << 16) or b'{"returncode": -9}')  # the zygote itself died: as killed
        self.returncode = reply["returncode"]
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(module: str, args: list[str], env: dict[str, str], tag: str, **kwargs) -> ZygoteProcess | None:
    """``python -m module args`` forked from this test process's zygote and counted as ``tag``'s (tests/conftest.py
    finds it by its session); None when there is no zygote or it cannot run this (start the process yourself).
    ``kwargs``: :class:`ZygoteProcess`'s ``cwd``, ``stdin``, ``stderr``, ``netns``, ``text``."""
    where = active()
    if where is None:
        return None
    kwargs.setdefault("cwd", None)
    try:
        child = ZygoteProcess(*where, module, args, env, **kwargs)
    except Refused:
        return None
    SESSIONS.setdefault(tag, set()).add(child.pid)
    return child


def start_zygote(path: str, timeout: float = 180.0) -> tuple[subprocess.Popen, dict]:
    """Start a zygote listening on ``path``; its process and the import-time variables it runs with."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", path], stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    deadline = time.monotonic() + timeout
    if not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        proc.kill()
        raise RuntimeError("the zygote did not start")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the zygote ended ({proc.wait()})")
    return proc, json.loads(line)["env"]


SESSIONS: dict[str, set[int]] = {}  # test tag -> sessions (pids) of the children started for it
_zygote: dict = {}  # this test process's: "proc", "dir", "env"; "failed" once a start failed


def active() -> tuple[str, dict] | None:
    """This test process's zygote (started at the first call): its socket and import-time variables; None when
    ``P2P_DILOCO_TEST_ZYGOTE=0``, or when it could not start or has ended (peers are then started as before)."""
    if os.environ.get("P2P_DILOCO_TEST_ZYGOTE", "1") == "0" or _zygote.get("failed"):
        return None
    if "proc" not in _zygote:
        directory = tempfile.mkdtemp(prefix="p2p-diloco-zygote-")
        try:
            _zygote["proc"], _zygote["env"] = start_zygote(os.path.join(directory, "s"))
        except (OSError, RuntimeError) as e:
            print(f"zygote: {e}; peers are started one by one", file=sys.stderr)
            _zygote["failed"] = True
            shutil.rmtree(directory, ignore_errors=True)
            return None
        _zygote["dir"] = directory
    if _zygote["proc"].poll() is not None:
        return None
    return os.path.join(_zygote["dir"], "s"), _zygote["env"]


def stop() -> None:
    """End this test process's zygote, if it started one."""
    proc = _zygote.pop("proc", None)
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        shutil.rmtree(_zygote.pop("dir"), ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
