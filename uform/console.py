"""What a run shows on its console while it runs: a progress bar on a terminal, a plain line every N steps elsewhere.

    step 25/60  loss 2.3141  lr 9.7e-04  items/s 412.5  eta 0:00:04

On a terminal (the stream's `isatty()`) the line is a tqdm bar redrawn in place, with the same figures and tqdm's
own ETA; a warning shown meanwhile is printed above the bar instead of through it. Anywhere else (a log file, a
scheduler's capture, a pipe) it is one line every `every` steps and at the call's last step, never a carriage
return, so a day-long run leaves a log of a few lines per hundred steps, not a megabyte of redraws.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, TextIO

from tqdm import tqdm

from .config import TrainerStepStats

__all__ = ["Console", "clock", "is_terminal"]


def is_terminal(stream: TextIO | None) -> bool:
    """Whether `stream` is an interactive terminal (a bar redraws there; anywhere else lines are appended)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


class Console:
    """One `fit` call's console, from step `first` to step `last` of a schedule of `steps`: `step` after each
    step, `note` for a line of its own, `close` at the end. A `stream` of None shows nothing."""

    def __init__(self, stream: TextIO | None, *, steps: int, first: int, last: int, every: int) -> None:
        self.stream = stream
        self.steps, self.first, self.last, self.every = steps, first, last, every
        self.bar: tqdm | None = None
        """The tqdm bar (a terminal only)."""
        self._started = time.perf_counter()
        self._warnings: Any = None
        if stream is not None and is_terminal(stream):
            self.bar = tqdm(
                total=last, initial=first - 1, file=stream, unit="step", dynamic_ncols=True, smoothing=0.1, leave=True
            )
            # A warning printed through the bar would leave half a bar per warning; tqdm.write prints above it.
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.showwarning = self._show_warning

    def step(self, step: int, stats: TrainerStepStats, *, items: int, seconds: float) -> None:
        """Shows step `step`: its loss, its learning rate, `items` over `seconds` as items/s, and the time left."""
        if self.stream is None:
            return
        rate = f"{items / seconds:.1f}" if seconds > 0 else "-"
        figures = f"loss {stats.loss:.4f}  lr {stats.learning_rate:.1e}  items/s {rate}"
        if self.bar is not None:
            self.bar.set_postfix_str(figures, refresh=False)
            self.bar.update(1)
            return
        if step % self.every == 0 or step >= self.last:
            done = step - self.first + 1
            spent = time.perf_counter() - self._started
            eta = clock(spent / done * (self.last - step)) if done > 0 else "-"
            self._line(f"step {step}/{self.steps}  {figures}  eta {eta}")

    def note(self, text: str) -> None:
        """A line of its own (a save, the run's summary), above the bar on a terminal."""
        if self.stream is None:
            return
        for line in text.rstrip("\n").split("\n"):
            if self.bar is not None:
                self.bar.write(line, file=self.stream)
            else:
                self._line(line)

    def close(self) -> None:
        """Ends the bar (left on screen at its last figures) and gives warnings back their own printer."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None

    def __enter__(self) -> Console:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self, text: str) -> None:
        assert self.stream is not None
        self.stream.write(text + "\n")
        self.stream.flush()

    def _show_warning(
        self, message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        tqdm.write(text, file=self.stream)


def clock(seconds: float) -> str:
    """`seconds` as `h:mm:ss`."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
