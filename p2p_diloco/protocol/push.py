"""State pushes from client-mode peers: who may push what to whom, and how much a receiver takes.

A ``--client-mode`` peer accepts no inbound connection, so nobody can download its state; it can only dial out. When
the peers holding the swarm's newest state are all clients (the one reachable peer restarted behind them), the
reachable peer asks for a push instead: its live record names the round it needs (``wants``) and the client it
chose as a donor (``ask``). That client sees the wish in its view and, if it holds that round (or a later one) with
a certified state, dials the asker and streams ``(metadata, tensors)`` to it, exactly what a download would return;
the asker then checks it the same way (digest, shapes, certificate trust: ``GlobalState.fetch``).

The receiver takes a push only from the peer it asked, for the round it asked, into one pending slot that expires
after ``swarm.state_timeout``, and only up to :func:`push_limit` bytes. No network and no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .records import PeerRecord, View

# Room for the pushed metadata (round, digest, fingerprint, peer id and a certificate of at most
# certificate.MAX_BYTES = 128 KiB) and for the serialisation headers of each tensor.
METADATA_BYTES = 256 * 1024
TENSOR_OVERHEAD_BYTES = 4096


def should_push(asker: PeerRecord, me: str, round_: int, certified: bool) -> bool:
    """True if we (``me``, a client-mode peer holding theta(``round_``)) should push our state to the peer whose
    record is ``asker``: it asks us by name for a round we hold (or passed), it accepts connections, and our state
    is certified (``certified``: we hold a certificate for it, or it is theta(0))."""
    return (bool(certified) and asker.ask == me and asker.wants is not None and 0 <= asker.wants <= round_
            and not asker.client)


def push_targets(view: View, me: str, round_: int, certified: bool) -> list[str]:
    """The peers of ``view`` that asked us for a push we can serve (:func:`should_push`), sorted."""
    return sorted(pid for pid, record in view.items() if should_push(record, me, round_, certified))


def push_limit(state_bytes: int, tensors: int) -> int:
    """The most bytes a receiver takes in one push: the size of its own state (``state_bytes`` in ``tensors``
    tensors: a donated state has exactly the same shapes), plus the metadata and the serialisation overhead."""
    return int(state_bytes) + METADATA_BYTES + TENSOR_OVERHEAD_BYTES * int(tensors)


@dataclass
class PushSlot:
    """The one push a receiver is waiting for: from ``peer``, for round ``round``, at most ``max_bytes``, until
    ``deadline`` (a monotonic time). A new wish replaces the slot; an expired one takes nothing."""

    peer: str
    round: int
    max_bytes: int
    deadline: float
    busy: bool = False  # a push is being received into it

    def refusal(self, sender: str, now: float) -> str | None:
        """Why a push from ``sender`` arriving at ``now`` is refused, or None if it may start."""
        if sender != self.peer:
            return f"we asked {self.peer} for a state, not {sender}"
        if now >= self.deadline:
            return "our wish expired"
        if self.busy:
            return "a push from that peer is already being received"
        return None


def slot_refusal(slot: PushSlot | None, sender: str, now: float) -> str | None:
    """Why a push from ``sender`` is refused given the pending ``slot`` (None: we asked nobody)."""
    if slot is None:
        return "we asked nobody for a state"
    return slot.refusal(sender, now)


def over_limit(received: int, max_bytes: int) -> str | None:
    """Why a state (pushed or downloaded) of which ``received`` bytes came so far must be cut off, or None."""
    if received > max_bytes:
        return f"the state exceeds {max_bytes} bytes (the size of our own state and its metadata)"
    return None
