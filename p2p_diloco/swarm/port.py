"""What the peer needs of the swarm: the port its driver talks to, with no hivemind behind it here.

:class:`~p2p_diloco.swarm.swarm.Swarm` implements it over hivemind (a DHT and the exact averagers);
:class:`~p2p_diloco.testing.fake_swarm.FakeSwarm` in memory, on a virtual clock, with faults a test injects. The
driver (:mod:`p2p_diloco.peer`) only ever sees this interface, so every protocol scenario can run against the fake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, ContextManager, Protocol, Sequence

import torch

from ..protocol.certificate import CHAIN_BYTES, MAX_BYTES, KeyBook, Signer
from ..protocol.records import PeerRecord

# A ``regroup`` attempt (AllReduceRequest.regroup) ends once its designated leader has answered REGROUP_REFUSALS
# join requests, LEADER_RETRY s apart at least, with "I look for another group": the RoundFailed's text then holds
# VIEW_MISMATCH (swarm/led_matchmaking.py; the fake swarm does the same).
LEADER_RETRY = 0.2
REGROUP_REFUSALS = 2
VIEW_MISMATCH = "our leader expects another group"
# ...and a designated leader's attempt ends once at least half of the followers it expects (and REGROUP_REFUSALS)
# asked it for another group: then its own view is the likelier stale one (FOLLOWERS_MISMATCH in the text).
FOLLOWERS_MISMATCH = "our followers expect another group"
SIZE_BITS = 16  # the group size, at the end of an attempt's group key (exact_averager.attempt_key_bits)


def followers_to_regroup(group_size: int | None) -> int:
    """How many distinct followers asking a designated leader for another group size end its ``regroup`` attempt:
    half of those it expects, and at least REGROUP_REFUSALS (one stale follower regroups by itself)."""
    return max(REGROUP_REFUSALS, (group_size or 2) // 2)


StateProvider = Callable[..., tuple[dict, list[torch.Tensor]]]  # () or (shard) -> (metadata, tensors) to donate


# Owned, signed blobs of every peer (put_blob / get_blobs: the round certificate exchange), at most this many bytes
# each (every DHT node refuses a larger one: swarm/schema.py). Measured with protocol/commit.py's encodings: a "sig"
# blob is ~960 bytes with 2048-bit RSA identities, ~1760 with 4096-bit ones; a 64-member "cert" ~62 KB (2048-bit)
# or ~113 KB (4096-bit), hence certificate.MAX_BYTES. Mind the total of one key: a DHT reply carries every owner's
# value of the key in one p2pd message, and a reply over 4 MiB is lost whole (measured: 3.9 MB read in 0.1 s, 4.5 MB
# not at all): 64 peers that each keep a 64-member certificate under "cert" are already at that limit.
# "chain": the certificates before a peer's head, as many as fit (certificate.encode_chain), read only by a peer that
# cannot tie the swarm's head certificates to its own (peer/chain.py).
BLOB_MAX_BYTES = {"sig": 4 * 1024, "cert": MAX_BYTES, "chain": CHAIN_BYTES}
BLOB_NAMES = tuple(BLOB_MAX_BYTES)
# A blob's lifetime in units of swarm.peer_ttl (keep_blob refreshes it every half lifetime). The chain blob changes
# once a round and is read only by a peer that fell behind: stored 10 x less often than a certificate, it adds
# little to the DHT traffic and to the writes through hivemind's command pipe (interleaved writes of several
# processes can corrupt that pipe under load: docs/protocol.md, known limits).
BLOB_LIFETIMES = {"sig": 1, "cert": 1, "chain": 10}


def check_blob(name: str, value: bytes, ttl: float | None, peer_ttl: float) -> float:
    """The lifetime of a blob to put (``ttl``, or by default the longest its name allows: :data:`BLOB_LIFETIMES`), if
    ``name``, ``value`` and ``ttl`` are valid; else ``ValueError`` (the DHT would refuse it silently: a bug of the
    caller must fail loudly)."""
    if name not in BLOB_MAX_BYTES:
        raise ValueError(f"blob name must be one of {list(BLOB_NAMES)}, got {name!r}")
    if not isinstance(value, bytes):
        raise ValueError(f"a {name} blob must be bytes, got {type(value).__name__}")
    if len(value) > BLOB_MAX_BYTES[name]:
        raise ValueError(f"a {name} blob holds at most {BLOB_MAX_BYTES[name]} bytes, got {len(value)}")
    longest = peer_ttl * BLOB_LIFETIMES[name]
    ttl = ttl or longest
    if not 0 < ttl <= longest:
        raise ValueError(f"a {name} blob's ttl must be in (0, {longest}] (swarm.peer_ttl={peer_ttl}), got {ttl}")
    return ttl


# probe(): ids per call (all dialled at once: a socket each, at most swarm/probe.py's MAX_ADDRS per id)
PROBE_MAX_IDS = 64


def check_probe(peer_ids: Collection[str], timeout: float) -> None:
    """``ValueError`` unless ``peer_ids`` (at most :data:`PROBE_MAX_IDS`) and ``timeout`` (> 0) are valid."""
    if isinstance(peer_ids, str):
        raise ValueError("probe takes a collection of peer ids, not one string")
    if len(peer_ids) > PROBE_MAX_IDS:
        raise ValueError(f"probe takes at most {PROBE_MAX_IDS} peer ids per call, got {len(peer_ids)}")
    if not timeout > 0:
        raise ValueError(f"probe timeout must be > 0, got {timeout}")


def _never() -> bool:
    return False


def _nothing() -> None:
    return None


@dataclass
class AllReduceRequest:
    """One all-reduce attempt of a round: average ``tensors`` in place with exactly ``group_size`` peers.

    Args:
        round: theta(round) is what every member's pseudo-gradient started from (peers of other rounds never match).
        tensors: this peer's pseudo-gradient; on success they hold the swarm's average (bit-identical on every
            member), on failure they are untouched. With ``outer.sharding = "sharded"``: one tensor per shard.
        weight: this peer's weight in the average (tokens trained in the round), > 0.
        group_size: members, us included.
        gather: small data every member receives from every other (round, digest, tokens). With shards, the
            first shard's averager gathers it all and the others ``round`` and ``peer`` (the peer's main id) only.
        should_stop: polled; True cancels the attempt (the others see our part go missing).
        on_running: called once, when the group is assembled and the tensors start to flow.
        matchmaking_time, allreduce_timeout: this attempt's deadlines (None: the ``[swarm]`` constants).
        matchmaking_timeout: stop looking for a group after this many seconds (the straggler deadline).
        commit: False leaves ``tensors`` untouched and the result in the swarm's buffers (:meth:`SwarmPort.averaged`):
            a retry of the round then sends the same pseudo-gradient again.
        members: the peer ids the round rules expect in the group (empty: not known); the swarm may use them to
            reach those peers before matchmaking (swarm.py: introductions).
        leader: the member (its peer id, maybe ours) that every member asks to lead matchmaking (None: any);
            :func:`p2p_diloco.protocol.consensus.matchmaking_leader`.
        regroup: with ``leader``, a follower ends the attempt (:class:`RoundFailed` with ``regroup``) as soon as
            the leader answers that it expects another group, instead of asking it until the deadline.
    """

    round: int
    tensors: Sequence[torch.Tensor]
    weight: float
    group_size: int
    gather: dict[str, Any]
    should_stop: Callable[[], bool] = _never
    on_running: Callable[[], None] = _nothing
    matchmaking_time: float | None = None
    allreduce_timeout: float | None = None
    matchmaking_timeout: float | None = None
    commit: bool = True
    members: Sequence[str] = ()
    leader: str | None = None
    regroup: bool = False


@dataclass
class AllReduceResult:
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    gathered: dict[str, Any]  # {peer id: the data it gathered}
    assembly_seconds: float = 0.0  # of ``seconds``: matchmaking, until the group was assembled
    excluded: dict[str, str] = field(default_factory=dict)  # {peer id: reason} our reducers left out
    # With shards: {shard j: {member process's peer id: the "peer" it gathered, or None}} for this process's shards
    # (sharded_ranks.py checks that every shard was averaged with the same peers); None without shards.
    shard_members: dict[int, dict[str, Any]] | None = None
    # Members that died mid-all-reduce, their slices re-reduced among the survivors (swarm/slice_repair.py): not in
    # ``gathered`` nor in ``group_size``; ``resent``: the bytes we sent again for the re-reduction.
    lost: tuple[str, ...] = ()
    resent: int = 0


class SwarmPort(Protocol):
    """One peer's connection to its run's swarm. Every call is bounded in time; failures of a round raise
    :class:`~p2p_diloco.errors.RoundFailed`, a DHT that does not answer raises ``TimeoutError``."""

    peer_id: str | None  # set by start()
    keys: KeyBook  # checks round certificates' signatures
    signer: Signer | None  # our identity, signs round certificates (set by start())

    def start(self) -> None:
        """Join the swarm (refusing a config that differs from the live peers'), publish our first record."""

    def shutdown(self) -> None:
        """Announce that we leave, and stop everything the swarm started."""

    def visible_maddrs(self) -> list[str]:
        """Where other peers can reach us."""

    def update(self, **fields: Any) -> None:
        """Change fields of our live record (:class:`PeerRecord` names); they go out with the next heartbeat."""

    def publish(self, ttl: float | None = None, **fields: Any) -> None:
        """Change fields of our live record and store it now."""

    def live_peers(self) -> dict[str, PeerRecord]:
        """Every other live peer of this run and config."""

    def probe(self, peer_ids: Collection[str], timeout: float) -> frozenset[str]:
        """The peers among ``peer_ids`` that *this* peer's own direct dial, made now, found with proof that nothing
        listens where they were reached: the connection was refused or reset (a dead process's host answers so at
        once). Never a timeout (a frozen, slow or far peer only times out), never another peer's word, never a peer
        we hold an open connection to, never one we never reached (nowhere to dial), never ourselves, and never a
        client-mode peer (it accepts no connections, so a refusal proves nothing; callers should leave those out
        too). A peer that restarted elsewhere with the same identity is reported until it connects to us again.

        All ids are dialled in parallel; the call returns within ``timeout`` plus a fraction of a second whatever
        happens (what was not proven by then is not reported) and never holds up the DHT. At most
        :data:`PROBE_MAX_IDS` ids and ``timeout`` > 0, else ``ValueError``. The real rule: swarm/probe.py."""

    def put_blob(self, name: str, value: bytes, ttl: float | None = None) -> None:
        """Store ``value`` in our name under the run's key ``name`` (``"sig"`` or ``"cert"``), signed, expiring
        ``ttl`` (at most, and by default, ``swarm.peer_ttl``) from now; at most ``schema.BLOB_MAX_BYTES[name]``
        bytes. ``ValueError`` for another name, a larger value or a longer ttl. A put replaces our previous value
        only if it expires later (hivemind keeps the latest expiration per owner)."""

    def keep_blob(self, name: str, value: bytes) -> None:
        """:meth:`put_blob` now, and again every half record lifetime until we leave (our head certificate)."""

    def get_blobs(self, name: str) -> dict[str, bytes]:
        """``{peer_id: value}`` of every peer's unexpired blob under ``name`` (ours included; only allowed peers in a
        private run). Like :meth:`live_peers`, a read may miss some peers' values."""

    def all_reduce(self, request: AllReduceRequest) -> AllReduceResult:
        """One all-or-nothing all-reduce attempt (:class:`AllReduceRequest`)."""

    def averaged(self) -> ContextManager[list[torch.Tensor]]:
        """The last successful all-reduce made with ``commit=False``, read in place (no copy): tensors in the layout
        of its request's, valid inside the ``with`` and until the next all-reduce; never write to them."""

    def set_donor_round(self, round_: int) -> None:
        """Peers downloading state prefer donors in higher rounds."""

    def download_state(self, peer_id: str, shard: int | None = None) -> tuple[dict, list[torch.Tensor]]:
        """``(metadata, tensors)`` of a live peer's global state (one shard of it, with ``shard``)."""


SwarmFactory = Callable[..., SwarmPort]  # (cfg, tensors_like, state_provider, shards=None, state_like=None)
