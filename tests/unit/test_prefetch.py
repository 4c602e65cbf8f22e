"""Issue 22: the next batches made in a background thread (training/prefetch.py) change nothing about the data."""

import pytest
import torch

from p2p_diloco.config import ConfigError, DataConfig, TokenizerConfig
from p2p_diloco.training.data import PackedStream
from p2p_diloco.training.prefetch import Prefetcher
from p2p_diloco.training.tokenizer import build_tokenizer

pytestmark = pytest.mark.unit


def _stream(seed=3):
    cfg = DataConfig(max_bytes=200_000, seq_len=32, batch_size=2)
    return PackedStream(build_tokenizer(TokenizerConfig("byte")), cfg, seed)


def test_the_batches_and_the_cursor_are_the_streams():
    """The same batches in the same order as the stream itself, and after each one the cursor a plain stream has
    after as many batches (not the cursor of the batches made ahead)."""
    plain, ahead = _stream(), Prefetcher(_stream(), depth=3)
    try:
        for _ in range(40):
            assert torch.equal(ahead.next_batch(), plain.next_batch())
            assert ahead.state_dict() == plain.state_dict()
        assert ahead.tokens_per_batch == plain.tokens_per_batch
    finally:
        ahead.close()
        plain.close()


def test_resuming_from_its_cursor_continues_exactly():
    """A checkpoint's cursor, loaded into a fresh prefetching stream (or into this one, mid-way: the batches it
    made ahead are dropped), gives the batches that came next."""
    ahead = Prefetcher(_stream(), depth=2)
    try:
        for _ in range(7):
            ahead.next_batch()
        cursor = ahead.state_dict()
        expected = [ahead.next_batch() for _ in range(5)]
        resumed = Prefetcher(_stream(), depth=2)
        resumed.load_state_dict(cursor)
        assert all(torch.equal(resumed.next_batch(), e) for e in expected)
        resumed.close()
        ahead.load_state_dict(cursor)
        assert all(torch.equal(ahead.next_batch(), e) for e in expected)
    finally:
        ahead.close()


class _Failing:
    """A stream whose third batch fails, as a dataset that cannot be read would."""

    tokens_per_batch = 4

    def __init__(self):
        self.made = 0

    def next_batch(self):
        self.made += 1
        if self.made == 3:
            raise ConfigError("no training documents in /nowhere")
        return torch.full((1, 4), self.made)

    def state_dict(self):
        return {"made": self.made}

    def load_state_dict(self, state):
        self.made = state["made"]

    def close(self):
        pass


def test_the_streams_error_is_raised_in_order_and_again():
    ahead = Prefetcher(_Failing(), depth=2)
    assert ahead.next_batch().flatten().tolist() == [1] * 4
    assert ahead.next_batch().flatten().tolist() == [2] * 4
    for _ in range(2):  # not a hang on the second call: the error again
        with pytest.raises(ConfigError, match="no training documents"):
            ahead.next_batch()
    assert ahead.state_dict() == {"made": 2}
    ahead.close()


def test_close_stops_the_worker():
    ahead = Prefetcher(_stream(), depth=2)
    ahead.next_batch()
    worker = ahead._thread
    assert worker.is_alive()
    ahead.close()
    assert not worker.is_alive()


class _Stuck(_Failing):
    """A stream whose second read never returns (a streaming dataset that hangs)."""

    def __init__(self, release):
        super().__init__()
        self.release = release

    def next_batch(self):
        if self.made >= 1:
            self.release.wait()
        return super().next_batch()


def test_a_worker_stuck_in_the_stream_fails_a_resume_instead_of_waiting_for_ever(monkeypatch):
    import threading

    from p2p_diloco.training import prefetch

    monkeypatch.setattr(prefetch, "HALT_TIMEOUT", 0.3)
    release = threading.Event()
    ahead = Prefetcher(_Stuck(release), depth=1)
    try:
        ahead.next_batch()
        with pytest.raises(RuntimeError, match="did not stop within"):
            ahead.load_state_dict({"made": 0})
        ahead.close()  # (says so, does not raise)
    finally:
        release.set()
