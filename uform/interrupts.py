"""SIGINT and SIGTERM while a run trains: the first asks it to stop at the next step boundary, the second stops it now.

    with Interrupts() as interrupts:
        while ... and interrupts.signal is None:
            take a step                   # a signal meanwhile only sets interrupts.signal
        save at this step boundary        # the run resumes from here exactly

A Ctrl-C (SIGINT) or a scheduler's preemption notice (SIGTERM, Slurm and Kubernetes alike) lets the step in flight
finish, since a step abandoned half way would leave workers mid-collective and nothing saved. A second signal
means "now": the handlers that were there before are put back and the signal is raised again, so it does what it
would have done without uform (SIGINT: `KeyboardInterrupt`; SIGTERM: the process ends), leaving the last whole
checkpoint (a save cut short never replaces it). The handlers live only inside the `with`, and only in the main
thread (Python delivers signals there alone; elsewhere this does nothing), and the earlier ones are restored on
the way out, so a library call leaves no handler behind.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

__all__ = ["Interrupts", "exit_status"]


def exit_status(signum: int) -> int:
    """The shell's status for a process a signal ended: 128 + its number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class Interrupts:
    """Catches `signals` while it is entered (main thread only); `signal` is the first one caught, else None."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = tuple(signals)
        self.signal: int | None = None
        """The first signal caught (`signal.SIGTERM`, ...), or None."""
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str | None:
        """The first signal's name ("SIGTERM"), or None."""
        return None if self.signal is None else signal.Signals(self.signal).name

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._caught)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _caught(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum
            return
        self._restore()  # the second: what would have happened without us, now
        signal.raise_signal(signum)

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
