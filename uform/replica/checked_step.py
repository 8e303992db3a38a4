"""A step's arguments, checked: `check_step` refuses what a trainer's step may not take (nothing changes when it
does), and `CheckedStep` carries what passed, so no later stage checks again.

A step over several devices is checked once, in the calling process (`uform.runtime.replicas`); each device's
share crosses to its worker as a `CheckedStep` of already-checked values (its items' bytes by shared memory), and
the worker's replica takes it as it is (`Replica.submit_checked`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arena import Arena
from ..config import TrainerInitVramConfig, TrainerStepConfig, TrainerStepStats
from ..data.batch import MEDIA_KINDS, media_features
from ..data.items import ChoiceTapes, parse_choices, parse_contents, parse_modalities, parse_sides, per_item_integers
from ..enums import LateInteractionSide, Modality, Objective, Scalar
from ..relations import check_relations, edge_limit

__all__ = ["CheckedStep", "check_step"]


@dataclass(frozen=True)
class CheckedStep:
    """A step's arguments after every check of `check_step` (N items). Frozen: a stage that holds one changes
    none of its fields (`dataclasses.replace` makes another, such as a device's share with its own contents)."""

    modalities: list[Modality]
    """[N] each item's modality."""
    contents: list[bytes | memoryview]
    """[N] each item's bytes: the caller's buffers, or copies the trainer owns (`copy_buffers`)."""
    bags: np.ndarray | None
    """[N] int64 bag of each item, or None (each item its own bag)."""
    groups: np.ndarray | None
    """[N] int64 temperature group of each item, or None."""
    sides: list[LateInteractionSide] | None
    """[N] each item's late-interaction side, or None."""
    choices: ChoiceTapes | None
    """The items' choices, or None where the run trains none."""
    relations: Any
    """The step's `Relations` (checked against N items and the run's edge limit)."""
    arena: Arena | None
    """Where the step's embeddings land, or None."""
    scalar: Scalar
    """The arena's element type."""
    stats: TrainerStepStats | None
    """Filled with the step's stats once it is done, or None."""
    origin: np.ndarray | None = None
    """[N] the caller's index of each item, where a step over several devices split it (warnings name those)."""

    def with_contents(self, contents: list[bytes | memoryview]) -> CheckedStep:
        """This step over `contents` (a worker's views of the shared bytes, one per item)."""
        if len(contents) != len(self.modalities):
            raise ValueError(f"contents: {len(contents)} items for a step of {len(self.modalities)}")
        return dataclasses.replace(self, contents=contents)


def check_step(
    run: TrainerInitVramConfig,
    modalities: Any,
    contents: Any,
    config: TrainerStepConfig | None,
    copy_buffers: bool,
    *,
    allow_empty: bool = False,
    edge_factor: int = 1,
) -> CheckedStep:
    """Every check of a step's arguments against the run `run` (nothing changes when one fails); answers
    them owned by the trainer when `copy_buffers`. `edge_factor` devices share the step's edges."""
    config = TrainerStepConfig() if config is None else config
    if not isinstance(config, TrainerStepConfig):
        raise TypeError(f"config: expected a TrainerStepConfig, got {type(config).__name__}")
    mods = parse_modalities(modalities)
    items = parse_contents(contents, len(mods))
    live = media_features(run)
    for i, m in enumerate(mods):
        if m != Modality.Text and MEDIA_KINDS[m] not in live:
            slice_field = "chunk_samples" if m == Modality.Audio else "patch_side"
            raise ValueError(f"modalities[{i}]: {m} items are out of this run (its batch.{m}.{slice_field} is zero)")
    n = len(mods)
    if n == 0 and not allow_empty:
        raise ValueError("modalities: a step needs at least one item")
    bags = per_item_integers(config.bags, n, "bags", below=2**32)
    groups = per_item_integers(config.temperature_groups, n, "temperature_groups", run.contrastive.temperature_groups)
    sides = parse_sides(config.sides, n)
    choices = None
    if run.choices.weight > 0:  # read only where the run trains choices (always a copy)
        choices = parse_choices(config.choices, config.choice_targets, mods, run.batch.max_choices_per_item)
    if run.objective != Objective.Masked or run.late_interaction.weight > 0:  # late pairs resolve through them
        check_relations(config.relations, n, *edge_limit(run, edge_factor))
    if config.arena is not None and not isinstance(config.arena, Arena):
        raise TypeError(f"arena: expected an Arena, got {type(config.arena).__name__}")
    if config.stats is not None and not isinstance(config.stats, TrainerStepStats):
        raise TypeError(f"stats: expected a TrainerStepStats, got {type(config.stats).__name__}")
    scalar = Scalar.parse(config.outputs_scalar, "outputs_scalar")
    relations = config.relations
    if copy_buffers:
        items = [bytes(c) for c in items]
        relations = copy.deepcopy(relations)
    return CheckedStep(mods, items, bags, groups, sides, choices, relations, config.arena, scalar, config.stats)  # type: ignore[arg-type]
