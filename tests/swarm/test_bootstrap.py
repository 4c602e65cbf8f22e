"""``p2p-diloco bootstrap``: a DHT-only node with a stable peer id that peers join through; ``--identity-path``."""

import signal

import pytest

from tests.swarm.helpers import FAULT, Proc, events_of, load_json

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


def _bootstrap(tag, identity):
    proc = Proc(["bootstrap", *LOCAL, "--identity-path", str(identity)], tag)
    proc.wait_joined(60)  # its join line: `p2p-diloco join --initial-peers <maddrs>` (no run id)
    return proc


def test_peers_join_through_a_bootstrap_node_that_keeps_its_id(tmp_path, reap):
    identity = tmp_path / "boot.key"
    boot = _bootstrap(reap, identity)
    boot_id = boot.peer_id
    peers = [Proc(["join", "--initial-peers", *boot.join_maddrs, *LOCAL, "--run-id", "t-boot", "--max-rounds", "2",
                   "--log-dir", str(tmp_path), "--summary-json", str(tmp_path / f"p{i}.json"),
                   "--set", "swarm.min_peers=2", *FAULT], reap) for i in range(2)]
    for p in peers:
        assert p.wait(180) == 0, p.stderr_tail()
    summaries = [load_json(tmp_path / f"p{i}.json") for i in range(2)]
    assert len({s["global_digest"] for s in summaries}) == 1
    for p in peers:
        groups = [e["group_size"] for e in events_of(tmp_path, p) if e["event"] == "allreduce_done"]
        assert groups == [2, 2], groups
    boot.signal(signal.SIGTERM)
    assert boot.wait(30) == 0, boot.stderr_tail()
    again = _bootstrap(reap, identity)  # same identity file: same peer id
    try:
        assert again.peer_id == boot_id
    finally:
        again.signal(signal.SIGTERM)
        assert again.wait(30) == 0, again.stderr_tail()


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
