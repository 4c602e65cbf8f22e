"""The namespace LAN of the multi-host tests (tests/swarm/netns.py) cleans up after itself: nothing left running,
and no /dev/shm file of the peers' shared tensors."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.swarm import netns

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(60)]
SHARING = ("import os, sys, time, torch, torch.multiprocessing as mp\n"
           "mp.set_sharing_strategy('file_system')  # as hivemind sets it\n"
           "t = torch.zeros(1000).share_memory_()\n"
           "print('ready', flush=True)\n"
           "time.sleep(60) if sys.argv[1] == 'stay' else os._exit(0)  # (no cleanup of its own: as a fork does)")


def test_teardown_leaves_no_shared_memory_files():
    """One process in the namespace has exited (its torch_shm_manager, in the namespace too, is in the 2 s it waits
    before it deletes the files), one is still running: teardown at once, killing the manager with the rest, left
    both one's files in /dev/shm (22 after the client-push and multi-host tests)."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    lan = netns.Lan(["a"])
    lan.setup()
    try:
        procs = [subprocess.Popen(lan.cmd("a", sys.executable, "-c", SHARING, how), stdout=subprocess.PIPE,
                                  text=True, start_new_session=True) for how in ("exit", "stay")]
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
        files = [f for p in procs for f in Path("/dev/shm").glob(f"torch_{p.pid}_*")]
        assert len(files) >= 2 and procs[0].wait(10) == 0, files
    finally:
        lan.teardown()
    assert procs[1].wait(10) == -9
    deadline = time.monotonic() + 5
    while any(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [f.name for f in files if f.exists()]
