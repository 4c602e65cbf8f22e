"""`p2p-diloco status`'s view of the records (p2p_diloco/cli/status_view.py): pure, no network."""

import pytest

from p2p_diloco.cli.status_view import format_view, swarm_view
from p2p_diloco.protocol.records import PeerRecord

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
    assert view["swarm_round"] == 3
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
