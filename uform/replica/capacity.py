"""Capacity notices: items cut or dropped for lack of room, told to the user once per owner (a trainer, a
served model) and again whenever the share lost has doubled, naming the config field to raise.

Kinds: "capacity.truncated" (items cut at a row's width, `batch.max_columns_per_row`) and "capacity.dropped"
(items left out whole, counted per limit that ran out, `data.pack.LIMITS`). The level of each is the share of
the step's (or the call's) items it hit, so a run that loses a steady few percent hears of it once, and one
whose loss grows from 5% to 60% hears of it again at 10%, 20% and 40%.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..notices import CapacityWarning, Notices

TRUNCATED = "capacity.truncated"
DROPPED = "capacity.dropped"


def warn_truncated(notices: Notices, cut: int, items: int, where: str, advice: str, stacklevel: int = 2) -> None:
    """Counts `cut` of `items` cut at the row's width and warns as the module says; `where` names the work
    ("a step", "encode"), `advice` the limit to raise and where the cut items are counted."""
    if cut <= 0 or items <= 0:
        return
    share = cut / items
    notices.warn(
        TRUNCATED,
        f"uform: {where} cut {cut} of {items} items ({share:.0%}) at the row's width; {advice} "
        "(shown again only if the share doubles)",
        CapacityWarning,
        count=cut,
        level=share,
        stacklevel=stacklevel + 1,
    )


def warn_dropped(
    notices: Notices, drops: Mapping[str, int], items: int, where: str, counted: str, stacklevel: int = 2
) -> None:
    """Counts the items `drops` names (per config field whose room ran out, as `Layout.drops` answers) of
    `items` and warns as the module says, naming each field to raise; `counted` says where they are counted."""
    lost = sum(drops.values())
    if lost <= 0 or items <= 0:
        return
    share = lost / items
    fields = ", ".join(
        f"{field} ({count} {'item' if count == 1 else 'items'})"
        for field, count in sorted(drops.items(), key=lambda kv: -kv[1])
    )
    notices.warn(
        DROPPED,
        f"uform: {where} dropped {lost} of {items} items ({share:.0%}) whole for lack of room, so they were not "
        f"trained on; the room that ran out: {fields}; raise {'it' if len(drops) == 1 else 'them'} or send fewer "
        f"items per step. Counted in {counted} (shown again only if the share doubles)",
        CapacityWarning,
        count=lost,
        level=share,
        stacklevel=stacklevel + 1,
    )


def warn_step_capacity(notices: Notices, batch: Any, items: int, columns: int, stacklevel: int = 2) -> None:
    """A training step's capacity notices from its `data.batch.Batch` (of `items` items, rows `columns` wide)."""
    advice = (
        f"raise batch.max_columns_per_row (now {columns}) to train on them whole. Counted in TrainerStepStats.truncated"
    )
    warn_truncated(notices, batch.truncated, items, "a step", advice, stacklevel + 1)
    warn_dropped(notices, batch.layout.drops(), items, "a step", "TrainerStepStats.dropped", stacklevel + 1)
