"""The commit step's driver (peer/certifier.py) against a scripted swarm: what it reads, when it commits."""

from types import SimpleNamespace

import pytest

from p2p_diloco.peer.certifier import FAST_POLLS, Certifier
from p2p_diloco.protocol.certificate import Certificate, sign
from p2p_diloco.protocol.commit import encode_signature, statement_for
from p2p_diloco.testing.fake_keys import FakeKeys

pytestmark = pytest.mark.unit


class ScriptedSwarm:
    """``get_blobs`` answers from ``script(read number, name)``; the clock moves only when the driver sleeps."""

    def __init__(self, keys, script):
        self.keys, self.script, self.reads = keys, script, 0
        self.signer = keys.signer("a")
        self.now = 0.0

    def put_blob(self, name, value, ttl=None):
        pass

    def get_blobs(self, name):
        if name == "sig":
            self.reads += 1
        return self.script(self.reads, name)


def _certifier(swarm):
    ctx = SimpleNamespace(swarm=swarm, cfg=SimpleNamespace(swarm=SimpleNamespace(peer_ttl=6.0)),
                          clock=SimpleNamespace(monotonic=lambda: swarm.now), emit_in_round=lambda *a, **k: None)

    def sleep(seconds):
        swarm.now += seconds
        return False

    ctx.sleep = sleep
    return Certifier(ctx)


def test_a_signature_checked_once_is_not_replaced_by_a_later_read():
    """b's valid signature comes first; once the reads include published certificates, a certificate of the same
    statement carrying a forged signature for b must not replace it: the poll no longer checks b again, so the
    round would commit a certificate that every other peer refuses."""
    keys = FakeKeys()
    s = statement_for("run", "fp", 3, "d3", "d4", {m: {"round": 3, "digest": "d3", "tokens": 1, "head": ""}
                                                   for m in "abc"})
    good = {m: sign(s, keys.signer(m)) for m in "bc"}
    forged = Certificate(s, {"b": sign(s, keys.signer("mallory"))}).to_bytes()

    def script(reads, name):
        if name == "cert":
            return {"mallory": forged}
        blobs = {"b": encode_signature(s, *good["b"])} if reads <= 2 else {}  # (b's blob is missed later on)
        if reads > FAST_POLLS + 1:  # c is late: its signature comes after the reads of certificates began
            blobs["c"] = encode_signature(s, *good["c"])
        return blobs

    swarm = ScriptedSwarm(keys, script)
    cert = _certifier(swarm).certify(3, s, got_result_at=0.0)
    assert cert is not None and cert.problem(keys) is None
    assert cert.signatures["b"] == good["b"]
