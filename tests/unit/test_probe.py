"""SwarmPort.probe: a peer is reported refused only on proof, made by our own dial, that nothing listens where it
was reached (swarm/probe.py); the fake swarm keeps the same contract."""

import asyncio
import socket
import time

import pytest
from multiaddr import Multiaddr

from p2p_diloco.config import Config
from p2p_diloco.swarm.port import PROBE_MAX_IDS, check_probe
from p2p_diloco.swarm.probe import MARGIN, Prober, refused, tcp_address
from p2p_diloco.testing.fake_swarm import FakeNetwork
from p2p_diloco.testing.sim import Killed, Simulation

pytestmark = pytest.mark.unit


def _run(scenario):
    """Run ``scenario(net, swarms)`` on a fake network of peers a..e (e in client mode), all started."""
    out = {}
    with Simulation() as sim:
        net = FakeNetwork(sim)
        swarms = {}
        for name in "abcde":
            cfg = Config()
            cfg.swarm.client_mode = name == "e"
            swarms[name] = net.factory(name)(cfg, [], lambda: ({}, []))

        def main():
            for swarm in swarms.values():
                swarm.start()
            out.update(scenario(net, swarms))
            out["done"] = True

        sim.spawn(main, "scenario")
        sim.run(until=lambda: "done" in out, max_time=60.0)
    assert out.pop("done", False), "the scenario did not finish"
    return out


def test_fake_probe_reports_killed_and_left_peers_only():
    def scenario(net, s):
        everyone = ["b", "c", "d", "e", "a", "never-started"]
        seen = {"before": s["a"].probe(everyone, 1.0)}
        net.kill("b")
        net.freeze("c")
        s["d"].shutdown()
        net.kill("e")  # a client-mode peer: a refusal would prove nothing (it accepts no connections)
        seen["after"] = s["a"].probe(everyone, 1.0)
        net.thaw("c")
        seen["thawed"] = s["a"].probe(["c"], 1.0)
        return seen

    seen = _run(scenario)
    assert seen["before"] == frozenset()
    assert seen["after"] == {"b", "d"}  # not the frozen c, the client e, ourselves, nor a peer never reached
    assert seen["thawed"] == frozenset()


def test_fake_probe_checks_its_arguments_and_a_dead_caller_does_nothing():
    def scenario(net, s):
        for bad in (lambda: s["a"].probe(["b"] * (PROBE_MAX_IDS + 1), 1.0), lambda: s["a"].probe(["b"], 0),
                    lambda: s["a"].probe("b", 1.0)):
            with pytest.raises(ValueError):
                bad()
        net.kill("a")
        with pytest.raises(Killed):
            s["a"].probe(["b"], 1.0)
        return {}

    _run(scenario)


def test_check_probe_bounds():
    check_probe([f"p{i}" for i in range(PROBE_MAX_IDS)], 0.5)
    with pytest.raises(ValueError, match="at most"):
        check_probe([f"p{i}" for i in range(PROBE_MAX_IDS + 1)], 0.5)
    with pytest.raises(ValueError, match="timeout"):
        check_probe([], -1.0)


def test_tcp_address_takes_direct_tcp_multiaddrs_only():
    assert tcp_address("/ip4/127.0.0.1/tcp/4001") == (socket.AF_INET, "127.0.0.1", 4001)
    assert tcp_address("/ip6/::1/tcp/4001/p2p/QmPeer") == (socket.AF_INET6, "::1", 4001)
    for other in ("/ip4/1.2.3.4/udp/4001/quic", "/dns4/example.org/tcp/4001", "/ip4/1.2.3.4/tcp/0",
                  "/ip4/1.2.3.4/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmPeer", "/ip4/1.2.3.4/tcp/x", "/unix/a"):
        assert tcp_address(other) is None, other


async def _dial(address, seconds=1.0):
    return await refused(address, time.monotonic() + seconds)


def test_a_dial_is_refused_only_where_nothing_listens():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # never accept()ed: as a frozen process's socket, the kernel still completes the connect
    port = listener.getsockname()[1]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    free = closed.getsockname()[1]
    closed.close()
    try:
        assert asyncio.run(_dial((socket.AF_INET, "127.0.0.1", port))) is False
        assert asyncio.run(_dial((socket.AF_INET, "127.0.0.1", free))) is True
        assert asyncio.run(_dial((socket.AF_INET, "127.0.0.1", free), seconds=-1.0)) is False  # no time: no proof
    finally:
        listener.close()


def test_a_probe_returns_in_time_and_proves_nothing_when_p2pd_does_not_answer(tmp_path):
    path = tmp_path / "p2pd.sock"
    daemon = socket.socket(socket.AF_UNIX)
    daemon.bind(str(path))
    daemon.listen(8)  # accepts the control connection, never answers
    prober = Prober(Multiaddr(f"/unix{path}"), refresh=0.1)
    try:
        started = time.monotonic()
        assert prober.probe(["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"], 0.3) == frozenset()
        assert time.monotonic() - started < 0.3 + MARGIN
    finally:
        prober.close()
        daemon.close()
    assert not prober._thread.is_alive()
    assert prober.probe(["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"], 0.3) == frozenset()  # closed: no answer


def test_a_probe_dials_the_addresses_a_record_announces(tmp_path, monkeypatch):
    """Rule 2 (issue 20): a peer we never had a connection with is probed at the addresses its signed record
    announces (``maddrs``): before, only peers our p2pd had been connected to could ever be reported, and in a
    4-peer fault run one survivor never detected either of two dead round-mates."""
    async def nobody_connected(self):
        return set()

    monkeypatch.setattr(Prober, "_connections", nobody_connected)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    live = listener.getsockname()[1]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()[1]
    closed.close()
    prober = Prober(Multiaddr(f"/unix{tmp_path / 'none.sock'}"), refresh=10.0)
    try:
        announced = {"dead": [f"/ip4/127.0.0.1/tcp/{dead}/p2p/QmDead"], "live": [f"/ip4/127.0.0.1/tcp/{live}"],
                     "relayed": ["/p2p-circuit/p2p/QmX"], "silent": []}
        assert prober.probe(["dead", "live", "relayed", "silent", "unknown"], 1.0, announced) == {"dead"}
        both = {"half": [f"/ip4/127.0.0.1/tcp/{dead}", f"/ip4/127.0.0.1/tcp/{live}"]}
        assert prober.probe(["half"], 1.0, both) == set()  # every address must refuse
    finally:
        prober.close()
        listener.close()
