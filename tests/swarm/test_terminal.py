"""The live views as a person sees them: `swarm` and `join` on a real terminal (tmux, from Debian's package: a
detached session of fixed size on a server of its own; `capture-pane` reads the screen, `send-keys C-c` types
Ctrl-C), and `swarm` piped to a file."""

from __future__ import annotations

import re
import shlex
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import TAG_VAR, survivors
from tests.swarm.helpers import FAST, LONE

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^peer(\d) (\S{10}) +(\d+) +(\d+) +(\S+) +(\S+) +(\w[\w ]*?) +(\S+) +(\S+)$")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _command(args: list[str], tag: str) -> str:
    """A shell line that runs ``p2p-diloco ARGS`` tagged for the ``reap`` fixture, prints its exit code, and keeps
    the pane open for reading."""
    env = f"env -u P2P_DILOCO_INITIAL_PEERS {TAG_VAR}={tag}"
    return f"cd {shlex.quote(str(REPO))} && {env} {shlex.join([sys.executable, '-m', 'p2p_diloco', *args])}; " \
           f"echo EXIT=$?; sleep 600"


class Terminal:
    """A detached tmux session of a fixed size on its own server (``-L``), running one shell command."""

    def __init__(self, command: str, width: int = 120, height: int = 40):
        self.server = f"p2pd-test-{uuid.uuid4().hex[:12]}"
        self._tmux("new-session", "-d", "-x", str(width), "-y", str(height), command)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.server, *args], check=True, capture_output=True, text=True,
                              timeout=10).stdout

    def screen(self) -> list[str]:
        """The visible lines (wrapped lines joined, trailing blanks dropped)."""
        return [line.rstrip() for line in self._tmux("capture-pane", "-p", "-J").splitlines() if line.strip()]

    def wait_for(self, predicate, timeout: float, what: str) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.screen()
            if predicate(lines):
                return lines
            time.sleep(0.3)
        raise AssertionError(f"no {what} on the screen within {timeout} s:\n" + "\n".join(self.screen()))

    def exit_code(self, timeout: float) -> int:
        lines = self.wait_for(lambda s: any(line.startswith("EXIT=") for line in s), timeout, "exit")
        return int(next(line for line in lines if line.startswith("EXIT="))[5:])

    def ctrl_c(self) -> None:
        self._tmux("send-keys", "C-c")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True, timeout=10)


def _rows(screen: list[str]) -> dict[int, list[tuple[int, tuple[str, ...]]]]:
    """{peer index: [(line number, cells)]} of the swarm's live rows on the screen."""
    rows: dict[int, list] = {}
    for number, line in enumerate(screen):
        if m := ROW.match(line):
            rows.setdefault(int(m.group(1)), []).append((number, m.groups()[1:]))
    return rows


def _training(screen: list[str]) -> bool:
    rows = _rows(screen)
    return len(rows) == 2 and all(cells[5] == "train" and int(cells[2]) >= 10 for (_, cells), in rows.values())


def test_swarm_rows_update_in_place_on_a_terminal_and_ctrl_c_stops_it(tmp_path, reap):
    """One row per peer, redrawn where it was while the peers train (no scrolling copies, no glued lines); Ctrl-C
    stops every peer, prints the table and exits non-zero (130)."""
    args = ["swarm", "--peers", "2", "--max-rounds", "1", "--inner-steps", "40", "--debug-step-delay", "0.15",
            "--log-dir", str(tmp_path), "--run-id", "t-term", *FAST]
    term = Terminal(_command(args, reap))
    try:
        first = term.wait_for(_training, 150, "two training rows")
        later = term.wait_for(lambda s: _training(s) and _rows(s) != _rows(first), 30, "a row that changed")
        for screen in (first, later):
            rows = _rows(screen)
            assert sorted(rows) == [0, 1] and all(len(found) == 1 for found in rows.values()), screen
            header = [n for n, line in enumerate(screen) if line.split()[:4] == ["peer", "round", "step", "loss"]]
            assert len(header) == 1 and [rows[0][0][0], rows[1][0][0]] == [header[0] + 1, header[0] + 2], screen
            assert not any(line.count("peer0") + line.count("peer1") > 1 for line in screen), screen
        assert _rows(later)[0][0][0] == _rows(first)[0][0][0]  # the same line of the screen, new values
        term.ctrl_c()
        assert term.exit_code(120) != 0  # 130: the shell's code for Ctrl-C
        screen = term.screen()
        assert "interrupted: stopping every peer" in screen
        assert any(line.startswith("peer       rounds") for line in screen), screen
        assert any(line.startswith("all digests agree: ") for line in screen), screen
        assert not survivors(reap), "processes survived an interrupted swarm"
    finally:
        term.close()


@pytest.mark.light
def test_join_status_line_stays_below_the_log_lines(tmp_path, reap):
    """The status line at the bottom, each log line on its own line above it; Ctrl-C stops the peer."""
    args = ["join", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", "t-term-join", "--max-rounds", "2",
            "--inner-steps", "60", "--debug-step-delay", "0.1", *FAST, *LONE]
    term = Terminal(_command(args, reap))

    def logged_while_training(screen: list[str]) -> bool:
        return bool(screen) and screen[-1].startswith("round 1  inner step") and any(
            "inner_progress round=1 inner_step=20" in line for line in screen)

    try:
        screen = term.wait_for(logged_while_training, 120, "a status line below an inner_progress log line")
        assert re.fullmatch(r"round 1  inner step \d+/60  loss \d+\.\d{3}  [\d,]+ tok/s", screen[-1]), screen[-1]
        logged = [line for line in screen if " INFO " in line]
        assert logged and all(re.match(r"\d\d:\d\d:\d\d INFO ", line) for line in logged), screen
        assert not any("tok/s" in line for line in logged), screen  # nothing glued to the status line
        assert screen[0].startswith("p2p-diloco join --initial-peers "), screen
        term.ctrl_c()
        assert term.exit_code(60) != 0
        screen = term.screen()
        assert not any("tok/s" in line and " INFO " in line for line in screen), screen
        assert not survivors(reap)
    finally:
        term.close()


def test_piped_swarm_is_plain_lines_and_draws_its_plot(tmp_path, reap):
    """The same view in a file: no escape codes or carriage returns, a line per change at most every few seconds;
    the final table, the digest line, and the run's PNG."""
    log_dir, out = tmp_path / "logs", tmp_path / "out.txt"
    args = ["swarm", "--peers", "2", "--max-rounds", "1", "--inner-steps", "20", "--log-dir", str(log_dir),
            "--run-id", "t-piped", *FAST]
    with open(out, "w") as f:
        started = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "p2p_diloco", *args], stdout=f, stderr=subprocess.STDOUT,
                              cwd=REPO, env=_env(reap), timeout=240).returncode
        seconds = time.monotonic() - started
    text = out.read_text()
    assert code == 0, text
    assert "\x1b" not in text and "\r" not in text, repr(text)
    lines = text.splitlines()
    rows = [line for line in lines if re.match(r"\d\d:\d\d:\d\d peer[01] ", line)]
    assert {line.split()[1] for line in rows} == {"peer0", "peer1"}
    assert len(rows) <= 2 * (seconds / 5 + 3), rows  # at most one line per peer every 5 s (+ first, exit)
    assert any(re.search(r"round 1  step 20  loss \d\.\d{3}  [\d,]+ tok/s  done  \d\.\d MB sent  eval loss \d",
                         line) for line in rows), rows
    assert "all digests agree: yes" in lines and lines[-1] == f"plot: {log_dir / 'plot.png'}", lines[-3:]
    assert (log_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not survivors(reap)


def _env(tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "P2P_DILOCO_INITIAL_PEERS"}
    env[TAG_VAR] = tag
    return env
