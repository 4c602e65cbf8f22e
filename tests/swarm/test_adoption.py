"""The printed join line is enough to join (issue 19, point 2): a joiner given only ``--initial-peers`` and
``--run-id`` adopts the config the run was started with; one that sets a shared setting differently is refused."""

import time

import pytest

from tests.conftest import survivors
from tests.swarm.helpers import Proc, load_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300)]

# Nothing here is a default: another model size, H and outer lr, a short run that waits for its second peer, and
# the fast test settings (tests/swarm/helpers.py FAST) a bare joiner can only have by adopting them.
RUN_TOML = """
[run]
max_rounds = 2
[model]
num_layers = 1
hidden_size = 64
num_heads = 2
num_kv_heads = 2
intermediate_size = 160
[train]
inner_steps = 6
threads = 1
[outer]
lr = 0.5
[eval]
batches = 2
[data]
max_bytes = 1500000
[swarm]
min_peers = 2
matchmaking_time = 5.0
request_timeout = 2.0
"""


def test_a_bare_joiner_adopts_the_runs_config_and_a_differing_one_is_refused(tmp_path, reap):
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(RUN_TOML)
    logs, run = str(tmp_path / "logs"), ["--run-id", "t-adopt"]
    first = Proc(["join", "--config", str(run_toml), *run, "--log-dir", logs,
                  "--summary-json", str(tmp_path / "p0.json")], reap)
    maddrs = first.wait_joined()
    t0 = time.monotonic()
    refused = Proc(["join", "--initial-peers", *maddrs, *run, "--set", "train.inner_steps=9"], reap)
    assert refused.wait(60) == 2, refused.stderr_tail()
    assert time.monotonic() - t0 < 30  # refused before it builds anything
    err = [line for line in refused.err_lines if line.strip()]
    assert len(err) == 1 and "train.inner_steps: ours 9, theirs 6" in err[0], err
    joiner = Proc(["join", "--initial-peers", *maddrs, *run, "--log-dir", logs,
                   "--summary-json", str(tmp_path / "p1.json")], reap)
    for p in (first, joiner):
        assert p.wait(240) == 0, p.stderr_tail()
    ours, theirs = load_json(tmp_path / "p0.json"), load_json(tmp_path / "p1.json")
    assert ours["rounds_completed"] == theirs["rounds_completed"] == 2  # run.max_rounds adopted too
    assert theirs["rounds_participated"] == 2
    assert ours["global_digest"] == theirs["global_digest"] != ""
    assert "adopted the config published by 1 live peer" in joiner.stderr_tail(200)
    assert not survivors(reap)
