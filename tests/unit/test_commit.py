"""The commit step's decisions, as tables: which group a member signs for, what it signs, when it commits."""

import pytest

from p2p_diloco.protocol.certificate import Certificate, sign
from p2p_diloco.protocol.commit import (Abandon, Commit, Poll, decide_commit, encode_signature, group_problem,
                                        may_sign, signatures_for, statement_for)
from p2p_diloco.testing.fake_keys import FakeKeys

pytestmark = pytest.mark.unit


def gathered(*members, round_=3, digest="d3", tokens=100, head="h3"):
    return {m: {"round": round_, "digest": digest, "tokens": tokens, "head": head} for m in members}


@pytest.mark.parametrize("expected, size, group, problem", [
    (("b", "c"), 3, gathered("a", "b", "c"), None),
    (None, 3, gathered("a", "b", "c"), None),  # no expectation: any group of the size
    (("b", "c"), 3, gathered("a", "b"), "a group of 2, we expected 3"),  # a leader with a smaller target
    (("b",), 2, gathered("a", "b", "c"), "a group of 3, we expected 2"),
    (("b", "c"), 3, gathered("a", "b", "x"), "unexpected ['x'], absent ['c']"),  # someone else took c's place
    (("b", "c"), 3, gathered("b", "c", "x"), "not in the group"),
    (("b", "c"), 3, {**gathered("a", "b"), **gathered("c", digest="other")}, "member c did not start"),
    (("b", "c"), 3, {**gathered("a", "b"), **gathered("c", round_=2)}, "member c did not start"),
    (("b", "c"), 3, {**gathered("a", "b"), **gathered("c", tokens=0)}, "no valid weight"),
    (("b", "c"), 3, {**gathered("a", "b"), "c": "not a dict"}, "member c did not start"),
])
def test_a_member_signs_only_for_the_group_it_expected(expected, size, group, problem):
    got = group_problem(3, "d3", "a", expected, size, group)
    assert (got is None) if problem is None else (problem in got), got


def test_every_member_builds_the_same_statement_and_prev_is_the_majoritys_head():
    group = {**gathered("a", "b"), **gathered("c", head="")}  # c resumed from a checkpoint without a certificate
    s = statement_for("run", "fp", 3, "d3", "d4", group)
    assert s.members == ("a", "b", "c") and s.weights == (100.0, 100.0, 100.0) and s.prev == "h3"
    assert statement_for("run", "fp", 3, "d3", "d4", dict(reversed(group.items()))) == s
    tie = {**gathered("a", head="h2"), **gathered("b", head="h1")}
    assert statement_for("run", "fp", 3, "d3", "d4", tie).prev == "h1"


@pytest.mark.parametrize("got_at, now, ok", [(10.0, 10.1, True), (10.0, 12.9, True), (10.0, 13.0, False),
                                             (10.0, 40.0, False)])
def test_a_member_frozen_past_half_the_window_does_not_sign(got_at, now, ok):
    assert may_sign(got_at, now, window=6.0) is ok


def test_commit_needs_every_signature_and_gives_up_at_the_deadline():
    keys = FakeKeys()
    s = statement_for("run", "fp", 3, "d3", "d4", gathered("a", "b", "c"))
    sigs = {m: sign(s, keys.signer(m)) for m in ("a", "b")}
    waiting = decide_commit(s, sigs, keys, now=1.0, deadline=6.0, poll=0.1)
    assert isinstance(waiting, Poll) and waiting.missing == ("c",)
    assert isinstance(decide_commit(s, sigs, keys, now=6.0, deadline=6.0, poll=0.1), Abandon)
    sigs["c"] = sign(s, keys.signer("mallory"))  # not c's key
    assert isinstance(decide_commit(s, sigs, keys, now=1.0, deadline=6.0, poll=0.1), Poll)
    sigs["c"] = sign(s, keys.signer("c"))
    done = decide_commit(s, {**sigs, "z": sign(s, keys.signer("z"))}, keys, now=1.0, deadline=6.0, poll=0.1)
    assert isinstance(done, Commit) and done.certificate.problem(keys) is None
    assert set(done.certificate.signatures) == {"a", "b", "c"}  # the outsider's signature is not carried


def test_signatures_are_found_in_sig_blobs_and_in_published_certificates():
    keys = FakeKeys()
    s = statement_for("run", "fp", 3, "d3", "d4", gathered("a", "b", "c"))
    other = statement_for("run", "fp", 3, "d3", "EVIL", gathered("a", "b", "c"))
    blobs = {"a": encode_signature(s, *sign(s, keys.signer("a"))),
             "b": encode_signature(other, *sign(other, keys.signer("b"))),  # another attempt: ignored
             "x": b"garbage", "y": b'{"id": 1}'}
    found = signatures_for(s, blobs)
    assert set(found) == {"a"}
    complete = Certificate(s, {m: sign(s, keys.signer(m)) for m in ("a", "b", "c")})
    found = signatures_for(s, blobs, {"c": complete.to_bytes(), "z": b"not a certificate"})
    assert set(found) == {"a", "b", "c"}
    assert isinstance(decide_commit(s, found, keys, 0.0, 1.0, 0.1), Commit)


class CountingKeys(FakeKeys):
    def __init__(self):
        super().__init__()
        self.checked: list[str] = []

    def verify(self, peer_id, public_key, data, signature):
        self.checked.append(peer_id)
        return super().verify(peer_id, public_key, data, signature)


def test_a_poll_checks_only_the_signatures_it_has_not_checked_before():
    """Every poll of the commit window used to verify every member's signature again (and decode every blob with
    the whole statement): about 23 ms per poll at 64 members, every 25 ms (benchmarks/commit_poll.py)."""
    keys = CountingKeys()
    s = statement_for("run", "fp", 3, "d3", "d4", gathered("a", "b", "c"))
    sigs = {m: sign(s, keys.signer(m)) for m in ("a", "b")}
    first = decide_commit(s, sigs, keys, now=1.0, deadline=6.0, poll=0.1)
    assert isinstance(first, Poll) and sorted(keys.checked) == ["a", "b"]
    keys.checked.clear()
    sigs["c"] = sign(s, keys.signer("c"))
    done = decide_commit(s, sigs, keys, 1.0, 6.0, 0.1, verified=frozenset(s.members) - set(first.missing))
    assert isinstance(done, Commit) and keys.checked == ["c"]
    assert done.certificate.problem(keys) is None


def test_a_certificate_of_another_state_is_not_decoded():
    keys = FakeKeys()
    s = statement_for("run", "fp", 3, "d3", "d4", gathered("a", "b"))
    other = statement_for("run", "fp", 3, "d3", "d5", gathered("a", "b"))
    complete = Certificate(other, {m: sign(other, keys.signer(m)) for m in ("a", "b")}).to_bytes()
    assert signatures_for(s, {}, {"a": complete}) == {}
    # a blob that names our after-digest but is not a certificate is decoded, and ignored
    assert signatures_for(s, {}, {"a": b'{"after": "d4"}'}) == {}
