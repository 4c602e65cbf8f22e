"""Multi-host swarm (issue 7): a bootstrap "host" and three peer "hosts", each a network namespace with its own
address on one bridged LAN (tests/swarm/netns.py). The peers join through the bootstrap node's announced address
and complete rounds; one of them runs ``--client-mode`` behind a firewall that drops every inbound TCP connection,
and still contributes its pseudo-gradient to every round. The namespaces are deleted even when the test fails."""

import json
import subprocess
import sys

import pytest

from p2p_diloco.metrics.events import Event
from tests.swarm import netns
from p2p_diloco.metrics import read_events
from tests.swarm.helpers import FAULT, Proc, load_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300)]
ROUNDS = 3
REASON = netns.unavailable_reason()


@pytest.fixture
def lan():
    if REASON:
        pytest.skip(REASON)
    net = netns.Lan(["boot", "a", "b", "nat"])
    try:
        yield net.setup()
    finally:
        net.teardown()


def _connect_fails(lan, src: str, dst: str, port: int) -> bool:
    """Start a listener on ``dst`` and try to reach it from ``src``: True if the connection attempt fails."""
    listener = subprocess.Popen(lan.cmd(dst, sys.executable, "-c", (
        "import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
        f"s.bind(('{lan.ip[dst]}',{port}));s.listen();print('up',flush=True);s.settimeout(8)\n"
        "try:\n s.accept()\nexcept OSError:\n pass")), stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        probe = subprocess.run(lan.cmd(src, sys.executable, "-c", (
            f"import socket;socket.create_connection(('{lan.ip[dst]}',{port}),timeout=3)")), capture_output=True)
        return probe.returncode != 0
    finally:
        listener.kill()
        listener.wait()


def test_peers_on_three_hosts_join_through_a_bootstrap_node(tmp_path, reap, lan):
    lan.block_inbound("nat")
    assert _connect_fails(lan, "a", "nat", 9100) and not _connect_fails(lan, "nat", "a", 9101)
    boot_addr = f"/ip4/{lan.ip['boot']}/tcp/31337"
    boot = Proc(["bootstrap", "--host-maddrs", boot_addr, "--announce-maddrs", boot_addr], reap,
                prefix=lan.cmd("boot"))
    procs = []
    try:
        entry = boot.wait_joined(60)
        assert entry[0].startswith(boot_addr + "/p2p/"), entry  # it announces its LAN address
        # (--initial-peers-wait: as in test_client_push.py, one slow ping of the entry point must not end a peer)
        common = ["--initial-peers", *entry, "--initial-peers-wait", "60", "--run-id", "t-multihost", "--max-rounds",
                  str(ROUNDS), "--log-dir", str(tmp_path), "--set", "swarm.min_peers=3", *FAULT]
        for host in ("a", "b", "nat"):
            where = ["--client-mode"] if host == "nat" else ["--host-maddrs", f"/ip4/{lan.ip[host]}/tcp/0"]
            procs.append(Proc(["join", *where, *common, "--summary-json", str(tmp_path / f"{host}.json")], reap,
                              prefix=lan.cmd(host)))
        for p in procs:
            assert p.wait(200) == 0, p.stderr_tail()
    finally:
        boot.signal_group(15)
        boot.wait(30)
    summaries = {h: load_json(tmp_path / f"{h}.json") for h in ("a", "b", "nat")}
    assert len({s["global_digest"] for s in summaries.values()}) == 1, summaries
    for host, s in summaries.items():
        events = read_events(tmp_path / s["peer_id"] / "events.jsonl")
        groups = {e["round"]: e["group_size"] for e in events if e["event"] == Event.ALLREDUCE_DONE}
        assert set(groups.values()) == {3}, (host, groups)  # the client-mode peer is in every group formed
        # a member can abort a round the other two applied (README "Not guaranteed", seen once in CI); it must then
        # have taken their state: every round is accounted for
        caught_up = {e["round"] for e in events if e["event"] == Event.STATE_LOADED}
        assert set(range(1, ROUNDS + 1)) <= set(groups) | caught_up, (host, groups, caught_up)
    # the client-mode peer averaged in at least every round but one (the one it might have aborted)
    assert summaries["nat"]["rounds_participated"] >= ROUNDS - 1 and summaries["nat"]["bytes_sent"] > 0
    print(json.dumps({h: {k: s[k] for k in ("rounds_participated", "bytes_sent", "bytes_received")}
                      for h, s in summaries.items()}))
