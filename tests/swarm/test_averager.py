"""ExactAverager against real hivemind DHTs in separate processes: exact averages, byte counts, and
all-or-nothing failure when a peer dies in the middle of an all-reduce."""

import multiprocessing as mp
import os

import psutil

import pytest
import torch

from p2p_diloco.outer import digest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
SHAPES = [(512, 1024), (333,)]


def _tensors(i):
    g = torch.Generator().manual_seed(i)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _peer(i, n, initial, queue, die_after_parts):
    import hivemind

    from p2p_diloco.swarm.averager import ExactAllReduceRunner, ExactAverager

    if die_after_parts is not None:  # simulate a crash in the middle of streaming our parts to the reducers
        original = ExactAllReduceRunner._generate_input_for_peer

        async def dying(self, peer_index):
            sent = 0
            async for msg in original(self, peer_index):
                if sent == die_after_parts:  # like kill -9 of the peer's whole process group
                    for child in psutil.Process().children(recursive=True):
                        child.kill()
                    os._exit(17)
                sent += 1
                yield msg

        ExactAllReduceRunner._generate_input_for_peer = dying
    dht = hivemind.DHT(initial_peers=initial, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if i == 0:
        queue.put(("maddrs", [str(m) for m in dht.get_visible_maddrs()]))
    av = ExactAverager(_tensors(i), dht, start=True, prefix="avgtest", min_matchmaking_time=5.0,
                       request_timeout=2.0, allreduce_timeout=30.0, next_chunk_timeout=3.0,
                       part_size_bytes=2**16)
    av.set_round_params("0110", n, timeout=10)
    try:
        result = av.step(weight=float(i + 1), timeout=30, allow_retries=False, gather={"i": i})
        with av.get_tensors() as ts:
            queue.put(("ok", i, digest(ts), [t.clone() for t in ts], result["group_size"], result["bytes_sent"],
                       result["bytes_received"]))
    except BaseException as e:
        queue.put(("failed", i, repr(e)[:200]))
    finally:
        av.shutdown()
        dht.shutdown()


def _run(n, victim=None):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(0, n, None, queue, None))]
    procs[0].start()
    try:
        kind, maddrs = queue.get(timeout=60)
        for i in range(1, n):
            p = ctx.Process(target=_peer, args=(i, n, maddrs, queue, 3 if i == victim else None))
            p.start()
            procs.append(p)
        results = [queue.get(timeout=120) for _ in range(n - (victim is not None))]
        for p in procs:
            p.join(30)
        return results
    finally:  # whatever happened, no peer process (or its DHT / p2pd) outlives the test
        leftovers = psutil.Process().children(recursive=True)
        for child in leftovers:
            child.kill()
        psutil.wait_procs(leftovers, timeout=10)


def test_exact_weighted_average_identical_on_every_peer():
    n = 3
    results = _run(n)
    assert all(r[0] == "ok" for r in results), results
    assert len({r[2] for r in results}) == 1, "peers ended with different bits"
    weights = [float(i + 1) for i in range(n)]
    expected = [sum(w * t for w, t in zip(weights, ts)) / sum(weights) for ts in zip(*(_tensors(i) for i in range(n)))]
    for got, want in zip(results[0][3], expected):
        assert torch.allclose(got, want, atol=1e-6)
    payload = sum(torch.Size(s).numel() for s in SHAPES) * 4
    for r in results:
        assert r[4] == n
        # butterfly all-reduce: each peer sends (and receives) ~(N-1)/N of the payload as a sender and again as a
        # reducer, so 2(N-1)/N overall; the exact share depends on how parts fall between reducers.
        total = r[5] + r[6]
        assert 0.5 * 2 * (n - 1) / n * payload < total < 1.5 * 2 * (n - 1) / n * payload, (total, payload)


def test_peer_death_mid_allreduce_applies_nothing():
    results = _run(3, victim=2)
    assert len(results) == 2
    assert all(r[0] == "failed" for r in results), [r[:3] for r in results]
