"""Warnings shown once and counted (uform/notices.py)."""

import warnings

import pytest

import uform as u
from uform.notices import Notices


def _shown(calls):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answers = [call() for call in calls]
    return answers, [str(w.message) for w in caught]


def test_a_kind_is_shown_once_and_every_occurrence_counted():
    notices = Notices()
    answers, shown = _shown([lambda i=i: notices.warn("media", f"item {i}", u.MediaWarning) for i in range(5)])
    assert answers == [True, False, False, False, False]
    assert shown == ["item 0"]
    assert notices.count("media") == 5
    assert notices.counts() == {"media": 5}


def test_kinds_are_independent_and_count_can_be_many():
    notices = Notices()
    _, shown = _shown([lambda: notices.warn("a", "first a", count=3), lambda: notices.warn("b", "first b")])
    assert shown == ["first a", "first b"]
    assert notices.counts() == {"a": 3, "b": 1}


def test_a_level_is_shown_again_once_it_doubles():
    notices = Notices()
    levels = [0.1, 0.15, 0.19, 0.2, 0.3, 0.41, 0.5]
    answers, shown = _shown([lambda x=x: notices.warn("capacity", f"{x}", level=x) for x in levels])
    assert shown == ["0.1", "0.2", "0.41"]
    assert answers == [True, False, False, True, False, True, False]


def test_negative_count_is_refused_and_changes_nothing():
    notices = Notices()
    with pytest.raises(ValueError, match="count"):
        notices.warn("media", "x", count=-1)
    assert notices.counts() == {}


def test_every_category_is_a_uform_warning():
    for category in (u.MediaWarning, u.NonFiniteWarning, u.CapacityWarning, u.ScheduleWarning):
        assert issubclass(category, u.UformWarning)
        assert issubclass(category, UserWarning)


def test_a_relaying_owner_holds_back_and_the_replay_shows_once():
    """A fleet worker's trainer relays: nothing shown there, every warn counted and drained in order; the
    calling process's replay shows each kind once (levels as if warned there)."""
    worker, caller = Notices(relay=True), Notices()
    answers, shown = _shown([lambda i=i: worker.warn("media", f"item {i}", u.MediaWarning, count=2) for i in range(3)])
    assert answers == [False, False, False] and shown == []
    assert worker.counts() == {"media": 6}
    worker.warn("capacity", "0.1", u.CapacityWarning, level=0.1)
    worker.warn("capacity", "0.3", u.CapacityWarning, level=0.3)
    held = worker.drain()
    assert [n.message for n in held] == ["item 0", "item 1", "item 2", "0.1", "0.3"] and worker.drain() == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        caller.replay(held)
    assert [(w.category, str(w.message)) for w in caught] == [
        (u.MediaWarning, "item 0"),
        (u.CapacityWarning, "0.1"),
        (u.CapacityWarning, "0.3"),
    ]
    assert caller.counts() == {"media": 6, "capacity": 2}
