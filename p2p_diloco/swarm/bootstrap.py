"""A bootstrap node: a DHT-only peer that does no training, keeps a stable peer id, and gives newcomers a first
address to join through (``p2p-diloco bootstrap``).

It runs the same record validator as the training peers, so the signed records it holds for the swarm are
checked on it too (see identity.py). Any training peer is just as good an entry point; a bootstrap node is one
that stays up and keeps its address and id across restarts.
"""

from __future__ import annotations

from typing import Sequence

import hivemind

from ..errors import SwarmError
from ..runtime.processes import reap_children
from .identity import Identity
from .starting import start_dht, start_failure


class BootstrapNode:
    """Args: the listen and announce multiaddrs, an identity file (or None: a new id each start), how long
    p2pd may take to start, and other nodes to connect to (with them, an identity already live is refused)."""

    def __init__(self, host_maddrs: Sequence[str], announce_maddrs: Sequence[str] = (),
                 identity_path: str | None = None, startup_timeout: float = 30.0,
                 initial_peers: Sequence[str] = ()):
        self.host_maddrs, self.announce_maddrs = list(host_maddrs), list(announce_maddrs)
        self.initial_peers = list(initial_peers)
        self.identity_path, self.startup_timeout = identity_path, startup_timeout
        self.dht: hivemind.DHT | None = None
        self.peer_id: str | None = None

    def start(self) -> None:
        identity = Identity(self.identity_path)
        try:  # the DHT and p2pd ignore Ctrl-C, we do not: a stop signal during the start raises here (starting.py)
            self.dht = start_dht(
                initial_peers=self.initial_peers or None, host_maddrs=self.host_maddrs,
                announce_maddrs=self.announce_maddrs or None,
                identity_path=identity.path, check_if_identity_free=not identity.fresh,
                record_validators=[identity.validator], startup_timeout=self.startup_timeout)
        except Exception as e:  # hivemind's P2PDaemonError etc. carry long texts
            raise SwarmError(start_failure(e, self.initial_peers, "could not start the bootstrap node")) from None
        finally:
            identity.close()
        self.peer_id = self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def shutdown(self) -> None:
        if self.dht is not None and self.dht.is_alive():
            self.dht.shutdown()
        reap_children(timeout=5.0)
