"""Peer identity and record ownership (p2p_diloco/swarm/identity.py), without a network."""

import os
import stat

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from p2p_diloco.errors import SwarmError
from p2p_diloco.swarm.identity import Identity, load_identity, owner_of

pytestmark = pytest.mark.unit


def test_peer_id_is_libp2ps_id_of_the_key_and_the_file_is_reused(tmp_path):
    path = tmp_path / "id.key"
    first = Identity(path)
    assert first.fresh and stat.S_IMODE(os.stat(path).st_mode) == 0o400
    # libp2p's own derivation (hivemind's PeerID.from_identity reads the same file p2pd is started with)
    assert first.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
    again = Identity(path)
    assert not again.fresh and again.peer_id == first.peer_id
    assert again.subkey() == first.subkey()


def test_temporary_identity_is_removed_on_close():
    ident = Identity()
    assert os.path.exists(ident.path)
    ident.close()
    assert not os.path.exists(ident.path)


def test_owner_is_accepted_only_when_the_key_hashes_to_the_named_peer():
    honest, other = Identity(), Identity()
    try:
        assert owner_of(honest.subkey()) == honest.peer_id
        # a correctly signed record in someone else's name: the key is the attacker's, the peer id is not
        assert owner_of(honest.peer_id.encode() + other.validator.local_public_key) is None
        assert owner_of(honest.peer_id) is None  # unsigned (a str subkey, as before records were signed)
        assert owner_of(honest.peer_id.encode()) is None
        assert owner_of(b"x[owner:not a key]") is None
        assert owner_of(None) is None
    finally:
        honest.close()
        other.close()


def test_bad_identity_files_give_one_clear_error(tmp_path):
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"\x00not a protobuf at all")
    with pytest.raises(SwarmError, match="not an RSA libp2p identity"):
        load_identity(junk)
    with pytest.raises(SwarmError, match="cannot create identity file"):
        Identity(tmp_path / "missing-dir" / "id.key")
    ed = tmp_path / "ed25519.key"
    ed.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"\x01" * 64).SerializeToString())
    with pytest.raises(SwarmError, match="key type Ed25519, not RSA"):
        load_identity(ed)
