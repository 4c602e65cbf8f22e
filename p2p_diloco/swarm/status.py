"""``p2p-diloco status``: a light DHT client that reads the run's signed live records and nothing else.

It joins in client mode (no inbound connections, stores nothing for others) with the same validators as a peer,
so forged or unsigned records are dropped exactly as a training peer drops them (identity.py).
"""

from __future__ import annotations

from typing import Sequence

from hivemind.dht.crypto import RSASignatureValidator

from ..errors import SwarmError
from ..protocol.records import PeerRecord
from ..runtime.processes import descendants, reap_children
from .identity import OwnedRecordsValidator, records_by_owner
from .schema import RunRecordsValidator
from .starting import start_dht, start_failure

READ_TIMEOUT = 15.0
# After the first initial peer answers, hivemind waits up to this long (3 s by default) for the other initial peers and
# for a search of its own neighbourhood; a client that reads one key needs neither (its read searches anyway).
BOOTSTRAP_TIMEOUT = 0.5


class StatusClient:
    """Args: multiaddrs to join through, the run id to show, and how long p2pd may take to start."""

    def __init__(self, initial_peers: Sequence[str], run_id: str, startup_timeout: float = 30.0):
        self.key = f"{run_id}.live"
        before = descendants()
        try:  # forked with SIGINT ignored, waited for with our handlers: a Ctrl-C aborts the start at once
            self.dht = start_dht(
                initial_peers=list(initial_peers), client_mode=True, startup_timeout=startup_timeout,
                bootstrap_timeout=BOOTSTRAP_TIMEOUT,
                record_validators=[RSASignatureValidator(), OwnedRecordsValidator([self.key]),
                                   RunRecordsValidator(run_id)])
        except Exception as e:
            raise SwarmError(start_failure(e, initial_peers, "could not join the swarm")) from None
        self._owned = descendants() - before  # the DHT process and its p2pd: what shutdown() stops

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
        reap_children(timeout=5.0, only=self._owned)
