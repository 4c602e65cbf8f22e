"""The event catalogue (p2p_diloco/metrics/events.py): the README's list is rendered from it, and every event a
peer emits is in it, with its fields."""

from pathlib import Path

import pytest

from p2p_diloco.metrics.events import CATALOGUE, Event, check, render

pytestmark = pytest.mark.unit
README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_event_has_a_spec_and_the_readme_list_is_rendered_from_them():
    assert set(CATALOGUE) == set(Event)
    assert render() in README.read_text(), "README's event list is stale: python -m p2p_diloco.metrics.events"


def test_check_refuses_unknown_events_and_wrong_fields():
    assert check("outer_step", {"digest": "d", "inner_steps": 3, "certificate": "c", "signers": 2}) is None
    assert check("allreduce_done", {"group_size": 1, "bytes_sent": 0, "bytes_received": 0, "seconds": 0.0,
                                     "lone": True}) is None
    assert "unknown event" in check("outer_stepped", {})
    assert "missing ['certificate', 'inner_steps', 'signers']" in check("outer_step", {"digest": "d"})
    assert "unexpected ['extra']" in check("eval", {"loss": 1.0, "extra": 2})


def test_events_compare_equal_to_their_names_in_events_jsonl():
    assert Event.OUTER_STEP == "outer_step" and f"{Event.EVAL}" == "eval"
