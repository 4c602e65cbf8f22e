"""Issue 22, memory: what a peer no longer holds twice (docs/scale.md, "Where the bytes per parameter went").

- the outer step is prepared without a second outer state and committed in place, with the same bits;
- a forked child (hivemind's DHT and averager processes) drops the pages of the weights and the outer state;
- a checkpoint writes whole tensors as they are instead of cloning them;
- the averager's host answers a repair's request for its input (the data plane averages in place).
"""

import asyncio
import os

import pytest
import torch

from p2p_diloco.checkpoint import _saveable
from p2p_diloco.outer import optimizer as opt
from p2p_diloco.outer.fragment_state import FragmentState
from p2p_diloco.outer.state import WholeState
from p2p_diloco.protocol.certificate import Certificate, Statement
from p2p_diloco.runtime import forks
from p2p_diloco.swarm.source_channel import SourceChannel

pytestmark = pytest.mark.unit


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 32, generator=g), torch.randn(32, generator=g), torch.randn(16, 8, generator=g)]


def _average(like, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g) * 1e-2 for t in like]


def _certificate(state, after: str) -> Certificate:
    statement = Statement(run_id="r", fingerprint="fp", round=state.round, members=("a",), weights=(1.0,),
                          before=state.digest, after=after, prev="")
    return Certificate(statement, {})


@pytest.mark.parametrize("nesterov, momentum", [(True, 0.9), (False, 0.9), (True, 0.0)])
def test_a_prepared_step_commits_in_place_to_the_bits_it_hashed(nesterov, momentum):
    """Three rounds: each commit holds exactly what the step on copies of theta and momentum gives (the arithmetic
    before this change), its digest is the one prepare returned, and no second outer state is kept."""
    state = WholeState(_params(), 0.7, momentum, nesterov, "fp")
    theta, mom = [t.clone() for t in state.theta], [m.clone() for m in state.optimizer.momentum_buffers]
    for r in range(3):
        average = _average(theta, r)
        after = state.prepare(average)
        assert all(torch.equal(a, b) for a, b in zip(state.theta + state.optimizer.momentum_buffers, theta + mom))
        state.optimizer.step_on(theta, mom, average)  # the reference, on our own copies
        assert after == opt.digest(theta + mom)
        state.commit(_certificate(state, after))
        assert all(torch.equal(a, b) for a, b in zip(state.theta + state.optimizer.momentum_buffers, theta + mom))
        assert state.digest == after == opt.digest(state.optimizer.state_tensors()) and state.round == r + 1
        assert len(state.held_tensors()) == 2 * len(theta)


def test_prepare_leaves_the_state_and_a_wrong_commit_changes_nothing():
    state = WholeState(_params(), 0.7, 0.9, True, "fp")
    before = [t.clone() for t in state.optimizer.state_tensors()]
    digest = state.digest
    after = state.prepare(_average(state.theta, 1))
    assert all(torch.equal(a, b) for a, b in zip(state.optimizer.state_tensors(), before))
    with pytest.raises(RuntimeError, match="another step"):
        state.commit(_certificate(state, "0" * 64))
    state.discard()
    with pytest.raises(RuntimeError, match="without prepare"):
        state.commit(_certificate(state, after))
    assert state.digest == digest and state.round == 0
    assert all(torch.equal(a, b) for a, b in zip(state.optimizer.state_tensors(), before))


def test_a_state_changed_between_prepare_and_commit_is_refused():
    """A caller's bug (a download landing between a round's prepare and its commit) must not step the new state
    with the old round's average under the old round's digest."""
    state = WholeState(_params(), 0.7, 0.9, True, "fp")
    after = state.prepare(_average(state.theta, 1))
    state.digest = "f" * 64  # what fetch/restore do, with new tensors
    with pytest.raises(RuntimeError, match="changed between"):
        state.commit(_certificate(state, after))
    assert state.round == 0


def test_a_fragment_round_hashes_only_its_fragment(monkeypatch):
    """outer.fragments: the other fragments' hashes are kept from the last commit (the digest is a hash of the
    tensors' hashes), so a round hashes 1/F of the state, not all of it."""
    params = [torch.randn(16), torch.randn(4, 4), torch.randn(8), torch.randn(2, 4)]
    state = FragmentState(params, 0.7, 0.9, True, "fp", 2, 0.5)
    hashed = []
    real = opt.tensor_hash
    monkeypatch.setattr(opt, "tensor_hash", lambda t: hashed.append(t.numel()) or real(t))
    for r in range(3):
        buffer = [torch.randn(state.size)]
        run = state.runs[state.fragment()]
        hashed.clear()
        after = state.prepare(buffer)
        state.commit(_certificate(state, after))
        fragment = 2 * sum(params[i].numel() for i in run)  # its theta and momentum
        assert sum(hashed) == (fragment if r > 0 else 2 * sum(p.numel() for p in params)), r
        assert state.digest == opt.digest(state.optimizer.state_tensors())


def test_whole_pages():
    page = forks.PAGE
    assert forks.whole_pages(0, page) == (0, page)
    assert forks.whole_pages(1, page) == (page, 0)
    assert forks.whole_pages(10, 3 * page) == (page, 2 * page)  # [10, 3 * page + 10)
    assert forks.whole_pages(page, 2 * page + 5) == (page, 2 * page)  # [page, 3 * page + 5)


def test_a_forked_child_drops_the_pages_of_the_tensors_kept_out():
    """The child reads zeros where a kept-out tensor's whole pages were (dropped, not copied); every other tensor,
    a kept-out tensor's partial pages and shared memory are intact, in the child and in the parent."""
    kept = torch.full((1 << 20,), 7.0)
    other = torch.full((1 << 20,), 3.0)
    shared = torch.full((1 << 20,), 5.0).share_memory_()
    forks.keep_out_of_children([kept, shared])
    mid = kept.numel() // 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: single-element reads only (no thread pools after a fork)
        ok = (kept[mid].item() == 0.0 and other[mid].item() == 3.0 and shared[mid].item() == 5.0
              and forks.dropped_bytes() >= kept.numel() * 4 - 2 * forks.PAGE)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert kept[mid].item() == 7.0 and bool((kept == 7.0).all())


def test_a_checkpoint_writes_whole_tensors_as_they_are_and_compacts_views():
    whole, base = torch.randn(100), torch.randn(10, 10)
    view = base[2]
    out = _saveable({"a": whole, "b": [view], "c": 3})
    assert out["a"].data_ptr() == whole.data_ptr()  # no clone: 20 bytes per parameter at every checkpoint
    assert out["b"][0].data_ptr() != base.data_ptr() and out["b"][0].untyped_storage().nbytes() == 40
    assert torch.equal(out["b"][0], view) and out["c"] == 3


def _averager_side(channel, requests, results):
    """The averager process's side (a forked child, as hivemind's averager is)."""
    async def main():
        while (request := requests.get()) is not None:
            start, stop = request
            try:
                results.put(("ok", (await channel.read(start, stop, timeout=10)).tolist()))
            except Exception as e:
                results.put(("error", str(e)))

    asyncio.run(main())


def test_the_host_answers_its_averagers_request_for_the_input():
    """The averager asks its host for values of the attempt's input (a repair: source_channel.py): none while
    there is no attempt, the values while there is one, a range outside it refused."""
    import multiprocessing as mp

    a, b = torch.arange(10.0), torch.arange(10.0, 16.0)
    ctx = mp.get_context("fork")
    channel, requests, results = SourceChannel(), ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_averager_side, args=(channel, requests, results), daemon=True)
    child.start()
    channel.serve()

    def ask(start, stop):
        requests.put((start, stop))
        return results.get(timeout=20)

    try:
        assert ask(0, 4) == ("error", "no all-reduce input on the host")
        channel.set_inputs([a, b])
        assert ask(8, 12) == ("ok", [8.0, 9.0, 10.0, 11.0])
        assert ask(8, 17) == ("error", "values 8:17 of an input of 16")
        channel.set_inputs(None)
        assert ask(0, 4) == ("error", "no all-reduce input on the host")
    finally:
        requests.put(None)
        channel.close()
        child.join(10)
        if child.is_alive():
            child.kill()
