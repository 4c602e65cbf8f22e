"""Reading a run's published configs before this peer is built: a short-lived light DHT client.

A joiner must know the run's config before it builds its model (the model comes from the run's config), and its
own DHT node is started only once the peer is built (:class:`~p2p_diloco.swarm.swarm.Swarm`), with validators
that depend on ``swarm.peer_ttl``, itself a setting of the run. So the config is read through a light client, as
``p2p-diloco status`` reads the live records: client mode (no inbound connections, stores nothing for others),
the same signature, ownership and schema validators as a peer. Measured on 2 cores with hivemind already
imported (it is imported for the peer anyway): start + read + shutdown 0.2-0.4 s. Starting the peer's own DHT
earlier would cost only the read (0.01 s) but would fix its validators before the run's peer_ttl is known.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from hivemind.dht.crypto import RSASignatureValidator

from ..errors import SwarmError
from ..runtime.processes import descendants, reap_children
from .identity import OwnedRecordsValidator, records_by_owner
from .schema import RecordLimitsValidator, RunRecordsValidator
from .starting import start_dht, start_failure
from .status import BOOTSTRAP_TIMEOUT  # one read needs no wait for the other initial peers

log = logging.getLogger(__name__)
READ_TIMEOUT = 15.0
# The reader does not know the run's peer_ttl yet: it applies the size limits of every record, not the lifetime
# ones (a peer_ttl this long never refuses a lifetime; a reader stores nothing, so a long-lived record costs it
# nothing). The DHT nodes that store the records apply both.
_ANY_TTL = 1e9


def read_run_records(initial_peers: Sequence[str], run_id: str, startup_timeout: float,
                     initial_peers_wait: float = 0.0) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The run's live and config records, read once through a light client that is stopped before returning.

    Args:
        initial_peers: multiaddrs of live peers or a bootstrap node.
        run_id: the run whose records are read.
        startup_timeout: how long p2pd may take to start and reach the initial peers.
        initial_peers_wait: how long to keep trying when no initial peer answers (0: fail at once).

    Returns:
        ``(live, configs)``: ``{peer_id: record}`` of every validly signed dictionary record under
        ``<run_id>.live`` and ``<run_id>.config`` (trust is decided by :mod:`p2p_diloco.config.adoption`).

    Raises:
        SwarmError: the client could not start or reach the initial peers, or the read failed (one line).
    """
    keys = [f"{run_id}.live", f"{run_id}.config"]
    before = descendants()
    try:
        dht = start_dht(initial_peers_wait, initial_peers=list(initial_peers), client_mode=True,
                        startup_timeout=startup_timeout,
                        bootstrap_timeout=BOOTSTRAP_TIMEOUT,
                        record_validators=[RSASignatureValidator(), OwnedRecordsValidator(keys),
                                           RunRecordsValidator(run_id), RecordLimitsValidator(run_id, _ANY_TTL)])
    except Exception as e:  # hivemind raises P2PDaemonError / RuntimeError with long texts
        raise SwarmError(start_failure(e, initial_peers, "could not start or join the swarm",
                                       initial_peers_wait)) from None
    owned = descendants() - before  # the DHT process and its p2pd: what we stop
    try:
        found = [dht.get(key, latest=True, return_future=True) for key in keys]
        live, configs = ({owner: item.value for owner, item in records_by_owner(f.result(timeout=READ_TIMEOUT)).items()
                          if isinstance(item.value, dict)} for f in found)
    except Exception as e:
        raise SwarmError(f"reading the run's config from the swarm failed: {type(e).__name__}") from None
    finally:
        if dht.is_alive():
            dht.shutdown()
        reap_children(timeout=5.0, only=owned)
    log.debug("read %d live and %d config records of run %s", len(live), len(configs), run_id)
    return live, configs
