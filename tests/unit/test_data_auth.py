"""The data plane's authentication (p2p_diloco/swarm/data_auth.py): who signed an advertisement, per-pair keys,
and sealed frames that refuse any altered byte."""

import asyncio
import os
import socket

import pytest
import torch

from p2p_diloco.swarm.data_auth import (CHUNK, TAG, DataAuthError, DataKey, DataPeer, advertise, recv_sealed,
                                        sealed_size, send_sealed, verify_advertisement)
from p2p_diloco.swarm.identity import Identity

pytestmark = pytest.mark.unit
PREFIX = "run_abc"


@pytest.fixture(scope="module")
def identities():
    ids = [Identity(), Identity()]
    yield ids
    for identity in ids:
        identity.close()


def _entry(identity, address="10.0.0.1:4000", encrypt=False, prefix=PREFIX):
    key = DataKey()
    return key, advertise(identity.sign, identity.public_key, prefix,
                          DataPeer(identity.peer_id, address, key.public, encrypt))


def test_an_advertisement_verifies_for_the_peer_that_signed_it(identities):
    key, entry = _entry(identities[0], encrypt=True)
    peer = verify_advertisement(PREFIX, identities[0].peer_id, entry)
    assert peer == DataPeer(identities[0].peer_id, "10.0.0.1:4000", key.public, True)


@pytest.mark.parametrize("change, reason", [
    (lambda e, other: e.update(addr="10.6.6.6:4000"), "not signed by"),  # a leader rewrote the address
    (lambda e, other: e.update(dh=DataKey().public), "not signed by"),  # ... or put its own key in
    (lambda e, other: e.update(enc=True), "not signed by"),
    (lambda e, other: e.update(other), "not signed by"),  # another peer's whole (valid) entry in its place
    (lambda e, other: e.update(sig=b"\0" * 256), "not signed by"),
    (lambda e, other: e.update(addr="example.org:80"), "malformed"),
    (lambda e, other: e.update(addr="10.0.0.1:0"), "malformed"),
    (lambda e, other: e.update(addr="1.2.3.\u00b2:80"), "malformed"),  # a superscript digit
    (lambda e, other: e.update(addr="\u0661\u0662\u0667.0.0.1:80"), "malformed"),  # Arabic-Indic digits
    (lambda e, other: e.update(dh=b"short"), "malformed"),
    (lambda e, other: e.update(pub=b"k" * 5000), "malformed"),
    (lambda e, other: e.pop("sig"), "malformed"),
])
def test_an_advertisement_altered_in_any_field_is_refused(identities, change, reason):
    _, entry = _entry(identities[0])
    _, other = _entry(identities[1])
    change(entry, other)
    with pytest.raises(DataAuthError, match=reason):
        verify_advertisement(PREFIX, identities[0].peer_id, entry)


def test_an_advertisement_holds_only_for_its_own_run_and_shard(identities):
    _, entry = _entry(identities[0], prefix="run_abc_s1")
    with pytest.raises(DataAuthError):
        verify_advertisement("run_abc_s2", identities[0].peer_id, entry)
    with pytest.raises(DataAuthError, match="malformed"):
        verify_advertisement(PREFIX, identities[0].peer_id, "10.0.0.1:4000")  # the old, unsigned form


def test_pair_keys_agree_on_both_ends_and_differ_per_direction_and_group():
    a, b, c = DataKey(), DataKey(), DataKey()
    group = os.urandom(20)
    assert a.pair_key(b.public, group, "A", "B") == b.pair_key(a.public, group, "A", "B")
    assert a.pair_key(b.public, group, "A", "B") != a.pair_key(b.public, group, "B", "A")
    assert a.pair_key(b.public, group, "A", "B") != a.pair_key(b.public, os.urandom(20), "A", "B")
    assert c.pair_key(b.public, group, "A", "B") != a.pair_key(b.public, group, "A", "B")  # C claiming to be A
    with pytest.raises(DataAuthError):
        a.pair_key(b"\0" * 32, group, "A", "B")  # a low-order point gives no shared secret
    with pytest.raises(DataAuthError):
        a.check(b"\0" * 32)  # (what a member checks of every entry before the all-reduce)
    a.check(b.public)


async def _transfer(payload: bytes, key: bytes, encrypt: bool, flip: int | None = None, other_key=None):
    """Send ``payload`` sealed over a socket pair (byte ``flip`` of the wire flipped on the way) and open it."""
    left, right = socket.socketpair()
    left.setblocking(False)
    right.setblocking(False)
    out = bytearray(len(payload))
    wire = bytearray()

    async def send():
        async def capture(sock, view, timeout):
            wire.extend(view)
        await send_sealed(None, memoryview(payload), key, encrypt, 1.0, send=capture)
        if flip is not None:
            wire[flip] ^= 1
        await asyncio.get_running_loop().sock_sendall(left, wire)

    try:
        await asyncio.gather(send(), recv_sealed(right, memoryview(out), other_key or key, encrypt, 2.0))
    finally:
        left.close()
        right.close()
    return bytes(out), len(wire)


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_sealed_payload_arrives_whole_and_any_altered_byte_is_refused(encrypt):
    payload = torch.randn(CHUNK // 4 + 1000).numpy().tobytes()  # two chunks when encrypted
    key = os.urandom(32)
    got, size = asyncio.run(_transfer(payload, key, encrypt))
    assert got == payload and size == sealed_size(len(payload), encrypt)
    assert size == len(payload) + TAG * (2 if encrypt else 1)
    for flip in (0, len(payload) // 2, size - 1):
        with pytest.raises(DataAuthError):
            asyncio.run(_transfer(payload, key, encrypt, flip=flip))
    with pytest.raises(DataAuthError):  # sealed under another key: someone else's bytes
        asyncio.run(_transfer(payload, key, encrypt, other_key=os.urandom(32)))


def test_encrypted_bytes_do_not_show_the_payload():
    payload = b"pseudo-gradient " * 1000
    wire = bytearray()

    async def capture(sock, view, timeout):
        wire.extend(view)

    asyncio.run(send_sealed(None, memoryview(payload), os.urandom(32), True, 1.0, send=capture))
    assert b"pseudo-gradient" not in wire
    wire.clear()
    asyncio.run(send_sealed(None, memoryview(payload), os.urandom(32), False, 1.0, send=capture))
    assert wire.startswith(payload)  # authenticated only: the bytes are in the clear
