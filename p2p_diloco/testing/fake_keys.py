"""Simulated identities for round certificates: fast, and unforgeable inside a simulation.

A real peer signs with its RSA libp2p key (:class:`~p2p_diloco.swarm.identity.RSAKeyBook` checks it); 2048-bit RSA
would make a simulation of many peers slow, so simulated peers sign with an HMAC under a secret only the
:class:`FakeKeys` of their network knows. A test that plays an attacker gets its own identities from the same book
and cannot sign for anyone else, as with real keys.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


class FakeSigner:
    """One simulated identity (a :class:`~p2p_diloco.protocol.certificate.Signer`)."""

    def __init__(self, peer_id: str, secret: bytes):
        self.peer_id, self._secret = peer_id, secret
        self.public_key = b"fake-key:" + peer_id.encode()

    def sign(self, data: bytes) -> bytes:
        return hmac.new(self._secret, data, hashlib.sha256).digest()


class FakeKeys:
    """The key book of a simulated network (a :class:`~p2p_diloco.protocol.certificate.KeyBook`)."""

    def __init__(self):
        self._secrets: dict[str, bytes] = {}

    def signer(self, peer_id: str) -> FakeSigner:
        """``peer_id``'s identity (created on first use)."""
        secret = self._secrets.setdefault(peer_id, secrets.token_bytes(32))
        return FakeSigner(peer_id, secret)

    def verify(self, peer_id: str, public_key: bytes, data: bytes, signature: bytes) -> bool:
        secret = self._secrets.get(peer_id)
        if secret is None or public_key != b"fake-key:" + peer_id.encode():
            return False
        return hmac.compare_digest(hmac.new(secret, data, hashlib.sha256).digest(), signature)
