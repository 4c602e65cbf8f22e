"""State pushes from client-mode peers (protocol/push.py): who pushes to whom, the byte bound, the pending slot;
and the donor order that puts client-mode peers last."""

import random

import pytest

from p2p_diloco.protocol import consensus, push, rules
from p2p_diloco.protocol.records import PeerRecord
from p2p_diloco.swarm.schema import normalize_record

pytestmark = pytest.mark.unit


def asker(wants=4, ask="me", client=False, **more):
    return PeerRecord(round=2, phase="join", wants=wants, ask=ask, client=client, **more)


@pytest.mark.parametrize("case, record, round_, certified, expected", [
    ("it asks us for the round we hold", asker(), 4, True, True),
    ("it asks for an earlier round than ours: our later one may do (the receiver checks)", asker(3), 4, True, True),
    ("it asks for a round we do not hold yet", asker(5), 4, True, False),
    ("it asks another client", asker(ask="other"), 4, True, False),
    ("no wish", asker(wants=None, ask=""), 4, True, False),
    ("our state has no certificate", asker(), 4, False, False),
    ("the asker is a client too: it cannot be dialed", asker(client=True), 4, True, False),
])
def test_should_push(case, record, round_, certified, expected):
    assert push.should_push(record, "me", round_, certified) is expected, case


def test_push_targets_are_the_askers_we_can_serve_sorted():
    view = {"b": asker(), "a": asker(3), "c": asker(ask="x"), "d": PeerRecord(round=4, phase="train")}
    assert push.push_targets(view, "me", 4, True) == ["a", "b"]
    assert push.push_targets(view, "me", 4, False) == []


def test_push_limit_is_our_state_plus_metadata():
    limit = push.push_limit(8_000_000, 4)
    assert 8_000_000 < limit <= 8_000_000 + push.METADATA_BYTES + 4 * push.TENSOR_OVERHEAD_BYTES
    assert push.over_limit(limit, limit) is None
    assert "exceeds" in push.over_limit(limit + 1, limit)


def test_a_push_is_taken_only_from_the_peer_we_asked_while_the_wish_lasts():
    assert "asked nobody" in push.slot_refusal(None, "c1", 0.0)
    slot = push.PushSlot("c1", 4, 1000, deadline=10.0)
    assert push.slot_refusal(slot, "c1", 9.9) is None
    assert "not c2" in push.slot_refusal(slot, "c2", 1.0)
    assert "expired" in push.slot_refusal(slot, "c1", 10.0)
    slot.busy = True
    assert "already" in push.slot_refusal(slot, "c1", 1.0)


def test_client_donors_come_last_everywhere():
    view = {"c": PeerRecord(round=4, phase="train", digest="x", client=True),
            "a": PeerRecord(round=4, phase="train", digest="x"),
            "b": PeerRecord(round=4, phase="sync", digest="x"),
            "z": PeerRecord(round=4, phase="train", digest="y", client=True)}
    for seed in range(5):
        digest, donors = consensus.pick_donors(view, 4, random.Random(seed))
        assert digest == "x" and donors[-1] == "c" and sorted(donors[:2]) == ["a", "b"]
    assert consensus.reachable_first(view, ["c", "b", "a"]) == ("a", "b", "c")
    action = rules.decide_linger(4, view, now=0.0, deadline=10.0, poll=1.0, digest="y")
    assert isinstance(action, rules.Repair) and action.donors == ("a", "b", "c")


def test_the_wish_fields_pass_the_dht_schema():
    record = {"fp": "0123456789abcdef", "round": 2, "phase": "join", "wants": 4,
              "ask": "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"}
    assert normalize_record(record) == record
    assert normalize_record(dict(record, wants=None, ask="")) == {k: v for k, v in record.items() if k != "wants"} | {
        "ask": ""}
    assert PeerRecord.from_wire(record).wants == 4


def test_the_pusher_serves_each_wish_once_and_only_with_a_certified_state():
    import time

    from p2p_diloco.swarm.state_push import Pusher

    calls, answers = [], iter([False, True])
    pusher = Pusher("me", lambda peer, timeout: calls.append(peer) or next(answers), timeout=60.0)

    def poll(ours, records):
        pusher.poll(records, ours)
        deadline = time.monotonic() + 5
        while pusher._busy.locked() and time.monotonic() < deadline:
            time.sleep(0.01)

    wish = {"a": {"round": 1, "phase": "join", "wants": 3, "ask": "me"}, "me": {"round": 3, "ask": "me", "wants": 3}}
    poll({"round": 3, "phase": "train", "head": ""}, wish)  # no certificate: nothing is pushed
    poll({"round": 3, "phase": "repair", "head": "ab"}, wish)  # not a synced state: nothing either
    assert calls == []
    certified = {"round": 3, "phase": "train", "head": "ab"}
    poll(certified, wish)  # refused (the asker was not ready): retried at the next heartbeat
    poll(certified, wish)  # taken
    poll(certified, wish)  # already served: not pushed again
    assert calls == ["a", "a"]
