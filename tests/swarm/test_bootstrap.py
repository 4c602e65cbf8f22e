"""``p2p-diloco bootstrap``: a DHT-only node with a stable peer id that peers join through; ``--identity-path``;
``p2p-diloco status`` reading the peers' signed records through it."""

import json
import signal
import time

import pytest

from p2p_diloco.metrics.events import Event
from tests.swarm.helpers import FAULT, Proc, events_of, load_json

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
ROUNDS = 4


def _bootstrap(tag, identity):
    proc = Proc(["bootstrap", *LOCAL, "--identity-path", str(identity)], tag)
    proc.wait_joined(60)  # its join line: `p2p-diloco join --initial-peers <maddrs>` (no run id)
    return proc


def _view_of_both_peers_past_round_1(status: Proc, ids: set[str], timeout: float) -> dict:
    """The first view a ``status --json --watch`` printed in which exactly ``ids`` are live and past round 1."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(status.lines):
            view = json.loads(line)
            live = {p["peer_id"]: p for p in view["peers"]}
            if set(live) == ids and all(p["round"] >= 1 and p["last_sync"] is not None for p in live.values()):
                return view
        assert status.poll() is None, status.stderr_tail()
        time.sleep(0.2)
    raise AssertionError(f"no view with both peers past round 1 in {timeout} s: {status.lines[-3:]}")


@pytest.mark.slow
def test_peers_join_through_a_bootstrap_node_that_keeps_its_id(tmp_path, reap):
    identity = tmp_path / "boot.key"
    boot = _bootstrap(reap, identity)
    boot_id = boot.peer_id
    twin = Proc(["bootstrap", *LOCAL, "--identity-path", str(identity), "--initial-peers", *boot.join_maddrs], reap)
    assert twin.wait(60) == 2  # the same identity while it is live: refused
    err = [line for line in twin.err_lines if line.strip()]
    assert len(err) == 1 and "is already taken by another peer" in err[0], err
    sinks = [["jsonl", "tensorboard"], ["jsonl", "wandb"]]  # every sink, in a real run
    peers = [Proc(["join", "--initial-peers", *boot.join_maddrs, *LOCAL, "--run-id", "t-boot", "--max-rounds",
                   str(ROUNDS), "--log-dir", str(tmp_path), "--summary-json", str(tmp_path / f"p{i}.json"),
                   "--set", "swarm.min_peers=2", "--metrics", *sinks[i], *FAULT], reap) for i in range(2)]
    for p in peers:
        p.wait_joined()
    ids = {p.peer_id for p in peers}
    # `p2p-diloco status` through the bootstrap node, while the peers train: started at once and refreshing, so
    # that its own start-up (seconds on a loaded machine) cannot outlast their few rounds
    status = Proc(["status", "--initial-peers", *boot.join_maddrs, "--run-id", "t-boot", "--json", "--watch",
                   "0.5"], reap)
    view = _view_of_both_peers_past_round_1(status, ids, timeout=120)
    status.signal(signal.SIGINT)
    assert status.wait(30) == 130, status.stderr_tail()  # 128 + SIGINT: stopped by a signal
    for p in view["peers"]:
        assert p["round"] >= 1 and p["digest"] and p["digest_agrees"] is True and p["client_mode"] is False, p
        assert p["last_sync"] is not None and p["tokens_per_s"] and p["tokens_per_s"] > 0, p
    assert view["all_digests_agree"] is True
    for p in peers:
        assert p.wait(180) == 0, p.stderr_tail()
    summaries = [load_json(tmp_path / f"p{i}.json") for i in range(2)]
    assert len({s["global_digest"] for s in summaries}) == 1
    for p in peers:
        groups = [e["group_size"] for e in events_of(tmp_path, p) if e["event"] == Event.ALLREDUCE_DONE]
        assert groups == [2] * ROUNDS, groups
    assert list((tmp_path / peers[0].peer_id / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / peers[1].peer_id / "wandb").glob("offline-run-*/*.wandb"))
    # --watch refreshes until SIGINT (the peers are gone by now: an empty table each time)
    watch = Proc(["status", "--initial-peers", *boot.join_maddrs, "--run-id", "t-boot", "--watch", "0.5"], reap)
    deadline = time.monotonic() + 60
    while sum("live peer(s)" in line for line in watch.lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    watch.signal(signal.SIGINT)
    assert watch.wait(30) == 130, watch.stderr_tail()
    assert sum("run t-boot: 0 live peer(s)" in line for line in watch.lines) >= 2, watch.lines
    boot.signal(signal.SIGTERM)
    assert boot.wait(30) == 143, boot.stderr_tail()  # 128 + SIGTERM
    again = _bootstrap(reap, identity)  # same identity file: same peer id
    try:
        assert again.peer_id == boot_id
    finally:
        again.signal(signal.SIGTERM)
        assert again.wait(30) == 143, again.stderr_tail()


@pytest.mark.parametrize("args,message", [
    (["--identity-path", "{tmp}/junk.key"], "is not an RSA libp2p identity"),
    (["--identity-path", "{tmp}/no/such/dir/id.key"], "cannot create identity file"),
    (["--host-maddrs", "/ip4/127.0.0.1/tcpx/0"], "invalid multiaddr"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1"], "must end with /p2p/<peer id>"),
    (["--startup-timeout", "0"], "--startup-timeout must be > 0"),
])
def test_bad_bootstrap_input_is_one_clear_error(tmp_path, reap, args, message):
    (tmp_path / "junk.key").write_bytes(b"not a key")
    proc = Proc(["bootstrap", *LOCAL, *[a.format(tmp=tmp_path) for a in args]], reap)
    assert proc.wait(60) == 2
    err = [line for line in proc.err_lines if line.strip()]
    assert len(err) == 1 and message in err[0], err
