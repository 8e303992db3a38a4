"""Which of a run's checkpoints stay on disk: the newest `keep_last`, plus the best by a named evaluation result.

    rotation = Rotation(folder, CheckpointConfig(every=100, keep_last=2, best="eval/text->image/recall@10"))
    rotation.evaluated(step, results)   # after an evaluation; True where it scored a new best (save this step)
    rotation.due(step)                  # whether `every` asks for a save after this step
    rotation.saved(step)                # after a save returned: deletes what the policy no longer keeps

A checkpoint is deleted only in `saved`, called once the new one is renamed into place whole (`Trainer.save`
writes a temp file, fsyncs it and renames it), so a process killed at any moment leaves the newest whole checkpoint
it had (a save cut short leaves a temp file, which `latest` passes over and the next save removes). The best is
the checkpoint of the step whose evaluation scored best; a new best is saved at its step even off the `every`
grid, so the best one is always a file. The scores of a resumed run are read back from its `metrics.jsonl`.
Checkpoints of steps past the one just saved (a run resumed from an older file) are not this timeline's to
judge and are left alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .run_config import CheckpointConfig
from .run_dir import RunDir

__all__ = ["Rotation"]


class Rotation:
    """One run's checkpoint policy (`[checkpoint]`) over its folder; `history` holds earlier evaluation records
    (`metrics.jsonl`'s, each with its "step") whose `best` scores count as this run's."""

    def __init__(self, folder: RunDir, config: CheckpointConfig, history: Iterable[Mapping[str, Any]] = ()) -> None:
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config: expected a CheckpointConfig, got {type(config).__name__}")
        self.folder, self.config = folder, config
        self.scores: dict[int, float] = {}
        """The `best` result of each evaluated step."""
        for record in history:
            value = record.get(config.best) if config.best is not None else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.scores[int(record["step"])] = float(value)

    def due(self, step: int) -> bool:
        """Whether `every` asks for a save after `step`."""
        return self.config.every > 0 and step % self.config.every == 0

    def evaluated(self, step: int, results: Mapping[str, Any]) -> bool:
        """Notes the evaluation of `step`; answers whether it scored a new best by `best` (then save `step`).
        A `best` that the results do not hold is refused (`ValueError` naming what they hold): a misspelt name
        would otherwise keep no best at all, silently."""
        name = self.config.best
        if name is None:
            return False
        value = results.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            held = ", ".join(sorted(k for k, v in results.items() if isinstance(v, (int, float)))) or "none"
            raise ValueError(f"checkpoint.best: {name!r} is not among the evaluation's results ({held})")
        if not math.isfinite(value):  # a NaN would never be beaten, nor beat anything: not a score
            return False
        before = self.best()
        self.scores[step] = float(value)
        return before is None or self._better(float(value), before[1])

    def best(self) -> tuple[int, float] | None:
        """The step that scored best so far and its score (the earliest of equals), or None."""
        found: tuple[int, float] | None = None
        for step, value in sorted(self.scores.items()):
            if found is None or self._better(value, found[1]):
                found = (step, value)
        return found

    def best_checkpoint(self, upto: int | None = None) -> str | None:
        """The checkpoint of the best-scoring step that has one on disk (of steps up to `upto`), or None."""
        on_disk = dict(self.folder.saved())
        found: tuple[int, float] | None = None
        for step, value in sorted(self.scores.items()):
            if step in on_disk and (upto is None or step <= upto) and (found is None or self._better(value, found[1])):
                found = (step, value)
        return None if found is None else on_disk[found[0]]

    def saved(self, step: int) -> list[str]:
        """Applies the policy after the checkpoint of `step` was written; answers the paths it deleted. Nothing
        is deleted unless that checkpoint is on disk under its name, or where `keep_last` is 0 (keep every one)."""
        newest = self.folder.checkpoint_path(step)
        if self.config.keep_last == 0 or not os.path.isfile(newest):
            return []
        ours = [(s, path) for s, path in self.folder.saved() if s <= step]
        keep = {path for _, path in ours[-self.config.keep_last :]}
        best = self.best_checkpoint(upto=step)
        if best is not None:
            keep.add(best)
        removed = []
        for _, path in ours:
            if path not in keep:
                os.unlink(path)
                removed.append(path)
        return removed

    def _better(self, value: float, than: float) -> bool:
        return value > than if self.config.mode == "max" else value < than
