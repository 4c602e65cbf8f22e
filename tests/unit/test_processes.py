"""Process-level settings of a peer, and the harness that runs peer processes (PeerProcess)."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.unit

_PROBE = textwrap.dedent("""
    import ctypes, sys
    from p2p_diloco.runtime.processes import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")]

    if sys.argv[1] == "keep":
        assert keep_freed_memory() is True
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.mallinfo2.restype = MallInfo2
    block = libc.malloc(40_000_000)
    print(libc.mallinfo2().hblkhd >= 40_000_000)  # True: the block is its own mmap, unmapped again on free
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists only on Linux")
@pytest.mark.parametrize("mode, mmapped", [("default", "True"), ("keep", "False")])
def test_keep_freed_memory_serves_large_blocks_from_the_reusable_heap(mode, mmapped):
    # In a fresh interpreter: the setting is process-wide and must not leak into the test process.
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == mmapped


def test_reap_children_can_be_limited_to_the_processes_a_part_started():
    import subprocess
    import sys

    from p2p_diloco.runtime.processes import descendants, reap_children

    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # e.g. a W&B service
    try:
        assert {ours.pid, other.pid} <= descendants()
        reap_children(timeout=5.0, only={ours.pid})
        assert ours.wait(timeout=5) is not None
        assert other.poll() is None  # left alone
    finally:
        other.kill()
        other.wait()


# PeerProcess: a fake peer (this module run as ``python -m tests.unit.test_processes MODE ...``, see the bottom).
FAKE = "tests.unit.test_processes"
PEER = "12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"


def test_peer_process_reads_the_join_line_output_and_events(tmp_path):
    from p2p_diloco.metrics.events import Event
    from p2p_diloco.runtime.peer_process import PeerProcess

    proc = PeerProcess(["join", str(tmp_path)], module=FAKE, env={"FAKE_PEER_VAR": "x", "HOME": None})
    try:
        assert proc.wait_joined(30) == [f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"]
        assert proc.peer_id == PEER and proc.run_id == "r1" and proc.joined
        assert proc.poll() is None and proc.returncode is None
        assert [e["event"] for e in proc.events(tmp_path)] == [Event.ROUND_START, Event.OUTER_STEP]
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        assert proc.wait_output(10)
        assert proc.lines[0] == "env x None\n"
        assert "fake peer on stderr\n" in proc.err_lines and "fake peer on stderr" in proc.stderr_tail(1)
    finally:
        proc.kill_group()
        proc.wait(10)


def _late_readers(monkeypatch):
    """Hold each reader thread back by 1 s, so that it is always the last (as under a loaded CI machine)."""
    from p2p_diloco.runtime.peer_process import PeerProcess

    def late(read):
        def reader(self):
            time.sleep(1.0)
            read(self)
        return reader

    for name in ("_read_stdout", "_read_stderr"):
        monkeypatch.setattr(PeerProcess, name, late(getattr(PeerProcess, name)))


def test_the_lines_of_an_exited_process_are_there_when_wait_returns(monkeypatch):
    # A process that exited has written all its output into the pipes, but the reader threads may not have read it
    # yet: tests that checked a peer's one-line refusal right after wait() could miss it (a CI failure of this
    # kind: err_lines still empty). Waiting for the pipes' end is no answer: a peer's p2pd and forks hold them open
    # after the main process exits ("linger" here). wait() and poll() read what is left in the pipes themselves.
    from p2p_diloco.runtime.peer_process import PeerProcess, PeerStartError

    _late_readers(monkeypatch)
    proc = PeerProcess(["fail"], module=FAKE)
    try:
        assert proc.wait(30) == 3
        # (the unfinished last line too: nobody else held the pipe, so it ended)
        assert proc.lines == ["last words\n", "tail"] and proc.err_lines == ["boom\n"]
        assert proc.wait_output(0)
    finally:
        proc.kill_group()
    lingering = PeerProcess(["linger"], module=FAKE)
    try:
        t0 = time.monotonic()
        while lingering.poll() is None:
            time.sleep(0.01)
        assert lingering.returncode == 4 and lingering.lines == ["bye\n"] and lingering.err_lines == ["bye 2\n"]
        assert lingering.wait(10) == 4 and time.monotonic() - t0 < 10  # not the 60 s its child holds the pipes
        assert not lingering.wait_output(0.1)
    finally:
        lingering.kill_group()
    # the error of a process that exited before its join line carries its last stderr line, the reason
    failed = PeerProcess(["fail"], module=FAKE)
    try:
        with pytest.raises(PeerStartError, match=r"exited \(3\)[\s\S]*boom"):
            failed.wait_joined(30)
    finally:
        failed.kill_group()


def test_line_reader_reads_as_text_mode_would_and_drains_what_is_there():
    import os
    import threading

    from p2p_diloco.runtime.pipe_lines import LineReader

    r, w = os.pipe()
    seen, ends = [], []
    reader = LineReader(os.fdopen(r, "rb"), [], seen.append, lambda: ends.append(len(seen)))
    # CRLF and CR are newlines, a bad byte is replaced, a character split across two writes is whole
    os.write(w, b"a\r\nb\rc\xff\n\xc3")
    reader.drain()  # no thread yet: drain alone reads what is in the pipe, and returns when it is empty
    assert reader.lines == ["a\n", "b\n", "c\ufffd\n"] and not reader.eof.is_set()
    os.write(w, b"\xa9 and the rest")
    thread = threading.Thread(target=reader.run, daemon=True)
    thread.start()
    os.close(w)
    thread.join(10)
    assert reader.lines == ["a\n", "b\n", "c\ufffd\n", "\u00e9 and the rest"] and reader.eof.is_set()
    assert seen == reader.lines and ends == [4]  # on_line for each, on_eof once, after the last
    reader.drain()  # after the end: nothing more, no second on_eof
    assert ends == [4]


def test_peer_process_that_exits_without_joining_is_a_clear_error(tmp_path):
    from p2p_diloco.runtime.peer_process import PeerProcess, PeerStartError

    t0 = time.monotonic()
    proc = PeerProcess(["fail"], module=FAKE, stderr=tmp_path / "err.log", log_command=True)
    with pytest.raises(PeerStartError, match=r"exited \(3\)[\s\S]*boom"):
        proc.wait_joined(60)
    assert time.monotonic() - t0 < 30  # the process's end, not the timeout
    assert proc.peer_id is None and proc.events(tmp_path) == [] and not proc.joined
    log = (tmp_path / "err.log").read_text().splitlines()
    assert log[0].endswith(f"-m {FAKE} fail") and log[-1] == "boom"


def test_stop_all_leaves_nothing_of_the_process_groups(monkeypatch):
    from p2p_diloco.runtime import peer_process
    from p2p_diloco.runtime.peer_process import PeerProcess, stop_all
    from p2p_diloco.runtime.processes import wait_group_gone

    # stop_all waits up to 10 s for a group to empty by itself (torch_shm_manager); 1 s is enough here
    monkeypatch.setattr(peer_process, "wait_group_gone", lambda pgid, timeout: wait_group_gone(pgid, min(timeout, 1)))
    polite = PeerProcess(["group"], module=FAKE)  # exits on SIGTERM, its child stays in the group
    stubborn = PeerProcess(["group", "--ignore-term"], module=FAKE)
    done = PeerProcess(["fail"], module=FAKE)
    for p in (polite, stubborn):
        p.wait_joined(30)
    done.wait(30)
    t0 = time.monotonic()
    stop_all([polite, stubborn, done], grace=2)
    assert time.monotonic() - t0 < 15
    assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL and done.returncode == 3
    # nothing runs; a killed child, reparented to init, may stay a zombie until init reaps it
    assert all(wait_group_gone(p.pid, 10) for p in (polite, stubborn, done))


def test_signal_group_reaches_every_process_of_the_group():
    from p2p_diloco.runtime.peer_process import PeerProcess
    from p2p_diloco.runtime.processes import wait_group_gone

    proc = PeerProcess(["group", "--ignore-term"], module=FAKE)
    proc.wait_joined(30)
    proc.signal_group(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    assert wait_group_gone(proc.pid, timeout=10)
    proc.kill_group()  # a group already gone is ignored


_SHARING = ("import time, torch, torch.multiprocessing as mp\n"
            "mp.set_sharing_strategy('file_system')  # as hivemind sets it\n"
            "t = torch.zeros(1000).share_memory_()\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)")


def test_a_killed_group_leaves_no_shared_memory_files():
    # the files are gone as soon as the group is: torch's torch_shm_manager (a group of its own) deletes them only
    # 2 s after its last client is gone, and not at all if it is killed meanwhile
    from pathlib import Path

    from p2p_diloco.runtime.processes import kill_group, wait_group_gone

    proc = subprocess.Popen([sys.executable, "-c", _SHARING], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        files = list(Path("/dev/shm").glob(f"torch_{proc.pid}_*"))
        assert files, "no shared-memory file: nothing to test"
        kill_group(proc.pid)
        assert proc.wait(10) == -signal.SIGKILL and wait_group_gone(proc.pid, 10)
        assert not any(f.exists() for f in files)
    finally:
        kill_group(proc.pid)
        proc.wait(10)


def test_the_test_reaper_leaves_torch_shm_manager_to_delete_the_files():
    """Killed 2 s after its last client exited, torch_shm_manager left that client's /dev/shm files: the test
    fixture ``reap`` killed it so after every multi-peer test (6 files after each 3-peer test of
    tests/swarm/test_averager.py)."""
    import os
    import uuid
    from pathlib import Path

    from tests.conftest import TAG_VAR, reap_tagged

    tag = uuid.uuid4().hex
    exiting = _SHARING.replace("time.sleep(60)", "import os; os._exit(0)")  # no cleanup of its own: as a fork does
    proc = subprocess.Popen([sys.executable, "-c", exiting], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, TAG_VAR: tag})
    assert proc.stdout.readline() == "ready\n"
    files = list(Path("/dev/shm").glob(f"torch_{proc.pid}_*"))
    assert files and proc.wait(10) == 0
    reap_tagged(tag)  # at once: the manager is in its 2 s
    deadline = time.monotonic() + 5
    while any(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(f.exists() for f in files)


def _fake_peer(argv: list[str]) -> None:
    """``join LOG_DIR``: events, a join line, then sleep. ``group [--ignore-term]``: a child in the group, a join
    line, then sleep. ``fail``: a line and an unfinished one on stdout, one on stderr, exit 3. ``linger``: a child
    that holds the pipes 60 s, a line on each, exit 4."""
    import json
    import os
    from pathlib import Path

    if argv[0] == "fail":
        print("last words\ntail", end="")
        print("boom", file=sys.stderr)
        sys.exit(3)
    if argv[0] == "linger":  # a child in the group keeps the pipes (as p2pd does) after we exit
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("bye")
        print("bye 2", file=sys.stderr)
        sys.exit(4)
    if argv[0] == "join":
        print(f"env {os.environ.get('FAKE_PEER_VAR')} {os.environ.get('HOME')}", flush=True)
        folder = Path(argv[1]) / PEER
        folder.mkdir(parents=True)
        (folder / "events.jsonl").write_text("".join(json.dumps({"t": 0.0, "event": name, "round": 1}) + "\n"
                                                     for name in ("round_start", "outer_step")))
    else:
        subprocess.Popen([sys.executable, "-c", "import os, time\nparent = os.getppid()\n"  # same process group;
                          "while os.getppid() == parent:\n    time.sleep(0.1)"])  # it ends after its parent
        if "--ignore-term" in argv:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("fake peer on stderr", file=sys.stderr, flush=True)
    print(f"p2p-diloco join --initial-peers /ip4/127.0.0.1/tcp/4001/p2p/{PEER} --run-id r1", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    _fake_peer(sys.argv[1:])
