"""`p2p-diloco plot` (p2p_diloco/cli/plot.py): a PNG of a run drawn from its peers' events.jsonl files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from p2p_diloco.cli import main
from p2p_diloco.cli import plot
from p2p_diloco.errors import UsageError

pytestmark = pytest.mark.unit
PEERS = ["QmZ5r48sDzDt9JWnRWSpi1wj9nRbSVRyNE5TWJnVCVS1iP", "Qmdz4tqwHVhbCFZbcMHuVbaw5FYNavmTbDtwJgEMvNYXZB",
         "QmXf9RQjz5hEk2oB7s7yHqJ4K1m1Vx9dQqAkPnTuWvLxYz"]


def _run(log_dir: Path, rounds: int = 5) -> None:
    """A synthetic 3-peer run: the third peer joins in round 3 (a download), round 4 is a group of 2."""
    for i, peer in enumerate(PEERS):
        t, events = 1000.0, []
        first = 3 if i == 2 else 1
        if first > 1:
            events.append({"t": t, "event": "state_loaded", "round": first - 1, "from_peer": PEERS[0], "digest": "d"})
        for r in range(first, rounds + 1):
            group = 2 if r == 4 and i != 1 else 3 if r >= 3 else 2
            events += [{"t": t, "event": "round_start", "round": r, "digest": "d"},
                       {"t": t + 5 + i, "event": "allreduce_done", "round": r, "group_size": group,
                        "bytes_sent": 1_800_000 * (group - 1), "bytes_received": 1_800_000, "seconds": 0.5},
                       {"t": t + 6 + i, "event": "outer_step", "round": r, "digest": "d", "inner_steps": 20,
                        "certificate": "c", "signers": group},
                       {"t": t + 6.5 + i, "event": "eval", "round": r, "loss": 5.6 - 0.5 * r}]
            t += 7 + i
        folder = log_dir / peer
        folder.mkdir(parents=True)
        (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_of_the_run(tmp_path):
    _run(tmp_path / "logs")
    out = plot.plot_run(tmp_path / "logs", tmp_path / "run.png")
    assert out == tmp_path / "run.png"
    assert _png_size(out) == (1200, 800)
    assert out.stat().st_size > 30_000  # four panels with lines, not an empty canvas
    series = plot.series(json.loads(line) for line in (tmp_path / "logs" / PEERS[2] / "events.jsonl").open())
    assert sorted(series["eval_loss"]) == [3, 4, 5] and series["group_size"] == {3: 3, 4: 2, 5: 3}
    assert series["round_s"][3] == pytest.approx(8.0) and series["mb_sent"][3] == pytest.approx(3.6)


def test_plot_command_writes_next_to_the_logs_by_default(tmp_path, capsys):
    _run(tmp_path)
    assert main(["plot", "--log-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'plot.png'}\n"
    assert _png_size(tmp_path / "plot.png") == (1200, 800)


@pytest.mark.parametrize("args, message", [
    (["--log-dir", "{tmp}/nowhere"], "no such directory"),
    (["--log-dir", "{tmp}"], "no events.jsonl under"),
    (["--log-dir", "{tmp}", "--out", "{tmp}/plot.jpg"], "--out must name a .png file"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert main(["plot", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_without_matplotlib_plot_says_what_to_install_and_swarm_skips_it(tmp_path, monkeypatch):
    _run(tmp_path)
    monkeypatch.setattr(plot, "available", lambda: False)
    with pytest.raises(UsageError, match=r"pip install 'p2p-diloco\[plot\]'"):
        plot.plot_run(tmp_path)
    assert plot.plot_if_available(tmp_path) is None and not (tmp_path / "plot.png").exists()


def test_swarm_draws_its_plot_when_it_can(tmp_path):
    assert plot.plot_if_available(tmp_path) is None  # no events: nothing to draw, no error
    _run(tmp_path)
    assert plot.plot_if_available(tmp_path) == tmp_path / "plot.png"


def test_peers_are_named_and_ordered_as_swarm_named_them(tmp_path):
    _run(tmp_path)
    for i, peer in enumerate(reversed(PEERS)):  # swarm's summaries: peer0 is the last of PEERS here
        (tmp_path / f"peer{i}.summary.json").write_text(json.dumps({"peer_id": peer}))
    (tmp_path / "peer9.summary.json").write_text("{torn")
    assert plot.swarm_indexes(tmp_path) == {PEERS[2]: 0, PEERS[1]: 1, PEERS[0]: 2}
    assert list(plot.load_run(tmp_path)) == [PEERS[2], PEERS[1], PEERS[0]]
