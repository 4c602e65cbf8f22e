"""A peer's identity and its signed DHT records.

One RSA key is both the peer's libp2p identity (its peer id is the multihash of that key, as libp2p specifies for
RSA keys) and the key that signs everything the peer publishes in the DHT. hivemind's ``RSASignatureValidator``
(the mechanism of its ``ProgressTracker``) makes a record whose subkey carries ``[owner:<public key>]`` storable
only with a valid signature by that key, on every DHT node that holds it. On top of that, a reader accepts a record
only if the subkey's owner key hashes to the peer id the subkey names. So:

- nobody can overwrite or forge another peer's record (the DHT refuses a bad signature);
- nobody can publish a record in another peer's name under their own key (the reader refuses the mismatch).

The key is generated per run unless an identity file is given; hivemind's ``P2P.generate_identity`` format
(a libp2p ``PrivateKey`` protobuf holding an RSA key) is what we read and write.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.errors import SwarmError

_OWNER = b"[owner:"


def load_identity(path: str | Path) -> RSAPrivateKey:
    """Read an RSA identity file (hivemind's format); a clear :class:`SwarmError` for anything else."""
    try:
        proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"key type {crypto_pb2.KeyType.Name(proto.key_type)}, not RSA")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = serialization.load_der_private_key(proto.data, password=None)
        return key
    except OSError as e:
        raise SwarmError(f"cannot read identity file {path}: {e.strerror or e}") from None
    except Exception as e:  # protobuf DecodeError, ValueError from cryptography, ...
        raise SwarmError(f"identity file {path} is not an RSA libp2p identity: {e}") from None


def write_identity(key: RSAPrivateKey, path: str | Path) -> None:
    """Write ``key`` as an identity file readable only by its owner (created atomically, never overwritten)."""
    proto = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(proto.SerializeToString())


class Identity:
    """A peer's RSA key, the identity file p2pd is started with, and the DHT validator that signs with the key.

    Args:
        path: an identity file to use (created with a new key if it does not exist), or None for a fresh key
            in a private temporary file that :meth:`close` removes.
    """

    def __init__(self, path: str | Path | None = None):
        self._tmpdir = None
        self.fresh = path is None or not Path(path).exists()  # a new key cannot be in use anywhere else
        if path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="p2p-diloco-id-")
            path = Path(self._tmpdir) / "identity.key"
        if self.fresh:
            self.key = RSAPrivateKey()
            try:
                write_identity(self.key, path)
            except OSError as e:
                raise SwarmError(f"cannot create identity file {path}: {e.strerror or e}") from None
        else:
            self.key = load_identity(path)
        self.path = str(path)
        self.validator = RSASignatureValidator(self.key)
        self.peer_id = peer_id_of(self.key.get_public_key().to_bytes())

    @property
    def public_key(self) -> bytes:
        """Our public key, in hivemind's encoding (:func:`peer_id_of` hashes it to our peer id)."""
        return self.key.get_public_key().to_bytes()

    def sign(self, data: bytes) -> bytes:
        """Our signature over ``data`` (a round certificate's statement)."""
        return self.key.sign(data)

    def subkey(self) -> bytes:
        """Our subkey in a shared DHT key: our peer id, then the owner marker that makes the record signed."""
        return self.peer_id.encode() + self.validator.local_public_key

    def close(self) -> None:
        """Remove a temporary identity file (p2pd read it at start-up and needs it no more)."""
        if self._tmpdir is not None:
            for name in os.listdir(self._tmpdir):
                os.unlink(os.path.join(self._tmpdir, name))
            os.rmdir(self._tmpdir)
            self._tmpdir = None


@functools.lru_cache(maxsize=4096)
def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in hivemind's OpenSSH encoding."""
    der = RSAPublicKey.from_bytes(public_key)._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))).to_base58()


class RSAKeyBook:
    """Checks a round certificate's signatures (:class:`~p2p_diloco.protocol.certificate.KeyBook`): the key must
    hash to the peer id it signs for, and the signature must check out under it."""

    def verify(self, peer_id: str, public_key: bytes, data: bytes, signature: bytes) -> bool:
        try:
            return peer_id_of(public_key) == peer_id and RSAPublicKey.from_bytes(public_key).verify(data, signature)
        except Exception:  # a malformed key or signature from a peer is just not a valid signature
            return False


def owner_of(subkey) -> str | None:
    """The peer id named by a subkey, if its owner key hashes to that peer id; else None (forged or unsigned).

    The DHT has already checked that the record is signed by the owner key (``RSASignatureValidator``)."""
    if not isinstance(subkey, bytes):
        return None
    claimed, marker, rest = subkey.partition(_OWNER)
    if not marker or not rest.endswith(b"]"):
        return None
    try:
        return claimed.decode() if peer_id_of(rest[:-1]) == claimed.decode() else None
    except Exception:  # not a key, not UTF-8: a record we cannot attribute is ignored
        return None


def records_by_owner(found) -> dict[str, object]:
    """``{peer_id: ValueWithExpiration}`` from a dictionary DHT value: only the subkeys :func:`owner_of` accepts."""
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for sub, item in found.value.items():
        owner = owner_of(sub)
        if owner is not None:
            out[owner] = item
    return out


class OwnedRecordsValidator(RecordValidatorBase):
    """DHT validator: under the given keys, only records whose subkey :func:`owner_of` accepts are stored or read.

    Together with ``RSASignatureValidator`` (the signature) this makes every DHT node of ours refuse a record in
    another peer's name, not only the reader. It also keeps other subkey types out: hivemind orders the subkeys
    of one key in a heap, and a ``str`` subkey next to our ``bytes`` ones with an equal expiration time raised
    ``TypeError`` inside hivemind's DHT search (measured once with three nodes: both honest readers' next ``get`` timed
    out after 15 s; with this validator they answered in 0.02 s). An attacker could stall the swarm's view so.
    """

    def __init__(self, keys):
        self._key_ids = {DHTID.generate(source=key).to_bytes() for key in keys}

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._key_ids:
            return True
        try:
            return owner_of(MSGPackSerializer.loads(record.subkey)) is not None
        except Exception:
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, OwnedRecordsValidator):
            return False
        self._key_ids |= other._key_ids
        return True
