"""`p2p-diloco status`'s view of the records (p2p_diloco/cli/status_view.py): pure, no network."""

import pytest

from p2p_diloco.cli.status_view import format_view, shown_round, swarm_view
from p2p_diloco.protocol.records import Phase, PeerRecord

pytestmark = pytest.mark.unit


def _rec(round_, digest, phase="train", **kw):
    return PeerRecord.from_wire({"round": round_, "digest": digest, "phase": phase, "t": 100.0, **kw})


def test_digest_agreement_is_judged_within_each_round_by_majority():
    records = {
        "peerA": _rec(3, "good", inner_step=7, tokens_per_s=1234.5, eval_loss=2.5, last_sync=90.0),
        "peerB": _rec(3, "good"),
        "peerC": _rec(3, "bad"),
        "peerD": _rec(2, "old"),  # alone in its round: the majority of one
        "peerE": _rec(3, "x", phase="join"),  # not synced yet: cannot be judged
        "peerF": _rec(3, "good", phase="left"),  # gone: not shown
        "peerG": _rec(3, "good", client=True),
    }
    view = swarm_view("run", records, now=100.0)
    by_id = {p["peer_id"]: p for p in view["peers"]}
    assert set(by_id) == {"peerA", "peerB", "peerC", "peerD", "peerE", "peerG"}
    assert view["swarm_round"] == 4  # they hold θ(3): they are in round 4, as their own output says
    assert by_id["peerA"]["round"] == 4 and by_id["peerA"]["rounds_completed"] == 3
    assert [by_id[p]["digest_agrees"] for p in ("peerA", "peerB", "peerC", "peerD", "peerE")] == [
        True, True, False, True, None]
    assert by_id["peerG"]["client_mode"] is True and by_id["peerA"]["client_mode"] is False
    assert by_id["peerA"]["last_sync_ago_s"] == 10.0 and by_id["peerB"]["last_sync_ago_s"] is None
    assert view["all_digests_agree"] is False
    table = format_view(view)
    assert "NO" in table and "1,234" in table and "2.5000" in table and "10s ago" in table


def test_empty_swarm_says_what_to_check():
    view = swarm_view("nobody", {}, now=0.0)
    assert view == {"run_id": "nobody", "swarm_round": None, "peers": [], "all_digests_agree": True}
    assert "no live peer" in format_view(view)


def test_rounds_are_shown_as_the_peers_show_them():
    """A peer holding θ(0) trains round 1 and says so ("round 1 inner step ..."); `status` says round 1 too, and
    the last round completed once the peer is done."""
    assert shown_round(0, Phase.TRAIN) == 1 and shown_round(0, Phase.SYNC) == 1 and shown_round(2, Phase.JOIN) == 3
    assert shown_round(3, Phase.DONE) == 3
    assert shown_round(-1, Phase.JOIN) is None
    training = swarm_view("run", {"a": _rec(0, "d"), "b": _rec(0, "d", phase="sync")}, now=100.0)
    assert training["swarm_round"] == 1 and [p["round"] for p in training["peers"]] == [1, 1]
    assert "swarm round 1" in format_view(training)
    done = swarm_view("run", {"a": _rec(3, "d", phase="done"), "b": _rec(3, "d", phase="done")}, now=100.0)
    assert done["swarm_round"] == 3 and [p["round"] for p in done["peers"]] == [3, 3]


def test_peer_ids_are_shortened_like_everywhere_else():
    pid = "QmZ5r48sDzDt9JWnRWSpi1wj9nRbSVRyNE5TWJnVCVS1iP"
    table = format_view(swarm_view("run", {pid: _rec(1, "d")}, now=100.0))
    row = table.splitlines()[2]
    assert row.startswith("WJnVCVS1iP ") and pid[:-10] not in table
