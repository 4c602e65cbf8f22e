"""What a person watches (p2p_diloco/cli/live.py): `join`'s status line and `swarm`'s row per peer, in place on a
terminal and as plain, throttled lines in a pipe; one peer-id abbreviation everywhere. (On a real terminal:
tests/swarm/test_terminal.py.)"""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest

from p2p_diloco.cli.launcher import format_table
from p2p_diloco.cli.live import PLAIN_EVERY, PeerRow, StatusLine, SwarmView, plain_line, row_cells
from p2p_diloco.metrics import EventLog, read_events, short_id

pytestmark = pytest.mark.unit
PID = "QmZ5r48sDzDt9JWnRWSpi1wj9nRbSVRyNE5TWJnVCVS1iP"
OTHER = "Qmdz4tqwHVhbCFZbcMHuVbaw5FYNavmTbDtwJgEMvNYXZB"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_abbreviation_of_peer_ids():
    assert short_id(PID) == "WJnVCVS1iP" and short_id(None) == "?"
    table = format_table([{"peer_id": PID, "rounds_completed": 2, "exit_code": 0}])
    assert table.splitlines()[1].startswith("WJnVCVS1iP ")
    assert row_cells("peer0", PID, PeerRow(), None)[0] == "peer0 WJnVCVS1iP"


def test_the_log_line_of_an_event_shortens_peer_ids_and_events_jsonl_keeps_them(tmp_path, caplog):
    events = EventLog(tmp_path)
    with caplog.at_level(logging.INFO, logger="p2p_diloco"):
        events.event("state_loaded", 3, from_peer=PID, digest="ab" * 32)
        events.event("stragglers_dropped", 4, peers=[PID, OTHER], waited_s=1.0)
    events.close()
    assert "from_peer=WJnVCVS1iP" in caplog.text and "peers=[WJnVCVS1iP,JgEMvNYXZB]" in caplog.text
    assert PID not in caplog.text
    assert f"digest={'ab' * 6}\n" in caplog.text and "ab" * 7 not in caplog.text  # 12 characters of a digest
    assert [e.get("from_peer") for e in read_events(tmp_path / "events.jsonl")] == [PID, None]
    assert read_events(tmp_path / "events.jsonl")[0]["digest"] == "ab" * 32


EVENTS = [
    {"event": "eval", "round": 0, "loss": 5.6546},
    {"event": "round_start", "round": 1, "digest": "d0"},
    {"event": "inner_progress", "round": 1, "inner_step": 10, "loss": 4.6462, "global_step": 10,
     "tokens_per_s": 1308.4},
    {"event": "inner_done", "round": 1, "inner_steps": 12, "tokens": 12288, "seconds": 1.7},
    {"event": "allreduce_start", "round": 1, "expected_group_size": 2, "attempt": 1},
    {"event": "allreduce_done", "round": 1, "group_size": 2, "bytes_sent": 1846943, "bytes_received": 1846841,
     "seconds": 0.14},
    {"event": "outer_step", "round": 1, "digest": "d1", "inner_steps": 12, "certificate": "c", "signers": 2},
    {"event": "eval", "round": 1, "loss": 4.5262},
    {"event": "round_start", "round": 2, "digest": "d1"},
]


def test_a_row_is_folded_from_the_peers_events():
    row = PeerRow()
    assert row_cells("peer1", None, row, None) == ["peer1 ?", "-", "-", "-", "-", "starting", "0.0", "-"]
    for e in EVENTS[:4]:
        row.apply(e)
    assert row_cells("peer0", PID, row, None) == [
        "peer0 WJnVCVS1iP", "1", "10", "4.646", "1,308", "sync", "0.0", "5.655"]
    for e in EVENTS[4:]:
        row.apply(e)
    cells = row_cells("peer0", PID, row, None)  # a new round: its step starts at 0, the last loss stays
    assert cells == ["peer0 WJnVCVS1iP", "2", "0", "4.646", "1,308", "train", "1.8", "4.526"]
    assert row_cells("peer0", PID, row, 0)[5] == "done" and row_cells("peer0", PID, row, 143)[5] == "exited 143"
    assert plain_line(cells) == ("peer0 WJnVCVS1iP  round 2  step 0  loss 4.646  1,308 tok/s  train  1.8 MB sent  "
                                 "eval loss 4.526")


class FakePeer:
    def __init__(self, peer_id):
        self.peer_id, self.returncode = peer_id, None

    def poll(self):
        return self.returncode


def _write(log_dir: Path, peer_id: str, *events: dict) -> None:
    path = log_dir / peer_id / "events.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps({"t": 0.0, **e}) + "\n")


def test_piped_swarm_rows_are_plain_lines_at_most_every_few_seconds(tmp_path):
    peers, out, clock = [FakePeer(PID), FakePeer(None)], io.StringIO(), Clock()
    with SwarmView(peers, tmp_path, stream=out, clock=clock) as view:
        view.update()  # a first line for each peer
        assert len(out.getvalue().splitlines()) == 2
        peers[1].peer_id = OTHER
        for e in EVENTS[:3]:
            _write(tmp_path, PID, e)
            clock.now += 1.0
            view.update()  # changed, but too soon
        assert len(out.getvalue().splitlines()) == 2
        clock.now = PLAIN_EVERY + 0.5
        view.update()
        lines = out.getvalue().splitlines()
        assert len(lines) == 4 and "round 1  step 10  loss 4.646  1,308 tok/s  train" in lines[2], lines
        events = tmp_path / PID / "events.jsonl"
        with open(events, "a") as f:  # a torn last line (the peer is writing it): read once it is complete
            f.write('{"t": 0.0, "event": "eval", "round": 1, "lo')
        view.update()
        assert len(out.getvalue().splitlines()) == 4
        with open(events, "a") as f:
            f.write('ss": 4.9}\n')
        peers[0].returncode = 0  # an exit shows at once
        view.update()
        assert out.getvalue().splitlines()[-1].endswith("round 1  step 10  loss 4.646  1,308 tok/s  done  0.0 MB "
                                                        "sent  eval loss 4.900")
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert all(re.match(r"\d\d:\d\d:\d\d peer[01] ", line) for line in text.splitlines())


def test_on_a_terminal_swarm_rows_are_a_table_redrawn_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: this stream is a terminal
    peers, out = [FakePeer(PID), FakePeer(OTHER)], io.StringIO()
    with SwarmView(peers, tmp_path, stream=out) as view:
        _write(tmp_path, PID, *EVENTS[:3])
        view.update()
        view.update()
    text = out.getvalue()
    assert "\x1b[1A" in text and "\x1b[2K" in text  # cursor up, erase line: the rows are redrawn where they were
    screen = ANSI.sub("", text.split("\x1b[2K")[-1])
    assert "peer0 WJnVCVS1iP" in screen and "peer1 JgEMvNYXZB" in screen and "4.646" in screen


def test_piped_status_line_is_a_plain_line_every_few_seconds():
    out, clock = io.StringIO(), Clock()
    status = StatusLine(stream=out, clock=clock)
    for t, text in ((0.0, "round 1  inner step 1/20"), (1.0, "round 1  inner step 2/20"),
                    (PLAIN_EVERY + 0.1, "round 1  inner step 9/20")):
        clock.now = t
        status.status(text)
    status.close()
    assert out.getvalue() == "round 1  inner step 1/20\nround 1  inner step 9/20\n"


def test_on_a_terminal_log_lines_print_above_the_status_line(monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    out = io.StringIO()
    handler = logging.StreamHandler(out)  # as the CLI's stderr handler: a stream handler on the same stream
    logger = logging.getLogger("p2p_diloco.test_live")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        status = StatusLine(stream=out)
        status.status("round 1  inner step 3/20  loss 4.000  1,010 tok/s")
        logger.warning("17:37:54 INFO p2p_diloco: inner_done round=1")
        status.status("round 1  inner step 4/20  loss 3.900  1,020 tok/s")
        status.close()
        assert handler.stream is out  # given back
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    pieces = [ANSI.sub("", p) for p in re.split(r"[\r\n]|\x1b\[2K", text)]
    assert any(p.startswith("17:37:54 INFO") for p in pieces), pieces
    assert not any("tok/s" in p and "INFO" in p for p in pieces), pieces  # never glued
    assert ANSI.sub("", text).rstrip().endswith("round 1  inner step 4/20  loss 3.900  1,020 tok/s")
