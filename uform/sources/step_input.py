"""A step's records assembled into what `Trainer.step(modalities, contents, config)` takes: the record
convention's CSR relations, bags, temperature groups, late-interaction sides and choices.

Each record is a bag. Within it every pair of positives attracts (both ways: a caption and its image, a
query and its document), and each named negative repels every positive (both ways); negatives do not
attract each other, and items of different records are left to the run's `Negatives` rule (under
`Ambient`, they repel). Bags are numbered by the record's place in the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..config import TrainerStepConfig
from ..enums import Modality
from ..relations import Edges, Relations
from .fields import RecordItems


@dataclass
class StepInput:
    """One step's inputs for one rank; `trainer.step(*step_input)` steps it."""

    modalities: list[Modality]
    contents: list[bytes]
    config: TrainerStepConfig
    step: int
    """The step number it was filled for (the trainer's: counted from one across resumes)."""
    records: list[str] = field(default_factory=list)
    """The ids of its records, in item order (a record's items are consecutive)."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.modalities, self.contents, self.config))


def _edges(runs: list[list[int]]) -> Edges:
    if not any(runs):
        return Edges()
    offsets = [0]
    ids: list[int] = []
    for run in runs:
        ids.extend(run)
        offsets.append(len(ids))
    return Edges(offsets=offsets, ids=ids)


def relations_of(records: list[RecordItems]) -> Relations:
    """The convention's relations over the records' items, numbered in order (see the module's docstring)."""
    attract: list[list[int]] = []
    repel: list[list[int]] = []
    base = 0
    for record in records:
        members = range(base, base + len(record.kinds))
        positives = [i for i, k in zip(members, record.kinds, strict=True) if k != "negative"]
        negatives = [i for i, k in zip(members, record.kinds, strict=True) if k == "negative"]
        for i, kind in zip(members, record.kinds, strict=True):
            if kind == "negative":
                attract.append([])
                repel.append(positives)
            else:
                attract.append([j for j in positives if j != i])
                repel.append(negatives)
        base += len(record.kinds)
    return Relations(attract=_edges(attract), repel=_edges(repel))


def assemble(records: list[RecordItems], step: int, *, late: bool, groups: bool) -> StepInput:
    """The `StepInput` of `records` (each a bag) for step `step`; `late` gives every item its side,
    `groups` its record's temperature group."""
    modalities = [m for r in records for m in r.modalities]
    contents = [c for r in records for c in r.contents]
    bags = [b for b, r in enumerate(records) for _ in r.modalities]
    config = TrainerStepConfig(bags=bags, relations=relations_of(records))
    if late:
        config.sides = [s for r in records for s in r.sides]
    if groups:
        config.temperature_groups = [r.group for r in records for _ in r.modalities]
    if any(r.choices for r in records):
        choices: list[bytes] = []
        targets: list[list[float]] = []
        for r in records:
            chooser = r.chooser
            for i in range(len(r.modalities)):
                choices.append(r.choices if i == chooser else b"")
                targets.append(r.targets if i == chooser else [])
        config.choices, config.choice_targets = choices, targets
    return StepInput(modalities, contents, config, step, [r.id for r in records for _ in r.modalities])
