"""A replica's step counts (`uform.replica.ledger.StepLedger`) on their own: the device's deferred skips are
counted in step order and only as far as asked, each after the caller's wait for that step; each skip is reported
once; a skip warns once and is counted every time."""

from __future__ import annotations

import warnings

import torch

from uform.notices import NonFiniteWarning, Notices
from uform.replica.ledger import StepLedger


def test_deferred_skips_resolve_in_order_up_to_the_step_asked() -> None:
    ledger = StepLedger(Notices())
    waited: list[tuple[int, object]] = []
    for step, flag in ((1, 0.0), (2, 1.0), (3, 0.0)):
        ledger.defer(step, torch.tensor(flag), f"event {step}")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ledger.resolve(2, lambda step, event: waited.append((step, event)))
        assert waited == [(1, "event 1"), (2, "event 2")]
        assert (ledger.applied, ledger.nonfinite) == (1, 1)
        ledger.resolve(None, lambda step, event: waited.append((step, event)))
    assert waited[-1] == (3, "event 3") and len(waited) == 3
    assert (ledger.applied, ledger.nonfinite) == (2, 1)


def test_each_skip_is_reported_once_within_its_range() -> None:
    ledger = StepLedger(Notices())
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in (2, 5):
            ledger.record(step, True, 1e-3)
    assert ledger.reported(0, 4) == 1  # step 2
    assert ledger.reported(0, 4) == 0  # already reported
    assert ledger.reported(4, 5) == 1  # step 5


def test_a_skip_warns_once_and_every_skip_is_counted() -> None:
    notices = Notices()
    ledger = StepLedger(notices)
    ledger.restore(applied=7, nonfinite=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ledger.record(9, True, float("inf"))
        ledger.record(10, True, 1e-3)
        ledger.record(11, False, 1e-3)
    shown = [w for w in caught if issubclass(w.category, NonFiniteWarning)]
    assert len(shown) == 1 and "step 9" in str(shown[0].message) and "out of float32" in str(shown[0].message)
    assert notices.counts()["non-finite"] == 2
    assert (ledger.applied, ledger.nonfinite) == (8, 3)
