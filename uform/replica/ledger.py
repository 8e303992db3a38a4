"""A replica's count of its steps: updates applied and steps skipped as non-finite, across resumes; the skips no
step's stats have reported yet; and, on CUDA, the steps whose skip only the device knows so far.

Where the fused AdamW reads the non-finite flag itself (CUDA), the host learns whether a step was skipped only once
the step's device work is done. Such a step waits here, in order, until something asks for the count (a step's
stats, `steps_taken`, a save, the weights) and `resolve` reads its flag.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..notices import NonFiniteWarning, Notices
from .optim import rate_overflows

__all__ = ["StepLedger"]


class StepLedger:
    """Applied and skipped steps, their reports and the skips still on the device. Thread-safe: the device thread
    records, the completion thread and callers resolve."""

    def __init__(self, notices: Notices) -> None:
        self.notices = notices
        self.applied = 0
        """Updates applied, across resumes (`steps_taken`); where the device decides a skip, as far as resolved."""
        self.nonfinite = 0
        """Steps skipped as non-finite, across resumes (as far as resolved)."""
        self._unreported: list[int] = []  # the numbers of skipped steps no step's stats have reported yet
        self._pending: deque[tuple[int, torch.Tensor, Any]] = deque()  # (step, host flag, event), oldest first
        self._counting = threading.Lock()
        self._resolving = threading.Lock()  # one reader of the pending flags at a time, so they count in order

    def restore(self, applied: int, nonfinite: int) -> None:
        """The counts a resumed run starts from (its checkpoint's)."""
        self.applied, self.nonfinite = applied, nonfinite

    def record(self, step: int, skipped: bool, rate: float) -> None:
        """Counts step `step` as applied or skipped (and warns, once, of a skip)."""
        with self._counting:
            if skipped:
                self.nonfinite += 1
                self._unreported.append(step)
            else:
                self.applied += 1
        if not skipped:
            return
        if rate_overflows(rate):
            why = f"its learning rate {rate:g} would carry AdamW's update out of float32"
        else:
            why = "its loss or gradients were not finite somewhere in the world"
        self.notices.warn(
            "non-finite",
            f"uform: step {step} was skipped on every process: {why}. The weights, the optimizer's moments and "
            "steps_taken are as before it; every such step is counted in TrainerStepStats.nonfinite (this "
            "warning is shown once). Look for a huge loss weight, relation weight, inverse temperature or "
            "learning rate.",
            NonFiniteWarning,
        )

    def defer(self, step: int, flag: torch.Tensor, event: Any) -> None:
        """Step `step`'s skip is the device's `flag` (a host copy that lands when `event` completes)."""
        with self._counting:
            self._pending.append((step, flag, event))

    def resolve(self, upto: int | None, wait: Callable[[int, Any], None]) -> None:
        """Counts the deferred steps up to `upto` (None: every one), in order, each after `wait(step, event)`
        returns (the caller's wait for that step's device work)."""
        with self._resolving:
            while True:
                with self._counting:
                    if not self._pending or (upto is not None and self._pending[0][0] > upto):
                        return
                    step, flag, event = self._pending.popleft()
                wait(step, event)
                self.record(step, bool(flag.item()), 0.0)

    def reported(self, since: int, step: int) -> int:
        """The skipped steps in (since, step], taken off the list (each is reported once)."""
        with self._counting:
            mine = [s for s in self._unreported if since < s <= step]
            self._unreported = [s for s in self._unreported if not since < s <= step]
        return len(mine)
