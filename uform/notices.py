"""Warnings shown once and counted: the library's rule that a repeated condition (a broken media item, a
skipped non-finite step, items lost for room) reaches the user as one readable warning, not one per item,
while every occurrence is still counted where a program can read it.

A `Notices` belongs to one owner (a trainer, a served model); its kinds are short strings ("media",
"non-finite", "capacity", ...). `warn` shows a kind the first time and, when given a `level` (a share of
the work lost, say), again each time that level has at least doubled since it was last shown. This module
imports nothing of uform, so every layer may use it.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass


class UformWarning(UserWarning):
    """The base of every warning uform shows."""


class MediaWarning(UformWarning):
    """Media items were skipped: they could not be decoded or broke a limit."""


class NonFiniteWarning(UformWarning):
    """A step's loss or gradients were not finite somewhere in the world, so its update was skipped."""


class CapacityWarning(UformWarning):
    """Items were dropped or cut for lack of room in a batch."""


class ScheduleWarning(UformWarning):
    """A step ran past the schedule's last step."""


class CheckpointWarning(UformWarning):
    """A file in a run's checkpoints folder was passed over: torn, corrupt or not a uform checkpoint."""


class MemoryWarning(UformWarning):
    """A run's estimated memory exceeds what the machine has available (`uform.replica.memory`)."""


class Notices:
    """One owner's warnings: each kind shown once (or again when its level doubles), every occurrence
    counted. Thread-safe: a trainer's completion thread and its caller may both warn."""

    def __init__(self, *, relay: bool = False) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._shown: dict[str, float] = {}
        self.relay = relay
        """True holds every `warn` back, counted, for `drain` (an owner in a worker process, whose user sits
        in another: the calling process replays them through its own `Notices`, so each shows once there)."""
        self._held: list[Notice] = []

    def warn(
        self,
        kind: str,
        message: str,
        category: type[Warning] = UformWarning,
        *,
        count: int = 1,
        level: float | None = None,
        stacklevel: int = 2,
    ) -> bool:
        """Counts `count` occurrences of `kind` and shows `message` if this is the kind's first, or if
        `level` is at least twice the level it was last shown at; answers whether it was shown."""
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + count
            if self.relay:
                self._held.append(Notice(kind, message, category, count, level))
                return False
            last = self._shown.get(kind)
            now = 0.0 if level is None else float(level)
            show = last is None or (level is not None and now > 0.0 and now >= 2.0 * last)
            if show:
                self._shown[kind] = now
        if show:
            warnings.warn(message, category, stacklevel=stacklevel + 1)
        return show

    def count(self, kind: str) -> int:
        """Occurrences of `kind` counted so far."""
        with self._lock:
            return self._counts.get(kind, 0)

    def counts(self) -> dict[str, int]:
        """Every kind's count so far (a copy)."""
        with self._lock:
            return dict(self._counts)

    def drain(self) -> list[Notice]:
        """The warnings a relaying owner held back since the last drain, in order (they pickle)."""
        with self._lock:
            held, self._held = self._held, []
        return held

    def replay(self, notices: list[Notice], stacklevel: int = 2) -> None:
        """`warn`s what another owner's `drain` answered, as if it had happened here."""
        for n in notices:
            self.warn(n.kind, n.message, n.category, count=n.count, level=n.level, stacklevel=stacklevel + 1)


@dataclass(frozen=True)
class Notice:
    """One `warn` a relaying `Notices` held back."""

    kind: str
    message: str
    category: type[Warning]
    count: int
    level: float | None
