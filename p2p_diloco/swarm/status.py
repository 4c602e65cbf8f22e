"""``p2p-diloco status``: a light DHT client that reads the run's signed live records and nothing else.

It joins in client mode (no inbound connections, stores nothing for others) with the same validators as a peer,
so forged or unsigned records are dropped exactly as a training peer drops them (identity.py).
"""

from __future__ import annotations

import signal
from typing import Sequence

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from ..errors import SwarmError
from ..protocol.records import PeerRecord
from ..runtime.processes import reap_children
from .identity import OwnedRecordsValidator, records_by_owner
from .schema import RunRecordsValidator

READ_TIMEOUT = 15.0


class StatusClient:
    """Args: multiaddrs to join through, the run id to show, and how long p2pd may take to start."""

    def __init__(self, initial_peers: Sequence[str], run_id: str, startup_timeout: float = 30.0):
        self.key = f"{run_id}.live"
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches only us; we stop the DHT
        try:
            self.dht = hivemind.DHT(
                initial_peers=list(initial_peers), start=True, client_mode=True, startup_timeout=startup_timeout,
                record_validators=[RSASignatureValidator(), OwnedRecordsValidator([self.key]),
                                   RunRecordsValidator(run_id)], await_ready=True)
        except Exception as e:
            reap_children(timeout=5.0)
            raise SwarmError(f"could not join the swarm: {str(e).strip().splitlines()[0]}") from None
        finally:
            signal.signal(signal.SIGINT, previous)

    def read_live_records(self) -> dict[str, PeerRecord]:
        """``{peer_id: record}`` of every live, validly signed record of the run."""
        try:
            found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=READ_TIMEOUT)
        except Exception as e:
            raise SwarmError(f"reading the swarm's records failed: {type(e).__name__}") from None
        return {pid: PeerRecord.from_wire(item.value) for pid, item in records_by_owner(found).items()
                if isinstance(item.value, dict)}

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()
        reap_children(timeout=5.0)
