"""A serving call's items cut into batches and packed: the host side of `uform.serve.Model`'s calls, which its host
thread runs; numpy only (no torch), so it would run as well in a process without torch.

Shape legend: N items of a call, R rows, C columns, S segment slots, T token vectors of a batch.

A call's items are taken in windows (`Packing.window` items, in the caller's order). A window's media items are
decoded together (the caller's `decode`; the next window's decoding runs on a thread of its own while this one is
packed), its items sorted longest first and cut into batches by first fit (`plan_batches`), and each batch packed
by the trainer's own packing (`pack_batch`: `data.batch.prepare` under the serving config, FlexAttention's block
tables where the forward takes that path, and the rows the readout picks). A window's last, part-filled batch is
packed with the next window (one per window would cost a tenth of a call's batches).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import vocab
from ..config import TrainerInitVramConfig
from ..enums import LateInteractionSide, Modality
from ..media.units import Units
from .batch import Alloc, Batch, prepare
from .blocks import block_tables, gathered_shape
from .pack import first_fit

__all__ = [
    "WIDE_COLUMNS",
    "CallItems",
    "Packed",
    "Packing",
    "call_batches",
    "pack_batch",
    "packing_rows",
    "plan_batches",
]

WIDE_COLUMNS = 8192
"""The widest row a FlexAttention forward packs (`packing_rows`): its block tables grow as the square of a row's
128-position tiles."""

Decoded = tuple[dict[int, Units], list[tuple[int, str]], dict[int, Any]]
"""What a window's `decode` answers: the units of each media item that decoded, (item, reason) of each that did
not, and whatever else the packing of its batches takes along by item (the model's pictures decoded on a GPU)."""


@dataclass(frozen=True)
class Packing:
    """How a model packs its calls."""

    config: TrainerInitVramConfig
    """The run's config as packing sees it at serving: the contrastive objective (nothing corrupted), one bag."""
    columns: int
    """Positions one item spans at most: the run's row (items are cut where training cut them)."""
    prefix: int
    """Positions of a text item's prefix (the modality marker, and the side marker under late interaction)."""
    segments: int
    """Items one forward carries at most."""
    packing: tuple[int, int]
    """(rows, columns) a batch packs into (`packing_rows` under FlexAttention, else (rows, columns))."""
    fixed: bool
    """Every batch packed at the full capacity (a compiled forward: one shape); else only the rows it uses."""
    flex: bool
    """The forward's attention is FlexAttention's: each batch carries its block tables."""
    window: int
    """Items decoded and sorted together (a call's memory for decoded media is bounded by this)."""


@dataclass
class CallItems:
    """What packing reads of a checked call."""

    verb: str  # "encode" | "tokens" | "choose"
    modalities: list[Modality]
    contents: Sequence[bytes | memoryview]
    sides: list[LateInteractionSide] | None
    span: np.ndarray | None = None  # tokens: [N] most token vectors of each item (-1: every content token)


@dataclass
class Packed:
    """One batch packed on the host, its arrays still numpy."""

    members: np.ndarray
    """[n] the call's items, in packing order."""
    batch: Batch
    tables: dict[str, np.ndarray]
    """FlexAttention's block tables (empty off that path, and for a batch the forward gathers into dense attention:
    `data.blocks.gathered_shape`)."""
    picks: np.ndarray
    """The rows the readout takes: encode, each member's segment slot [n]; tokens, the flat positions of every
    member's vectors [T]; choose, each MASK's [n]."""
    counts: np.ndarray
    """tokens: [n] vectors per member."""
    truncated: int
    """Members cut to fit a row."""


def packing_rows(rows: int, columns: int, widest: int = WIDE_COLUMNS) -> tuple[int, int]:
    """(rows, columns) a FlexAttention batch of `rows` x `columns` packs into: the same positions, in rows k times
    as wide (k the largest divisor of `rows` that keeps a row at most `widest`, or 1). Attention never crosses a
    segment and positions restart in each, so a row's width changes no answer, only how little of each row is
    left over: 256 + 1 positions of a 256² image at patch 16 fill three to a 1024-column row (25% of the batch
    left empty) and 31 to an 8,192-column one (3%)."""
    k = max(d for d in range(1, rows + 1) if rows % d == 0 and (d == 1 or columns * d <= widest))
    return rows // k, columns * k


def plan_batches(
    order: Sequence[int], lengths: dict[int, int], rows: int, columns: int, segments: int
) -> Iterator[tuple[list[int], int]]:
    """Cuts items (visited in `order`, each `lengths[i]` positions, at most `columns`) into batches of at most
    `segments` items that first fit lays into `rows` rows of `columns`: each item in the lowest row with room,
    a batch closing when the next item finds none. Answers (members in order, rows used) per batch; the
    packer (`data.pack.plan`), given the members in this order as one bag, places them exactly so."""
    free = [columns] * rows
    members: list[int] = []
    for item in order:
        need = min(lengths[item], columns)
        r = first_fit(free, need)
        if len(members) == segments or r < 0:
            yield members, sum(left < columns for left in free)
            free = [columns] * rows
            members = []
            r = 0
        free[r] -= need
        members.append(item)
    if members:
        yield members, sum(left < columns for left in free)


def call_batches(
    shape: Packing,
    items: CallItems,
    decode: Callable[[range], Decoded],
    pack: Callable[[list[int], int, dict[int, Units], dict[int, Any]], Any],
    stop: threading.Event,
) -> Generator[tuple[str, Any], None, None]:
    """The call's messages, window after window: ("skipped", [(item, reason)]) for a window's media that did not
    decode, then ("batch", pack(members, rows used, units, taken along)) for each of its batches. `decode(window)`
    decodes a window's media items (on a thread of its own, a window ahead); `stop` ends the call between batches.
    The views of decoded units a window holds are dropped once its batches are packed, but for those of the items
    carried into the next window."""
    n = len(items.modalities)
    windows = [range(start, min(n, start + shape.window)) for start in range(0, n, shape.window)]
    carried: list[int] = []  # the last, part-filled batch of the window before: packed with this window
    kept: tuple[dict[int, Units], dict[int, Any]] = ({}, {})
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="uform-serve-decode") as ahead:
        decoding = ahead.submit(decode, windows[0]) if windows else None
        for k, window in enumerate(windows):
            assert decoding is not None
            units, failed, along = decoding.result()
            decoding = ahead.submit(decode, windows[k + 1]) if k + 1 < len(windows) else None
            units.update(kept[0])
            along.update(kept[1])
            last = k + 1 == len(windows)
            carried = yield from _window(shape, items, [*carried, *window], units, failed, along, pack, stop, last)
            kept = ({i: units[i] for i in carried if i in units}, {i: along[i] for i in carried if i in along})
            del units, along
            if stop.is_set():
                return


def _window(
    shape: Packing,
    items: CallItems,
    members: list[int],
    units: dict[int, Units],
    failed: list[tuple[int, str]],
    along: dict[int, Any],
    pack: Callable[[list[int], int, dict[int, Units], dict[int, Any]], Any],
    stop: threading.Event,
    last: bool,
) -> Generator[tuple[str, Any], None, list[int]]:
    """One decoded window's messages: its failures, then its batches, sorted and cut. Answers the members of its
    last batch unpacked, to go with the next window, unless it is the call's `last` window."""
    if failed:
        yield ("skipped", failed)
    lost = {i for i, _ in failed}
    lengths = {}
    for i in members:
        if i in lost:
            continue
        content = len(units[i]) if i in units else len(items.contents[i])
        lengths[i] = min(shape.prefix + content, shape.columns)
    order = sorted(lengths, key=lambda i: (-lengths[i], i))  # longest first: first fit decreasing
    planned = plan_batches(order, lengths, *shape.packing, shape.segments)
    batch = next(planned, None)
    while batch is not None:
        if stop.is_set():
            return []
        after = next(planned, None)
        if after is None and not last:
            return batch[0]
        yield ("batch", pack(batch[0], batch[1], units, along))
        batch = after
    return []


def pack_batch(
    shape: Packing, items: CallItems, members: list[int], rows: int, units: dict[int, Units], alloc: Alloc
) -> Packed:
    """One batch through the trainer's packing: on a model that is not compiled only the rows it uses, on a
    compiled one the full capacity (one compiled shape); its media arrays made by `alloc`."""
    n = len(members)
    fixed = shape.fixed
    pack_rows, pack_columns = shape.packing
    config = dataclasses.replace(
        shape.config,
        batch=dataclasses.replace(
            shape.config.batch,
            max_rows_per_device=pack_rows if fixed else rows,
            max_columns_per_row=pack_columns,
            max_segments_per_device=shape.segments if fixed else n,
        ),
    )
    contents = [items.contents[i] for i in members]
    cut = 0
    if pack_columns > shape.columns:  # rows wider than the run's: a text is cut here where its row would cut it
        room = shape.columns - shape.prefix
        for k, i in enumerate(members):
            if items.modalities[i] == Modality.Text and len(contents[k]) > room:
                contents[k], cut = contents[k][:room], cut + 1
    batch = prepare(
        config,
        [items.modalities[i] for i in members],
        contents,
        bags=np.zeros(n, dtype=np.int64),
        groups=None,
        sides=None if items.sides is None else [items.sides[i] for i in members],
        relations=None,
        step=0,
        units={k: units[i] for k, i in enumerate(members) if i in units},
        alloc=alloc,
    )
    layout = batch.layout
    if not layout.placed.all():  # pragma: no cover - plan_batches makes this impossible
        raise RuntimeError(f"serving: {int((~layout.placed).sum())} items found no room; this is a bug")
    columns = batch.tokens.shape[1]
    start = layout.row * columns + layout.column + shape.prefix  # [n] first content position
    content = layout.length - shape.prefix  # [n] content positions kept
    counts = np.zeros(n, dtype=np.int64)
    gather = np.zeros(0, dtype=np.int64)
    if items.verb == "tokens":
        assert items.span is not None
        limit = items.span[members]
        counts = np.where(limit < 0, content, np.minimum(content, limit))
        gather = np.concatenate([s + np.arange(c) for s, c in zip(start, counts, strict=True)] or [gather])
    elif items.verb == "choose":
        gather = start + content - 1  # the placeholder after the text
        batch.tokens.reshape(-1)[gather] = vocab.MASK
    picks = layout.slot.copy() if items.verb == "encode" else np.ascontiguousarray(gather)
    # A batch the forward gathers into dense attention reads no block tables (`model.inputs.to_device`, same rule).
    gathered = shape.flex and gathered_shape(batch.counts)[0] > 0
    return Packed(
        members=np.asarray(members, dtype=np.int64),
        batch=batch,
        tables=block_tables(batch.segments) if shape.flex and not gathered else {},
        picks=picks,
        counts=counts,
        truncated=batch.truncated + cut,
    )
