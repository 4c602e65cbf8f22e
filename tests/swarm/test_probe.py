"""SwarmPort.probe over real processes: a peer whose main process is ``kill -9``ed is reported refused within a
second (its DHT, averager and p2pd die with it: swarm/starting.py), a SIGSTOPped one never is.

One in-process Swarm probes two subprocess peers (probe_peer.py). Before starting.py tied the children to the main
process, a ``kill -9`` of the main process alone left p2pd listening (and connected) for good: the probe never
reported it."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from p2p_diloco.config import Config
from p2p_diloco.swarm.probe import refused, tcp_address
from p2p_diloco.swarm.swarm import Swarm
from tests.conftest import TAG_VAR

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(90)]
SCRIPT = Path(__file__).with_name("probe_peer.py")
UNKNOWN = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a well-formed peer id of nobody here


def _spawn(run_id: str, initial: list[str], tag: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), run_id, *initial], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=Path(__file__).parents[2],
                            env={**os.environ, TAG_VAR: tag})


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s")


def _running(pid: int) -> bool:
    """A live process of the peer's (torch_shm_manager is left to clean shared memory up once it is alone)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and not proc.name().startswith("torch_shm")
    except psutil.NoSuchProcess:
        return False


def test_probe_reports_a_killed_peer_at_once_and_never_a_frozen_one(reap):
    cfg = Config()
    cfg.run.run_id = f"probe-{uuid.uuid4().hex[:6]}"
    cfg.swarm.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    a = Swarm(cfg, [torch.zeros(8)], lambda: ({}, []))
    procs: list[subprocess.Popen] = []
    frozen: list[psutil.Process] = []
    try:
        a.start()
        procs = [_spawn(cfg.run.run_id, a.visible_maddrs(), reap) for _ in range(2)]
        victim, sleeper = (json.loads(p.stdout.readline() or "null") for p in procs)
        assert victim and sleeper, "a probe peer did not start"
        known = lambda: all(p["peer_id"] in a._prober._known for p in (victim, sleeper))  # noqa: E731
        _wait(known, 10.0, "our p2pd connected to both peers")
        assert a.probe([victim["peer_id"], sleeper["peer_id"], UNKNOWN], 1.0) == frozenset()

        frozen = [psutil.Process(pid) for pid in (sleeper["pid"], *sleeper["owned"])]
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)
        address = tcp_address(sleeper["maddrs"][0])
        assert asyncio.run(refused(address, time.monotonic() + 1.0)) is False  # its kernel still accepts
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)  # the main process only
        _wait(lambda: victim["peer_id"] in a.probe([victim["peer_id"], sleeper["peer_id"]], 1.0), 5.0,
              "the killed peer reported refused")
        seconds = time.monotonic() - killed_at
        assert seconds < 1.5, f"the killed peer was reported {seconds:.2f} s after the kill"
        _wait(lambda: not any(map(_running, victim["owned"])), 1.0, "its DHT, averager and p2pd died with it")
        until = time.monotonic() + 2.0
        while time.monotonic() < until:  # the frozen peer, connected or not, is never reported
            assert sleeper["peer_id"] not in a.probe([sleeper["peer_id"]], 0.5)
            time.sleep(0.1)
    finally:
        for proc in frozen:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            p.stdout.close()
        a.shutdown()
