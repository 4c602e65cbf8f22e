"""topk's error feedback (outer/error_feedback.py): nothing a peer leaves out is lost, only delayed; the error
changes only when the round commits; it survives a checkpoint exactly; with fragments, each fragment keeps its own."""

import pytest
import torch

from p2p_diloco.checkpoint import CheckpointStore
from p2p_diloco.outer.codecs import CHUNK, get_codec
from p2p_diloco.outer.error_feedback import ErrorFeedback, FragmentFeedback
from tests.unit.test_checkpoint import FP, make_state

pytestmark = pytest.mark.unit
SHAPES = [(3, 4000), (2 * CHUNK + 5,), (7,)]


def _pseudo_gradient(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 1e-3 for s in SHAPES]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_sent_plus_the_new_error_is_the_pseudo_gradient_plus_the_old_error():
    feedback = ErrorFeedback(get_codec("topk"), _pseudo_gradient(0))
    previous = torch.randn(feedback.error.numel(), generator=torch.Generator().manual_seed(9)) * 1e-3
    feedback.load(previous)
    pg = _pseudo_gradient(1)
    kept = [t.clone() for t in pg]
    sent = feedback.compensate(pg)
    assert all(torch.equal(a, b) for a, b in zip(pg, kept))  # the buffer is left for a retry
    assert [t.shape for t in sent] == [t.shape for t in pg]
    assert torch.equal(get_codec("topk").round_trip(_flat(sent)), _flat(sent))  # what the members decode
    assert torch.equal(feedback.error, previous)  # nothing changes before the commit
    feedback.accept()
    # decode(encode(x + e)) + e' = x + e, up to the rounding of one fp32 subtraction
    torch.testing.assert_close(_flat(sent) + feedback.error, _flat(pg) + previous, rtol=0, atol=1e-9)


def test_over_rounds_only_the_current_error_is_missing_and_a_failed_round_changes_nothing():
    feedback = ErrorFeedback(get_codec("topk"), _pseudo_gradient(0))
    total_sent, total_pg = torch.zeros(feedback.error.numel()), torch.zeros(feedback.error.numel())
    for r in range(6):
        pg = _pseudo_gradient(10 + r)
        if r == 2:  # a round that did not commit: its pseudo-gradient was never applied, the error is as it was
            before = feedback.error.clone()
            feedback.compensate(pg)
            feedback.reject()
            assert torch.equal(feedback.error, before)
            continue
        total_sent += _flat(feedback.compensate(pg))
        total_pg += _flat(pg)
        feedback.accept()
    torch.testing.assert_close(total_sent + feedback.error, total_pg, rtol=0, atol=1e-8)
    assert (feedback.error != 0).any() and feedback.error.norm() < total_pg.norm()


def test_a_decayed_error_keeps_beta_times_the_old_error():
    # SparseLoCo's accumulator (outer.topk_error_decay): e' = beta * e + pseudo-gradient - sent
    feedback = ErrorFeedback(get_codec("topk"), _pseudo_gradient(0), decay=0.95)
    previous = torch.randn(feedback.error.numel(), generator=torch.Generator().manual_seed(9)) * 1e-3
    feedback.load(previous)
    pg = _pseudo_gradient(1)
    sent = feedback.compensate(pg)
    feedback.accept()
    torch.testing.assert_close(_flat(sent) + feedback.error, _flat(pg) + 0.95 * previous, rtol=0, atol=1e-9)


def test_the_error_survives_a_checkpoint_exactly(tmp_path):
    feedback = ErrorFeedback(get_codec("topk"), _pseudo_gradient(0))
    feedback.compensate(_pseudo_gradient(1))
    feedback.accept()
    state = make_state()
    state.extra["error_feedback"] = feedback.state()
    store = CheckpointStore(tmp_path)
    store.save(state)
    resumed = ErrorFeedback(get_codec("topk"), _pseudo_gradient(0))
    resumed.load(store.load(fingerprint=FP).extra["error_feedback"])
    assert torch.equal(resumed.error, feedback.error)
    pg = _pseudo_gradient(2)  # and the next round sends the same bits
    assert all(torch.equal(a, b) for a, b in zip(resumed.compensate(pg), feedback.compensate(pg)))


def test_an_error_of_another_model_is_refused():
    feedback = ErrorFeedback(get_codec("topk"), _pseudo_gradient(0))
    with pytest.raises(ValueError, match="error feedback"):
        feedback.load(torch.zeros(5))
    with pytest.raises(ValueError, match="error feedback"):
        feedback.load([1, 2])
    feedback.load(None)  # a checkpoint written before: zero
    assert not feedback.error.any()


def test_each_fragment_keeps_its_own_error_and_sends_it_in_its_next_round():
    # outer.fragments = 3: round r syncs fragment r mod 3 in the one flat buffer; what fragment p left out must come
    # back with fragment p's next round, never with another fragment's values
    like = [torch.zeros(2 * CHUNK)]
    current = [0]
    feedback = FragmentFeedback(get_codec("topk"), like, 1.0, 3, lambda: current[0])
    alone = [ErrorFeedback(get_codec("topk"), like) for _ in range(3)]  # what each fragment's error must be
    for r in range(7):
        current[0] = r % 3
        g = torch.Generator().manual_seed(r)
        pg = [torch.randn(2 * CHUNK, generator=g) * 1e-3]
        sent = feedback.compensate(pg)
        expected = alone[r % 3].compensate(pg)
        assert torch.equal(sent[0], expected[0])
        if r == 4:  # a round that did not commit changes no error
            feedback.reject()
            alone[r % 3].reject()
            continue
        feedback.accept()
        alone[r % 3].accept()
    assert all(torch.equal(row, part.error) for row, part in zip(feedback.state(), alone))
    assert len({tuple(row[:3].tolist()) for row in feedback.state()}) == 3  # three different errors


def test_fragment_errors_survive_a_checkpoint_and_another_layout_is_refused(tmp_path):
    like = [torch.zeros(CHUNK + 7)]
    feedback = FragmentFeedback(get_codec("topk"), like, 0.95, 2, lambda: 1)
    feedback.compensate([torch.randn(CHUNK + 7, generator=torch.Generator().manual_seed(3))])
    feedback.accept()
    state = make_state()
    state.extra["error_feedback"] = feedback.state()
    store = CheckpointStore(tmp_path)
    store.save(state)
    resumed = FragmentFeedback(get_codec("topk"), like, 0.95, 2, lambda: 1)
    resumed.load(store.load(fingerprint=FP).extra["error_feedback"])
    assert torch.equal(resumed.state(), feedback.state()) and resumed.state()[1].any() and not resumed.state()[0].any()
    with pytest.raises(ValueError, match="outer.fragments = 3"):
        FragmentFeedback(get_codec("topk"), like, 0.95, 3, lambda: 0).load(feedback.state())
    with pytest.raises(ValueError, match="error feedback"):
        resumed.load(torch.zeros(CHUNK + 7))  # a checkpoint of the same model without fragments
    resumed.load(None)
    assert not resumed.state().any()
