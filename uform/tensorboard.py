"""A run's scalars for TensorBoard, in `DIR/tensorboard` (the optional extra `uform[tensorboard]`).

The same figures `metrics.jsonl` holds, each a scalar curve against the step: a step's stats as `train/<field>`
(`train/loss`, `train/learning_rate`, `train/items_per_second`, ...), the warnings counted so far as
`warned/<kind>`, an evaluation's results under their own names (`eval/text->image/recall@10`). Written through
`torch.utils.tensorboard.SummaryWriter`; a resumed run purges the curves past the step it resumes after, as
`metrics.jsonl` drops those records. `tensorboard --logdir runs/` draws every run of a folder side by side.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["BOARD_NAME", "TensorBoard", "available"]

BOARD_NAME = "tensorboard"
"""The run folder's subfolder the event files go to."""


def available() -> bool:
    """Whether the `tensorboard` package (which `torch.utils.tensorboard` needs) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoard:
    """The event files of one run's folder; `scalars(step, values)` adds each finite number of `values`."""

    def __init__(self, run_folder: str | os.PathLike, *, resumed_at: int | None = None) -> None:
        if not available():
            raise ValueError(
                "log.tensorboard: true, but the tensorboard package is missing (pip install 'uform[tensorboard]')"
            )
        from torch.utils.tensorboard import SummaryWriter

        self.path = os.path.join(os.fspath(run_folder), BOARD_NAME)
        """The event files' folder."""
        purge = None if resumed_at is None else resumed_at + 1
        self._writer: Any = SummaryWriter(log_dir=self.path, purge_step=purge)

    def scalars(self, step: int, values: Mapping[str, Any], *, prefix: str = "") -> None:
        """Adds `prefix + name` at `step` for each int or float of `values` (a NaN loss too: TensorBoard draws it);
        strings and bools are not curves."""
        if self._writer is None:
            raise ValueError(f"tensorboard: the writer of {self.path} was closed")
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(prefix + name, value, global_step=step)

    def flush(self) -> None:
        """Writes what is held to the event file."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file; later scalars are refused."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
