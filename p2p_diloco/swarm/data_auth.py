"""Who is on the other end of a data-plane connection: signed advertisements, per-pair keys, sealed frames.

The direct-TCP data plane (fastpath.py) moves a group's pseudo-gradients outside libp2p, so it must bind every
byte to a member's libp2p identity itself (issue 18: an insider claimed another member's index in a frame header
and fed a reducer a second part; a leader could rewrite the members' data addresses, since followers took them
verbatim from the leader's relay):

* **Advertisement.** Each member publishes its data address and an X25519 public key (made per process) in its
  matchmaking data, with an RSA signature by its identity key, the key its peer id is the hash of
  (identity.py). The leader relays these entries but cannot change one: every member checks each entry against
  the peer id it stands for, and connects only to the address that member signed.
* **Per-pair keys.** Sender s and reducer r derive the same key from X25519(s, r), bound to the group id and to
  both peer ids (HKDF-SHA256), with no extra round trip. Only s and r know it.
* **Sealed frames.** A connection's header carries a fresh random nonce and a Poly1305 tag under a one-time key
  derived from the pair key and that nonce, so the reducer knows the sender before it reads a byte of payload;
  the sender's part and the reducer's answer each carry a tag (or, with ``swarm.encrypt_data``, are encrypted
  chunk by chunk with ChaCha20-Poly1305). The sender of a part is whoever authenticated, never an index believed
  on trust.

Replay: a recorded connection replayed in the same group carries the real sender's bytes (the reducer takes one
connection per sender); in another group the keys differ. An on-path attacker can still drop traffic (a failed
round), not alter it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.poly1305 import Poly1305

from .identity import RSAKeyBook
from .sockets import recv_into, send_all

SCHEME = b"p2p-diloco data plane v2"
NONCE = 16
TAG = 16
CHUNK = 2**20  # plaintext bytes per encrypted chunk (each has its own tag)
_MAX_FIELD = 2048  # bytes of an advertised key or signature (an RSA-2048 key in hivemind's encoding is ~400)


class DataAuthError(Exception):
    """A data-plane message did not authenticate: drop it, the honest member may still come."""


@dataclass(frozen=True)
class DataPeer:
    """One member of a group on the data plane, as its own signed advertisement says."""

    peer_id: str
    address: str  # "host:port" it listens on
    public: bytes  # its X25519 public key (32 bytes)
    encrypt: bool = False  # it asks for encrypted frames (then the whole group encrypts)


class DataKey:
    """Our X25519 key of the data plane: made per process, never stored (the advertisement's signature binds it
    to our identity)."""

    def __init__(self):
        self._secret = X25519PrivateKey.generate()
        self.public = self._secret.public_key().public_bytes_raw()

    def check(self, peer_public: bytes) -> None:
        """DataAuthError unless ``peer_public`` gives a shared secret with our key (not a low-order point)."""
        self._shared(peer_public)

    def _shared(self, peer_public: bytes) -> bytes:
        try:
            return self._secret.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError as e:  # a low-order point: no shared secret
            raise DataAuthError(f"bad data-plane key: {e}") from None

    def pair_key(self, peer_public: bytes, group_id: bytes, sender: str, reducer: str) -> bytes:
        """The key of the (sender -> reducer) connection of one group: the same on both ends, known to no one
        else. The two directions between two members have different keys (the ids' order differs)."""
        shared = self._shared(peer_public)
        info = b"|".join([SCHEME, sender.encode(), reducer.encode()])
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=group_id, info=info).derive(shared)


def statement(prefix: str, peer: DataPeer) -> bytes:
    """The bytes an advertisement's signature covers: the averager's key prefix (run and shard), the peer id, its
    address, its data-plane key and whether it asks for encryption."""
    fields = [prefix, peer.peer_id, peer.address, peer.public.hex(), bool(peer.encrypt)]
    return SCHEME + b"\n" + json.dumps(fields).encode()


def advertise(sign: Callable[[bytes], bytes], rsa_public: bytes, prefix: str, peer: DataPeer) -> dict:
    """Our entry in the matchmaking data (``gather["data"]``): signed by our identity key (``sign``)."""
    return {"addr": peer.address, "dh": peer.public, "enc": bool(peer.encrypt), "pub": rsa_public,
            "sig": sign(statement(prefix, peer))}


def verify_advertisement(prefix: str, peer_id: str, entry) -> DataPeer:
    """The :class:`DataPeer` that ``entry`` advertises for ``peer_id``; DataAuthError unless that peer signed it
    (a leader that rewrote an address, or put its own entry in a member's place, is caught here)."""
    if not isinstance(entry, dict):
        raise DataAuthError(f"malformed data-plane entry for {peer_id}")
    address, public, encrypt = entry.get("addr"), entry.get("dh"), entry.get("enc")
    rsa_public, signature = entry.get("pub"), entry.get("sig")
    if not (isinstance(address, str) and len(address) <= 64 and _is_address(address)
            and isinstance(public, bytes) and len(public) == 32 and isinstance(encrypt, bool)
            and isinstance(rsa_public, bytes) and len(rsa_public) <= _MAX_FIELD
            and isinstance(signature, bytes) and len(signature) <= _MAX_FIELD):
        raise DataAuthError(f"malformed data-plane entry for {peer_id}")
    peer = DataPeer(peer_id, address, public, encrypt)
    if not RSAKeyBook().verify(peer_id, rsa_public, statement(prefix, peer), signature):
        raise DataAuthError(f"the data-plane entry for {peer_id} is not signed by {peer_id}")
    return peer


def _is_address(address: str) -> bool:
    """``address`` is ``"<IPv4 address>:<port>"`` in ASCII (what ``connect`` can dial, nothing else)."""
    host, _, port = address.rpartition(":")
    if not (address.isascii() and port.isdecimal() and 0 < int(port) < 65536):
        return False
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def subkey(pair_key: bytes, label: bytes, nonce: bytes) -> bytes:
    """A one-time key for one message of one connection (``label``: which message; ``nonce``: fresh per
    connection), so that no Poly1305 or ChaCha20 key ever covers two different messages."""
    return hmac.new(pair_key, label + nonce, "sha256").digest()


def fresh_nonce() -> bytes:
    return os.urandom(NONCE)


def tag(key: bytes, *pieces) -> bytes:
    mac = Poly1305(key)
    for piece in pieces:
        mac.update(piece)
    return mac.finalize()


def check(key: bytes, expected: bytes, *pieces) -> None:
    """DataAuthError unless ``expected`` is the tag of ``pieces`` under ``key``."""
    if not hmac.compare_digest(tag(key, *pieces), bytes(expected)):
        raise DataAuthError("bad tag")


def sealed_size(n: int, encrypt: bool) -> int:
    """Bytes on the wire for a payload of ``n`` bytes: the payload and one tag, or one tag per encrypted chunk."""
    return n + TAG * (max(1, -(-n // CHUNK)) if encrypt else 1)


def chunk_nonce(i: int) -> bytes:
    return i.to_bytes(12, "big")


class Sealer:
    """Seals (sender side) or opens (receiving side) one payload with its one-time key: Poly1305 over the clear
    bytes, or ChaCha20-Poly1305 chunk by chunk (chunk i under nonce i: chunks cannot be reordered or dropped)."""

    def __init__(self, key: bytes, encrypt: bool):
        self.key, self.encrypt = key, encrypt
        self.aead = ChaCha20Poly1305(key) if encrypt else None

    def seal_chunk(self, i: int, plain: memoryview, out: bytearray) -> memoryview:
        sealed = memoryview(out)[:len(plain) + TAG]
        self.aead.encrypt_into(chunk_nonce(i), plain, None, sealed)
        return sealed

    def open_chunk(self, i: int, sealed: memoryview, out: memoryview) -> None:
        try:
            self.aead.decrypt_into(chunk_nonce(i), sealed, None, out)
        except InvalidTag:
            raise DataAuthError(f"bad tag on encrypted chunk {i}") from None


async def send_sealed(sock, payload: memoryview, key: bytes, encrypt: bool, timeout: float, send=send_all) -> None:
    """Send ``payload`` sealed under the one-time ``key`` (``send``: how bytes go out, a test's paced sender)."""
    if not encrypt:  # tagged a chunk at a time, while the chunk is in the cache (not re-read from memory after)
        mac = Poly1305(key)
        for start in range(0, len(payload), CHUNK):
            mac.update(payload[start:start + CHUNK])
            await send(sock, payload[start:start + CHUNK], timeout)
        await send(sock, memoryview(mac.finalize()), timeout)
        return
    sealer, out = Sealer(key, True), bytearray(CHUNK + TAG)
    for i, start in enumerate(range(0, max(len(payload), 1), CHUNK)):
        await send(sock, sealer.seal_chunk(i, payload[start:start + CHUNK], out), timeout)


async def recv_sealed(sock, into: memoryview, key: bytes, encrypt: bool, timeout: float, touch=lambda: None) -> None:
    """Receive a payload of exactly ``len(into)`` bytes sealed under ``key`` into ``into``; DataAuthError if it
    was altered or came from anyone without the key (``into`` then holds garbage: the caller discards it)."""
    if not encrypt:  # checked a chunk at a time as it arrives, while it is in the cache
        mac = Poly1305(key)
        for start in range(0, len(into), CHUNK):
            await recv_into(sock, into[start:start + CHUNK], timeout, touch)
            mac.update(into[start:start + CHUNK])
        expected = bytearray(TAG)
        await recv_into(sock, memoryview(expected), timeout, touch)
        if not hmac.compare_digest(mac.finalize(), bytes(expected)):
            raise DataAuthError("bad tag")
        return
    sealer, scratch = Sealer(key, True), memoryview(bytearray(min(CHUNK, len(into)) + TAG))
    for i, start in enumerate(range(0, max(len(into), 1), CHUNK)):
        m = min(CHUNK, len(into) - start)
        await recv_into(sock, scratch[:m + TAG], timeout, touch)
        sealer.open_chunk(i, scratch[:m + TAG], into[start:start + m])
