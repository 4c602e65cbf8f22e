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
from p2p_diloco.runtime.processes import kill_group
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


def _stop(procs: list[subprocess.Popen]) -> None:
    """Let the probe peers end (their stdin closes), killing those that do not within 15 s."""
    for p in procs:
        p.stdin.close()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            kill_group(p.pid)
        p.stdout.close()


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
        _stop(procs)
        a.shutdown()


def _p2pd_connect(swarm: Swarm, peer_id: str, maddrs: list) -> None:
    """Ask our p2pd to connect to ``peer_id`` (with no address: by its own routing)."""
    from hivemind.p2p import PeerID

    async def go():
        await (await swarm._prober._client()).connect(PeerID.from_base58(peer_id), maddrs)
    asyncio.run_coroutine_threadsafe(go(), swarm._prober._loop).result(timeout=10)


def test_introductions_reach_a_round_mate_that_p2pds_routing_cannot_find(reap):
    """The four-peer stall (probe.py: introductions): a round-mate our p2pd never met is not found by p2pd's
    routing; the addresses of its signed record connect us. Two peers on separate DHTs: nothing routes between
    them but the introduction."""
    cfg = Config()
    cfg.run.run_id = f"intro-{uuid.uuid4().hex[:6]}"
    cfg.swarm.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    a = Swarm(cfg, [torch.zeros(8)], lambda: ({}, []))
    proc = None
    try:
        a.start()
        proc = _spawn(cfg.run.run_id, [], reap)  # no initial peer: a DHT of its own
        b = json.loads(proc.stdout.readline() or "null")
        assert b, "the probe peer did not start"
        with pytest.raises(Exception, match="routing: not found|failed to find"):
            _p2pd_connect(a, b["peer_id"], [])
        assert a._prober.introduce({b["peer_id"]: ["/ip4/127.0.0.1/tcp/1"]}, 1.0) == 0  # nobody there: no harm
        # as the syncer asks: the round-mates of the group, with the records read from the DHT (here: given)
        a._seen[b["peer_id"]] = ({"maddrs": b["maddrs"]}, float("inf"))
        a._seen[UNKNOWN] = ({"maddrs": b["maddrs"], "client": True}, float("inf"))  # never dialled
        assert a._introduce([b["peer_id"], UNKNOWN, a.peer_id]) == 1  # b only: not the client, not us
        assert b["peer_id"] in asyncio.run_coroutine_threadsafe(a._prober._connections(), a._prober._loop).result(5)
        assert a._prober.introduce({b["peer_id"]: b["maddrs"]}, 1.0) == 0  # already connected: nothing to do
    finally:
        _stop([proc] if proc is not None else [])
        a.shutdown()
