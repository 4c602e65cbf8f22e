"""The zygote the swarm tests fork their peers from (tests/zygote.py): a forked process runs as a started one would,
what it leaves behind is found by its test's tag, and peers do not share hivemind's process-shared locks."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests import zygote
from tests.conftest import survivors, tagged_processes
from tests.swarm import netns
from tests.swarm.helpers import Proc

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]
PROBE = "tests.swarm.fork_probe"


def first_line(proc: Proc, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not proc.lines:
        assert proc.poll() is None, proc.stderr_tail()  # it ended without its line
        assert time.monotonic() < deadline, "no line"
        time.sleep(0.05)
    return json.loads(proc.lines[0])


def test_a_forked_process_has_its_directory_environment_session_and_exit_code(tmp_path, reap):
    proc = Proc(["7"], reap, cwd=tmp_path, module=PROBE)
    assert proc.wait(60) == 7, proc.stderr_tail()
    assert isinstance(proc.popen, zygote.ZygoteProcess) == (zygote.active() is not None)
    info = json.loads(proc.lines[0])
    assert info == {"cwd": str(tmp_path), "tag": reap, "pid": proc.pid, "sid": proc.pid, "argv": ["7"],
                    "netns": os.readlink("/proc/self/ns/net")}, info


def test_a_process_with_an_ip_netns_exec_prefix_runs_in_that_namespace(reap):
    """The namespace tests run peers under ``ip netns exec NS``: a forked one enters NS itself (setns), and ends up
    where the exec'd one does."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    name = f"p2pdfork{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        want = f"net:[{os.stat(f'/var/run/netns/{name}').st_ino}]"
        for fork in (True, False):
            proc = Proc(["0"], reap, module=PROBE, prefix=["ip", "netns", "exec", name], fork=fork)
            assert proc.wait(60) == 0, proc.stderr_tail()
            if fork:
                assert isinstance(proc.popen, zygote.ZygoteProcess) == (zygote.active() is not None)
            assert json.loads(proc.lines[0])["netns"] == want != os.readlink("/proc/self/ns/net")
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def test_what_a_killed_forked_process_leaves_is_found_by_its_tag(reap):
    """Neither the forked process nor its own child shows the tag in /proc/<pid>/environ (it shows the zygote's):
    they are found by the session, so a test's "nothing left" check still sees a leftover."""
    proc = Proc(["fork", "sleep"], reap, module=PROBE)
    first_line(proc)
    assert proc.pid in {p.pid for p in tagged_processes(reap)} and len(tagged_processes(reap)) == 2
    proc.signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    assert len(survivors(reap, grace=1.0)) == 1  # its child (the reap fixture kills it)


def test_peers_do_not_share_hivemind_process_locks(reap):
    """hivemind makes its MPFuture locks at import: forked from one zygote, peers would share them, and one killed
    while holding one would block the others for good. Each forked process makes its own."""
    holder = Proc(["hold-lock", "sleep"], reap, module=PROBE)
    assert first_line(holder)["held"]
    taker = Proc(["take-lock"], reap, module=PROBE)
    assert taker.wait(60) == 0, taker.stderr_tail()
    assert json.loads(taker.lines[0])["took"]
