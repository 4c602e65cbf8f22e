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


def _statement(members: str, after: str):
    return statement_for("run", "fp", 3, "d3", after, {m: {"round": 3, "digest": "d3", "tokens": 1, "head": ""}
                                                       for m in members})


class RecordingSwarm(ScriptedSwarm):
    def __init__(self, keys, script):
        super().__init__(keys, script)
        self.put = []

    def put_blob(self, name, value, ttl=None):
        self.put.append(name)


@pytest.mark.parametrize("completed", [True, False], ids=["completed-late", "never-completed"])
def test_no_second_statement_of_a_round_once_the_one_we_gave_up_on_completed(completed):
    """chaos --quick on 3efd27d (16 peers, 2 cores): a gave up on {a, b}'s statement of round 1 without reading
    b's signature, b read a's and committed; a then signed {a, c}'s statement of the same round, which committed
    too: two states for one round. Now a reads the statement it gave up on once more before it signs another of
    that round: complete (b's published certificate) -> a signs nothing; never completed -> a signs as before."""
    keys = FakeKeys()
    first, second = _statement("ab", "d4"), _statement("ac", "d4-other")
    b_cert = Certificate(first, {m: sign(first, keys.signer(m)) for m in "ab"}).to_bytes()
    phase = ["first"]

    def script(reads, name):
        if phase[0] == "first":
            return {}  # b's signature is never read within the window
        if name == "cert":
            return {"b": b_cert} if completed else {}
        return {"c": encode_signature(second, *sign(second, keys.signer("c")))}

    swarm = RecordingSwarm(keys, script)
    certifier = _certifier(swarm)
    assert certifier.certify(3, first, got_result_at=0.0) is None  # gave up after the window
    assert swarm.put == ["sig"]
    phase[0] = "second"
    cert = certifier.certify(3, second, got_result_at=swarm.now)
    if completed:
        assert cert is None and swarm.put == ["sig"], "a signed a second statement of round 3"
    else:
        assert cert is not None and cert.statement == second and swarm.put == ["sig", "sig"]
