"""Shared fixtures. Every process a test starts carries a unique tag in its environment (inherited by the DHT,
averager and p2pd processes too), so a test can prove that nothing it started is still running, and the
``reap`` fixture kills whatever is left even when the test failed."""

from __future__ import annotations

import os
import time
import uuid

import psutil
import pytest

from p2p_diloco.runtime.processes import kill_group
from tests import zygote

TAG_VAR = "P2P_DILOCO_TEST_TAG"


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Every live (non-zombie) process whose environment carries ``tag``, or that runs in the session of a peer the
    test's zygote forked for ``tag`` (its environment is the zygote's, as /proc shows it: tests/zygote.py)."""
    found, sessions = [], zygote.SESSIONS.get(tag, set())
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(TAG_VAR) == tag or (sessions and os.getsid(proc.pid) in sessions):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ProcessLookupError):
            continue
    return found


def _is_shm_manager(proc: psutil.Process) -> bool:
    try:
        return proc.name().startswith("torch_shm")
    except psutil.Error:
        return False


def survivors(tag: str, grace: float = 15.0) -> list[str]:
    """Command lines of tagged processes still alive after ``grace`` seconds (torch_shm_manager needs a few
    seconds after its last client exits to delete the shared-memory files and quit by itself)."""
    deadline = time.monotonic() + grace
    while True:
        alive = tagged_processes(tag)
        if not alive or time.monotonic() > deadline:
            return [" ".join(p.cmdline()) for p in alive]
        time.sleep(0.5)


LAYERS = {"unit", "sim", "swarm"}  # each test directory's marker (tests/<layer>/)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group marker into the node id's suffix
def pytest_collection_modifyitems(config, items):
    """Every test carries the marker of its directory, so that ``-m unit``/``sim``/``swarm`` select exactly it.

    Under pytest-xdist (``-n 2 --dist loadgroup``, the test command in .ci/run) the ``slow`` tests, which run several
    peer processes each, all go to one worker, one after the other: two of them at once on 2 cores would slow each
    other's peers past their timeouts. A slow test also marked ``light`` (one peer process at a time, or a few small
    ones that train no model, and timeouts with room to spare) stays out of that group: the other worker runs it
    beside the heavy one, as it runs the fast tests, instead of idling once those are done.
    """
    for item in items:
        layer = item.path.parent.name
        if layer in LAYERS and not item.get_closest_marker(layer):
            raise pytest.UsageError(f"{item.nodeid} lacks its directory's marker: pytestmark = pytest.mark.{layer}")
        if item.get_closest_marker("light") and not item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked light but not slow: light says which slow tests may "
                                    "run beside another")
        if item.get_closest_marker("slow") and not item.get_closest_marker("light"):
            item.add_marker(pytest.mark.xdist_group("peer-processes"))


def pytest_runtest_setup(item):
    """Fail a slow test that xdist did not put in its group: with pytest 9.2, xdist 3.8 set the group where pytest no
    longer read the node id, and slow tests ran two at a time (multi-peer tests on 2 cores: peers missed their
    timeouts, CI failed)."""
    if (getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("slow")
            and not item.get_closest_marker("light") and not item.nodeid.endswith("@peer-processes")):
        pytest.fail("pytest-xdist did not put this slow test in the peer-processes group (check the pinned pytest "
                    "and pytest-xdist in constraints.txt)", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def peer_zygote():
    """Ends the zygote this test process started for its peers, if any (tests/zygote.py)."""
    yield
    zygote.stop()


@pytest.fixture
def reap():
    """A fresh tag for this test's processes; at teardown every tagged process still alive is killed
    (:func:`reap_tagged`)."""
    tag = uuid.uuid4().hex
    yield tag
    reap_tagged(tag)


def reap_tagged(tag: str) -> None:
    """Kill every process whose environment carries ``tag``, except torch's ``torch_shm_manager``: it deletes the
    /dev/shm files of the tensors its clients shared (hivemind's file_system strategy) 2 s after its last client is
    gone, and then exits by itself; killed in those 2 s, it left them (6 files after each 3-peer test of
    test_averager.py). Its clients are tagged processes, all killed here, so it outlives them by those 2 s only."""
    leftovers = [p for p in tagged_processes(tag) if not _is_shm_manager(p)]
    for proc in leftovers:
        kill_group(proc.pid)  # (and its tensors' /dev/shm files)
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(leftovers, timeout=10)
