"""``swarm.initial_peers_wait``: a peer started together with its initial peer keeps trying it (swarm/starting.py),
and the first peer's address planned in advance (swarm/planned.py). The real processes: tests/swarm/test_swarm.py."""

import random
import socket

import pytest

from p2p_diloco.config import Config, ConfigError
from p2p_diloco.swarm.planned import free_port, plan_peer
from p2p_diloco.swarm.starting import FIRST_RETRY, MAX_RETRY, retry_delay, start_failure, with_retries

pytestmark = pytest.mark.unit

REFUSED = "Daemon failed to start: failed to connect to bootstrap peers"  # p2pd: nothing listens there
NO_PING = "DHTNode bootstrap failed: none of the initial_peers responded to a ping."  # p2pd up, its DHT not yet


@pytest.mark.parametrize("reason, tries, left, delay", [
    (REFUSED, 1, 60.0, FIRST_RETRY),
    (REFUSED, 2, 60.0, 2 * FIRST_RETRY),
    (NO_PING, 3, 60.0, 4 * FIRST_RETRY),
    (REFUSED, 30, 60.0, MAX_RETRY),  # capped
    (REFUSED, 2000, 1e9, MAX_RETRY),  # however long it has been trying
    (REFUSED, 30, 0.1, 0.1),  # never past the wait
    (REFUSED, 1, 0.0, None),  # the wait is over
    (REFUSED, 1, -1.0, None),
    ("Daemon failed to start in 30.0 seconds", 1, 60.0, None),  # p2pd itself: trying again would not help
    ("Identity from `id.key` is already taken by another peer", 1, 60.0, None),
    ("listen tcp 127.0.0.1:4000: bind: address already in use", 1, 60.0, None),
])
def test_only_an_unanswered_initial_peer_is_tried_again_and_only_within_the_wait(reason, tries, left, delay):
    assert retry_delay(reason, tries, left) == delay


class FakeTime:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _starts(*outcomes):
    """A start() that fails with each RuntimeError text in turn, then returns "dht" (a None outcome)."""
    left = list(outcomes)

    def start():
        outcome = left.pop(0)
        if outcome is not None:
            raise RuntimeError(outcome)
        return "dht"

    return start


def test_a_start_is_tried_again_until_the_initial_peer_answers():
    t = FakeTime()
    assert with_retries(_starts(REFUSED, REFUSED, NO_PING, None), 60.0, t.clock, t.sleep) == "dht"
    assert t.slept == [FIRST_RETRY, 2 * FIRST_RETRY, 4 * FIRST_RETRY]


def test_the_last_failure_propagates_once_the_wait_is_over():
    t = FakeTime()
    with pytest.raises(RuntimeError, match="failed to connect to bootstrap peers"):
        with_retries(_starts(*[REFUSED] * 100), 5.0, t.clock, t.sleep)
    assert t.now == pytest.approx(5.0) and len(t.slept) < 10


def test_without_a_wait_and_on_any_other_failure_a_start_fails_at_once():
    t = FakeTime()
    with pytest.raises(RuntimeError, match="bootstrap peers"):
        with_retries(_starts(REFUSED, None), 0.0, t.clock, t.sleep)
    with pytest.raises(RuntimeError, match="already taken"):
        with_retries(_starts("Identity from `x` is already taken by another peer", None), 60.0, t.clock, t.sleep)
    assert t.slept == []


def test_a_stop_signal_while_waiting_is_not_swallowed():
    t = FakeTime()

    def interrupted(seconds):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with_retries(_starts(REFUSED, None), 60.0, t.clock, interrupted)


def test_the_one_line_error_says_how_long_it_waited():
    peer = "/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"
    text = start_failure(RuntimeError(NO_PING), [peer], "could not start or join the swarm", 90.0)
    assert text.startswith("could not start or join the swarm: no initial peer answered within 90 s (tried ")
    assert "within" not in start_failure(RuntimeError(REFUSED), [peer], "could not start")


def test_the_wait_is_a_setting_of_this_peer_that_must_not_be_negative():
    from p2p_diloco.cli.parser import build_parser, load_join_config
    from p2p_diloco.config.sharing import LOCAL_SETTINGS

    assert Config().swarm.initial_peers_wait == 0.0  # a mistyped address still fails at once
    assert "swarm.initial_peers_wait" in LOCAL_SETTINGS  # never adopted from the run's records
    args = build_parser().parse_args(["join", "--initial-peers-wait", "30"])
    assert load_join_config(args).swarm.initial_peers_wait == 30.0
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="swarm.initial_peers_wait must be >= 0 and finite"):
            load_join_config(build_parser().parse_args(["join", "--initial-peers-wait", bad]))


class TakenFirst(random.Random):
    """Candidates: ``taken`` first, then random ones."""

    def __init__(self, taken: int):
        super().__init__(0)
        self.taken = taken

    def randrange(self, start, stop=None, step=1):
        port, self.taken = self.taken, None
        return port if port is not None else super().randrange(start, stop, step)


def _bound_below(limit: int) -> socket.socket:
    for port in range(limit - 1, 10_000, -1):  # a port of ours below the (pretended) ephemeral range
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
    raise AssertionError("no free port to take")


def test_a_planned_port_is_free_and_below_the_kernels_ephemeral_range(tmp_path, monkeypatch):
    from p2p_diloco.swarm import planned

    (tmp_path / "range").write_text("40000\t60999\n")
    monkeypatch.setattr(planned, "EPHEMERAL_RANGE", str(tmp_path / "range"))
    with _bound_below(40000) as taken:  # the first candidate is in use: never planned
        port = free_port("127.0.0.1", TakenFirst(taken.getsockname()[1]))
        assert port != taken.getsockname()[1] and 10_000 <= port < 40000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
    (tmp_path / "range").write_text("10500 60999\n")  # no room below it: the kernel's choice
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port("127.0.0.1")))


def test_a_planned_peer_dials_the_identity_it_is_started_with(tmp_path):
    from p2p_diloco.swarm.identity import Identity

    planned = plan_peer(tmp_path)
    peer_id = Identity(planned.identity_path).peer_id  # what p2pd will run as: the key in that file
    assert planned.maddr == f"{planned.host_maddr}/p2p/{peer_id}"
    assert planned.join_args() == ["--identity-path", planned.identity_path, "--host-maddrs", planned.host_maddr]
