"""The peer's driver: its parts, and the life that runs them (:mod:`.peer`). No hivemind here."""

from .peer import Peer, data_seed_for

__all__ = ["Peer", "data_seed_for"]
