"""A fault injected from outside real peer processes: SIGTERM of one peer while its parts are in flight, through the
real averager and data plane. (Every protocol scenario of a fault, a kill -9 or SIGSTOP in each phase of a round,
a desync, a dying donor, a joiner mid all-reduce, runs in-process against the fake swarm: tests/sim/test_faults.py;
a kill mid all-reduce at the averager level: tests/swarm/test_averager.py.)"""

import signal
import time

import pytest

from p2p_diloco.metrics.events import Event
from tests.conftest import survivors
from tests.swarm.helpers import FAULT, Proc, events_of, load_json, wait_for_event

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300)]


def test_sigterm_mid_allreduce_stops_cleanly_and_others_carry_on(tmp_path, reap):
    """Three peers; the third, whose parts trickle, gets SIGTERM while its round-1 all-reduce runs. It stops within
    seconds with exit code 0 and leaves no process behind; the other two redo the round as a pair and finish with
    one digest, and never step alone."""
    common = ["--run-id", "t-term", "--max-rounds", "2", "--log-dir", str(tmp_path), "--set", "swarm.min_peers=3",
              *FAULT]
    first = Proc(["join", *common, "--summary-json", str(tmp_path / "p0.json")], reap)
    maddrs = first.wait_joined()
    second = Proc(["join", "--initial-peers", *maddrs, *common, "--summary-json", str(tmp_path / "p1.json")], reap)
    victim = Proc(["--part-delay", "0.2", "join", "--initial-peers", *maddrs, *common, "--summary-json",
                   str(tmp_path / "p2.json")], reap, module="tests.swarm.faulty_peer")
    procs = [first, second, victim]
    for p in procs:
        p.wait_joined()
    wait_for_event(tmp_path / victim.peer_id / "events.jsonl",
                   lambda e: e["event"] == Event.ALLREDUCE_RUNNING and e["round"] == 1, 240, victim)
    t0 = time.monotonic()
    victim.signal(signal.SIGTERM)
    assert victim.wait(30) == 143, victim.stderr_tail()  # 128 + SIGTERM, after a clean stop
    assert time.monotonic() - t0 < 20
    assert load_json(tmp_path / "p2.json")["stopped_early"] is True
    for p in procs[:2]:
        assert p.wait(240) == 0, p.stderr_tail()
    sums = [load_json(tmp_path / f"p{i}.json") for i in range(2)]
    assert len({s["global_digest"] for s in sums}) == 1
    assert all(s["rounds_completed"] == 2 for s in sums)
    for p in procs[:2]:
        assert not [e for e in events_of(tmp_path, p) if e["event"] == Event.ALLREDUCE_DONE and e.get("lone")]
    assert not survivors(reap)
