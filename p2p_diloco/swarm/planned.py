"""A peer's address fixed before it starts, so that the peers joining it can start at the same time.

A peer's multiaddr is its listening port and its peer id, and by default both are chosen at start-up (any free
port, a fresh key): its joiners can only be started once it printed them, one start-up (~5 s of imports, model
and DHT) after it. ``p2p-diloco swarm`` (and the swarm tests) instead fix both in advance: an identity file made
here and a free port; the joiners start with it at once and keep trying it (``swarm.initial_peers_wait``) until the
first peer listens. Their start-ups overlap.

The port is taken below the kernel's ephemeral range, from which every ``tcp/0`` listener and outgoing connection
of this machine draws its port: another program that binds a port by itself, between our check and the peer's
bind, is the only way to take it (the peer then fails with "address already in use").
"""

from __future__ import annotations

import random
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10_000  # below: well-known and registered services' ports, which we leave alone
TRIES = 64


@dataclass(frozen=True)
class PlannedPeer:
    """What the first peer is started with (``identity_path``, ``host_maddr``) and what its joiners dial."""

    identity_path: str
    host_maddr: str
    maddr: str

    def join_args(self) -> list[str]:
        """The first peer's ``join`` arguments that fix its address."""
        return ["--identity-path", self.identity_path, "--host-maddrs", self.host_maddr]


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on ``host`` now.

    Args:
        host: the IPv4 address to bind.
        rng: where the random candidates come from (tests give a seeded one).

    Returns:
        A port below the kernel's ephemeral range if that leaves room (module docstring), else the kernel's choice.
    """
    rng = rng or random.Random()
    try:
        low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low - LOWEST_PORT >= 1000:
        for _ in range(TRIES):
            port = rng.randrange(LOWEST_PORT, low)
            if _port_is_free(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def plan_peer(directory: str | Path, host: str = "127.0.0.1") -> PlannedPeer:
    """A peer's address before it starts.

    Args:
        directory: where to write its new identity file (a new name each time: another run's peer id, reused,
            would mix two runs' logs under one ``<log dir>/<peer id>/``).
        host: the IPv4 address it will listen on.

    Returns:
        Its identity file, listening address and full multiaddr (with ``/p2p/<peer id>``).
    """
    from .identity import Identity  # hivemind: imported only by the commands that start peers

    name = f"first-peer-{secrets.token_hex(4)}.identity"
    identity = Identity(Path(directory) / name)  # created: a new key, readable by us only
    port = free_port(host)
    return PlannedPeer(identity.path, f"/ip4/{host}/tcp/{port}", f"/ip4/{host}/tcp/{port}/p2p/{identity.peer_id}")
