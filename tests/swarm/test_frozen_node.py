"""A frozen DHT node must not hide live peers: four real Swarms, one SIGSTOPped (its DHT, p2pd and averager
processes), and the others must see each other at every read while it stays frozen.

hivemind waits ``wait_timeout`` for each kademlia RPC, and a store routed through a frozen node waits twice before
the node is blacklisted; with hivemind's 3 s that is 6 s = the record lifetime, so every live record expired at once
(both survivors read an empty view for about a second). starting.py's ``dht_rpc_timeout`` keeps the stall well inside
the lifetime."""

import signal
import time
import uuid

import psutil
import pytest
import torch

from p2p_diloco.config import Config
from p2p_diloco.protocol.records import Phase
from p2p_diloco.swarm.swarm import Swarm

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(150)]
WATCH = 14.0  # seconds of reads after the freeze: the stall, the blacklist, and the frozen record's expiry


def _swarm(run_id: str, initial: list[str]) -> Swarm:
    cfg = Config()
    cfg.run.run_id = run_id
    cfg.swarm.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    cfg.swarm.initial_peers = initial
    swarm = Swarm(cfg, [torch.zeros(8)], lambda: ({}, []))
    swarm.start()
    swarm.publish(phase=Phase.TRAIN, round=1)
    return swarm


def test_a_frozen_dht_node_does_not_hide_live_peers():
    run_id = f"frz-{uuid.uuid4().hex[:6]}"
    swarms: list[Swarm] = []
    frozen: list[psutil.Process] = []
    try:
        swarms.append(_swarm(run_id, []))
        for _ in range(3):
            swarms.append(_swarm(run_id, swarms[0].visible_maddrs()))
        a, b, c, d = swarms
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (len(a.live_peers()) < 3 or len(b.live_peers()) < 3):
            time.sleep(0.3)
        assert set(a.live_peers()) == {b.peer_id, c.peer_id, d.peer_id}
        frozen = [psutil.Process(pid) for pid in sorted(d._owned)]  # its DHT, p2pd and averager processes
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)
        gaps, d_gone = [], None
        start = time.monotonic()
        while time.monotonic() - start < WATCH:
            for reader, others in ((a, {b.peer_id, c.peer_id}), (b, {a.peer_id, c.peer_id})):
                seen = set(reader.live_peers())
                if not others <= seen:
                    gaps.append((round(time.monotonic() - start, 1), sorted(others - seen)))
                if d.peer_id not in seen and d_gone is None:
                    d_gone = time.monotonic() - start
            time.sleep(0.3)
        assert not gaps, f"live peers went missing while a DHT node was frozen (seconds after the freeze): {gaps}"
        # the frozen peer itself drops out once its record expires (it stopped refreshing it)
        assert d_gone is not None and d_gone < 2 * d.sc.peer_ttl + 2, d_gone
    finally:
        for proc in frozen:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        for swarm in reversed(swarms):
            swarm.shutdown()
