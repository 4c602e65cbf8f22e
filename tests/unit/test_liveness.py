"""Bounded liveness (p2p_diloco/protocol/liveness.py), case by case: each row is a history of all-reduce attempts
(who was expected, did it fail, at what time) and which peers are cooling down at a given time."""

from __future__ import annotations

import pytest

from p2p_diloco.protocol.actions import AllReduce
from p2p_diloco.protocol.liveness import MAX_DOUBLINGS, STRIKES, Liveness

pytestmark = pytest.mark.unit
COOL = 100.0


def fail(members, t, suspects=None):
    return ("fail", tuple(members), t, suspects)


def ok(members, t):
    return ("ok", tuple(members), t, None)


def replay(history) -> Liveness:
    live = Liveness(cool_down=COOL)
    for op, members, t, suspects in history:
        if op == "fail":
            live.failed(members, t, suspects)
        else:
            live.succeeded(members, t)
    return live


PROVEN = ok("b", 0)  # b averaged with us: a failure expecting b and c singles c out


# (case, history, at, cooling at that time)
CASES = [
    ("two failures in a row: not yet", [PROVEN, fail("bc", 1), fail("bc", 2)], 3, set()),
    ("three failures in a row: the newcomer cools down, not the proven peer",
     [PROVEN, *[fail("bc", t) for t in (1, 2, 3)]], 4, {"c"}),
    ("a success in between starts the count over", [PROVEN, fail("bc", 1), fail("bc", 2), ok("bc", 3),
                                                   ok("b", 4), fail("bc", 5)], 6, set()),
    ("the cool-down ends", [PROVEN, *[fail("bc", t) for t in (1, 2, 3)]], 3 + COOL + 1, set()),
    ("on probation: one more failure after the cool-down cools it again, twice as long",
     [PROVEN, *[fail("bc", t) for t in (1, 2, 3)], fail("bc", 200)], 200 + 2 * COOL - 1, {"c"}),
    ("... and only that long", [PROVEN, *[fail("bc", t) for t in (1, 2, 3)], fail("bc", 200)], 200 + 2 * COOL + 1,
     set()),
    ("a success clears the probation", [PROVEN, *[fail("bc", t) for t in (1, 2, 3)], ok("bc", 150), ok("b", 151),
                                        fail("bc", 200)], 201, set()),
    ("failures while cooling down do not lengthen it", [PROVEN, *[fail("bc", t) for t in (1, 2, 3, 50, 60)]],
     3 + COOL + 1, set()),
    # nothing singles anyone out: an outage, or a peer that broke after averaging with us; patience (= COOL here)
    ("members proven equally long ago: a tie cools nobody down at once",
     [ok("bc", 0), *[fail("bc", t) for t in (1, 2, 3)]], 4, set()),
    ("... until the failures in a row have lasted the patience",
     [ok("bc", 0), *[fail("bc", t) for t in (1, 2, 1 + COOL)]], 2 + COOL, {"b", "c"}),
    ("never proven, all of them: a tie", [fail("bc", t) for t in (1, 2, 3)], 4, set()),
    ("one member alone: a tie (nobody to compare it with)", [fail("c", t) for t in (1, 2, 3)], 4, set()),
    ("... until the patience is over", [fail("c", t) for t in (1, 2, 1 + COOL)], 2 + COOL, {"c"}),
    ("an outage that ends in time: the success clears it",
     [ok("bc", 0), *[fail("bc", t) for t in (1, 2, 3)], ok("bc", 4), *[fail("bc", t) for t in (5, 6, 1 + COOL)]],
     2 + COOL, set()),
    # the transport said whose parts went missing
    ("the member the failure names is charged, and singled out", [fail("bc", t, {"b"}) for t in (1, 2, 3)], 4, {"b"}),
    ("a member alone, named: singled out", [fail("c", t, {"c"}) for t in (1, 2, 3)], 4, {"c"}),
    ("a name that is not a member is ignored", [fail("bc", t, {"x"}) for t in (1, 2, 3)], 4, set()),
    ("an attempt charged to nobody", [fail("", t) for t in (1, 2, 3)], 4, set()),
]


@pytest.mark.parametrize("case, history, at, cooling", CASES, ids=[c[0] for c in CASES])
def test_liveness(case, history, at, cooling):
    assert replay(history).cooling(at) == cooling, case


def test_failed_says_who_starts_a_cool_down_now():
    live = Liveness(cool_down=COOL)
    assert [live.failed(["b", "c"], t, {"b", "c"}) for t in (1, 2, 3, 4)] == [[], [], ["b", "c"], []]


def test_cool_downs_double_up_to_a_cap():
    live = Liveness(cool_down=COOL)
    t, lengths = 0.0, []
    for _ in range(MAX_DOUBLINGS + 3):
        while not live.failed(["c"], t, {"c"}):
            t += 1
        end = live.peers["c"].cooling_until
        lengths.append(end - t)
        t = end
    assert lengths == [COOL * 2 ** min(i, MAX_DOUBLINGS) for i in range(MAX_DOUBLINGS + 3)]
    assert STRIKES == 3


def test_an_attempt_is_charged_only_when_every_member_was_ready():
    ready = AllReduce(group_size=3, all_in=True, members=("a", "b"), reason="r")
    waiting = AllReduce(group_size=3, all_in=False, give_up_at=5.0, members=("a", "b"), reason="r")
    assert ready.charged == ("a", "b") and waiting.charged == ()


@pytest.mark.parametrize("strikes, cool_down, patience", [(0, COOL, None), (3, 0.0, None), (3, COOL, -1.0)])
def test_bad_parameters(strikes, cool_down, patience):
    with pytest.raises(ValueError):
        Liveness(cool_down=cool_down, strikes=strikes, patience=patience)
