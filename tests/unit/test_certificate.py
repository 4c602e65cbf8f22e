"""Round certificates: canonical statements, complete signatures, bounded decoding, and the hand-off rule."""

import pytest

from p2p_diloco.protocol.certificate import MAX_BYTES, MAX_MEMBERS, Certificate, Statement, check_link, sign
from p2p_diloco.swarm.identity import Identity, RSAKeyBook
from p2p_diloco.testing.fake_keys import FakeKeys

pytestmark = pytest.mark.unit


def statement(members=("a", "b", "c"), round_=4, before="d4", after="d5", prev="c4", **kw) -> Statement:
    body = dict(run_id="run", fingerprint="fp", round=round_, members=tuple(members),
                weights=tuple(1.0 + i for i in range(len(members))), before=before, after=after, prev=prev)
    return Statement(**{**body, **kw})


def certify(s: Statement, keys: FakeKeys, signers=None) -> Certificate:
    return Certificate(s, {m: sign(s, keys.signer(m)) for m in (s.members if signers is None else signers)})


def test_a_certificate_is_complete_only_with_every_members_valid_signature():
    keys = FakeKeys()
    s = statement()
    assert certify(s, keys).problem(keys) is None
    assert "1 of 3" in certify(s, keys, signers=("a", "b")).problem(keys)
    forged = certify(s, keys, signers=("a", "b"))
    forged.signatures["c"] = sign(s, keys.signer("mallory"))  # mallory's key for c's id
    assert "1 of 3" in forged.problem(keys)
    other = statement(after="evil")
    replayed = Certificate(s, {**certify(s, keys, ("a", "b")).signatures, "c": sign(other, keys.signer("c"))})
    assert "1 of 3" in replayed.problem(keys)  # c signed another statement
    outsider = Certificate(s, {**certify(s, keys).signatures, "z": sign(s, keys.signer("z"))})
    assert outsider.signed_by(keys) == {"a", "b", "c"}  # a signature of a non-member counts for nothing


@pytest.mark.parametrize("change, problem", [
    (dict(members=("b", "a")), "sorted"),
    (dict(members=("a", "a")), "sorted"),
    (dict(members=()), "0 members"),
    (dict(members=tuple(f"p{i:03d}" for i in range(MAX_MEMBERS + 1)), weights=(1.0,) * (MAX_MEMBERS + 1)), "65"),
    (dict(weights=(1.0, 0.0, 1.0)), "weights"),
    (dict(weights=(1.0, float("nan"), 1.0)), "weights"),
    (dict(weights=(1.0,)), "one weight per member"),
    (dict(round=-1), "round"),
])
def test_malformed_statements_are_refused(change, problem):
    keys = FakeKeys()
    s = statement(**change)
    assert problem in s.problem()
    assert "malformed" in certify(s, keys).problem(keys)


def test_encoding_is_canonical_and_round_trips():
    keys = FakeKeys()
    cert = certify(statement(), keys)
    again = Certificate.from_bytes(cert.to_bytes())
    assert again == cert and again.id == cert.id and again.problem(keys) is None
    assert statement().id == statement().id != statement(after="x").id


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'{"statement": {}}', b'{"statement": 1, "signatures": {}}',
                                  b"x" * (MAX_BYTES + 1)])
def test_malformed_or_oversized_bytes_are_a_value_error(data):
    with pytest.raises(ValueError):
        Certificate.from_bytes(data)


def test_bad_base64_in_a_signature_is_a_value_error():
    body = certify(statement(), FakeKeys()).to_json()
    body["signatures"]["a"][1] = "not base64!"
    with pytest.raises(ValueError):
        Certificate.from_json(body)


def _chain(keys, groups):
    """Certificates of consecutive rounds, the k-th signed by ``groups[k]``."""
    certs, prev, digest = [], "", "d0"
    for r, group in enumerate(groups):
        s = statement(members=tuple(sorted(group)), round_=r, before=digest, after=f"d{r + 1}", prev=prev)
        certs.append(certify(s, keys))
        prev, digest = certs[-1].id, f"d{r + 1}"
    return certs


@pytest.mark.parametrize("groups, ok", [
    ([("a", "b", "c"), ("a", "b", "c", "d")], True),  # a newcomer joins
    ([("a", "b", "c"), ("a", "b")], True),  # one of three leaves
    ([("a", "b", "c"), ("a", "x", "y")], False),  # a minority of the group plus two fresh identities
    ([("a", "b", "c"), ("x", "y")], False),  # fresh identities only: a Sybil take-over
    ([("a", "b"), ("a",)], True),  # the survivor of a pair goes on (half is enough)
    ([("a", "b", "c", "d"), ("a", "x")], False),  # a minority of a group plus a fresh identity
    ([("a",), ("a",)], True),  # a lone peer goes on
    ([("a",), ("a", "b")], True),
])
def test_the_hand_off_rule_needs_half_of_the_previous_group(groups, ok):
    keys = FakeKeys()
    first, second = _chain(keys, groups)
    problem = check_link(first, second, keys)
    assert (problem is None) == ok, problem


def test_a_link_must_name_the_previous_certificate_and_its_state():
    keys = FakeKeys()
    first, second = _chain(keys, [("a", "b"), ("a", "b")])
    assert check_link(first, second, keys) is None
    wrong_prev = certify(statement(members=("a", "b"), round_=1, before="d1", after="d2", prev="x"), keys)
    wrong_before = certify(statement(members=("a", "b"), round_=1, before="dX", after="d2", prev=first.id), keys)
    skipped = certify(statement(members=("a", "b"), round_=2, before="d1", after="d3", prev=first.id), keys)
    for cert in (wrong_prev, wrong_before, skipped):
        assert "does not follow" in check_link(first, cert, keys)


def test_total_turnover_over_many_rounds_is_tolerated_one_member_at_a_time():
    """The whole group is replaced over six rounds, one member a round: every link holds."""
    keys = FakeKeys()
    groups = [("a", "b", "c"), ("b", "c", "d"), ("c", "d", "e"), ("d", "e", "f")]
    certs = _chain(keys, groups)
    assert all(check_link(p, c, keys) is None for p, c in zip(certs, certs[1:]))
    assert not set(groups[0]) & set(groups[-1])


def test_real_rsa_identities_sign_and_verify():
    keys, a, b = RSAKeyBook(), Identity(), Identity()
    try:
        s = statement(members=tuple(sorted([a.peer_id, b.peer_id])))
        cert = Certificate(s, {i.peer_id: sign(s, i) for i in (a, b)})
        assert cert.problem(keys) is None
        again = Certificate.from_bytes(cert.to_bytes())
        assert again.problem(keys) is None and len(cert.to_bytes()) < MAX_BYTES
        swapped = Certificate(s, {a.peer_id: sign(s, b), b.peer_id: sign(s, b)})  # b's key under a's id
        assert "1 of 2" in swapped.problem(keys)
        assert not keys.verify(a.peer_id, b"garbage", s.encode(), b"sig")
    finally:
        a.close()
        b.close()


def test_a_peer_never_certifies_a_round_its_chain_would_not_follow():
    from p2p_diloco.protocol.trust import extension_problem

    keys = FakeKeys()
    head = certify(statement(members=("a", "b", "c")), keys)
    assert extension_problem(("a", "b"), head, None) is None
    assert "only 1 of the 3" in extension_problem(("a",), head, None)  # a minority cut off from its group
    assert "only 1 of the 3" in extension_problem(("a", "x", "y"), head, None)
    assert extension_problem(("x",), None, None) is None  # the first peer of a swarm
    assert extension_problem(("x",), None, frozenset({"r"})) is None  # no chain yet: initial peers may be bootstraps


def test_a_peer_behind_a_total_turnover_follows_the_swarm_through_the_intermediate_certificates():
    """Issue 20 (found by benchmarks/faults.py): a peer restarted from a checkpoint of round 1 ({a, b, c}) found the
    swarm in round 4 signed by {d, e, f}: none of its group, so it left every record out and was stuck for good.
    With the intermediate certificates (the others' chain blobs) it walks the chain link by link."""
    from p2p_diloco.protocol.certificate import decode_chain, encode_chain
    from p2p_diloco.protocol.trust import linked, trust_problem

    keys = FakeKeys()
    certs = _chain(keys, [("a", "b", "c"), ("b", "c", "d"), ("c", "d", "e"), ("d", "e", "f")])
    head, target = certs[0], certs[-1]
    args = (head, None, "run", "fp", keys)
    assert "signed by 0 of the 3" in trust_problem(target, *args)
    published = decode_chain(encode_chain(certs[:-1]))
    assert [c.id for c in published] == [c.id for c in certs[:-1]]
    known = {c.id: c for c in published}
    assert linked(head, target, known, keys)
    assert trust_problem(target, *args, known=known) is None
    missing = {c.id: c for c in published if c.round != 2}  # a gap in the chain: no walk
    assert not linked(head, target, missing, keys)
    fake = _chain(keys, [("a", "b", "c"), ("x", "y"), ("x", "y"), ("x", "y")])  # a fork of fresh identities
    fake_known = {c.id: c for c in fake[1:3]}
    fake_known[fake[1].id] = certify(statement(members=("x", "y"), round_=1, before="d1", after="d2",
                                               prev=head.id), keys)
    assert not linked(head, fake[-1], fake_known, keys)  # every link must keep half of the one before


def test_a_chain_blob_holds_as_many_certificates_as_fit():
    from p2p_diloco.protocol.certificate import CHAIN_BYTES, CHAIN_LENGTH, decode_chain, encode_chain

    keys = FakeKeys()
    certs = _chain(keys, [tuple(f"m{i}" for i in range(40))] * 12)
    blob = encode_chain(certs)
    got = decode_chain(blob)
    assert len(blob) <= CHAIN_BYTES and 0 < len(got) <= CHAIN_LENGTH
    assert [c.id for c in got] == [c.id for c in certs[-len(got):]]  # the newest, oldest first
    with pytest.raises(ValueError):
        decode_chain(b"[" + b"{}," * 3 + b"{}]")
