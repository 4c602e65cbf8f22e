"""A small LAN of network namespaces for multi-host swarm tests (root only).

One "switch" namespace holds a bridge; every host is a namespace with one veth port on it and its own address.
:meth:`Lan.block_inbound` gives a host a NAT-like firewall without netfilter (not available here): on the switch
port that leads to the host, TCP segments with SYN set and ACK clear (new inbound connections) are classified
into an htb class whose qdisc is ``blackhole``. The host's own outbound connections still work (their SYN-ACK has
ACK set).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

from p2p_diloco.runtime.processes import remove_shared_tensors


def _is_shm_manager(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith("torch_shm")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _kill(pid: int) -> bool:
    """SIGKILL ``pid``; False if it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _sh(*cmd: str, check: bool = True) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def unavailable_reason() -> str | None:
    """Why namespaces, veth and bridges cannot be set up here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"p2pdprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", name)
        try:
            _sh("ip", "-n", name, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        finally:
            _sh("ip", "netns", "del", name, check=False)
    except (RuntimeError, FileNotFoundError) as e:
        return f"cannot create network namespaces here: {e}"
    return None


class Lan:
    """Hosts on one bridged /24. ``ip[host]`` is a host's address; :meth:`cmd` prefixes a command to run in it."""

    def __init__(self, hosts: list[str]):
        tag = f"{os.getpid() % 100000}"
        self.subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 250)}"
        self.switch = f"p2pdsw{tag}"
        self.ns = {h: f"p2pd{h}{tag}" for h in hosts}
        self.ip = {h: f"{self.subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self._port = {h: f"sw{i}-{tag}" for i, h in enumerate(hosts)}
        self.created: list[str] = []

    def setup(self) -> Lan:
        _sh("ip", "netns", "add", self.switch)
        self.created.append(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host, ns in self.ns.items():
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            port = self._port[host]
            _sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        return self

    def block_inbound(self, host: str) -> None:
        """Drop new TCP connections towards ``host`` (SYN without ACK), as a NAT or firewall would."""
        tc = ["ip", "netns", "exec", self.switch, "tc"]
        port = self._port[host]
        _sh(*tc, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000")
        for cls in ("1:1", "1:2"):
            _sh(*tc, "class", "add", "dev", port, "parent", "1:", "classid", cls, "htb", "rate", "10gbit")
        _sh(*tc, "qdisc", "add", "dev", port, "parent", "1:2", "handle", "20:", "blackhole")
        # IPv4 without options (Linux TCP sends none): the TCP flags byte is at offset 20 + 13
        _sh(*tc, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x02", "0x12", "at", "33", "flowid", "1:2")

    def cmd(self, host: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def teardown(self) -> None:
        """Kill whatever still runs in our namespaces, then delete them (the veth pairs go with them).

        torch's ``torch_shm_manager`` runs in the namespace of the peer that started it: it is left a few seconds to
        delete the /dev/shm files of the peers' tensors and quit once its last client is gone (killed at once, it
        left them there: 22 after the client-push and three-host tests); the shared-memory files of the processes
        killed here go with them."""
        pids = [int(pid) for ns in self.created for pid in _sh("ip", "netns", "pids", ns, check=False).split()]
        managers = [pid for pid in pids if _is_shm_manager(pid)]
        killed = [pid for pid in pids if pid not in managers and _kill(pid)]
        remove_shared_tensors(killed)
        deadline = time.monotonic() + 5.0
        while any(_alive(pid) for pid in managers) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in managers:
            _kill(pid)
        time.sleep(0.2)
        for ns in reversed(self.created):
            _sh("ip", "netns", "del", ns, check=False)
        self.created.clear()
