"""Packing: a step's items become segments laid into at most R rows of C positions.

Shape legend: N items, R rows (`max_rows_per_device`), C columns (`max_columns_per_row`), S segment slots
(`max_segments_per_device`, the pooling axis).

Packing is two stages so that every modality shares one planner:

1. `plan` decides, from each item's length in positions (prefix + content) and its bag, where its
   segment lands: a row, a first column and a slot. Integers only. A segment longer than a row is cut
   at the row's width and counted in `truncated`; a segment for which the step has no room (rows,
   segments or bags) is dropped whole and counted in `dropped`. Bags are visited in a keyed shuffled
   order (the reference API's "shuffle"), so that which items an overfull step drops is fair and reproducible;
   the items of a bag are visited one after another, in the caller's order, and each lands first-fit
   in the lowest row with room. Slots are numbered in (row, column) order, so segment ids grow along
   every row.
2. `fill_texts` writes the text segments' token ids and their positions; `fill_media` writes the media items'
   prefixes and unit positions into the same layout.

Positions restart in every segment and are axial, `[..., 3]` = (time, row, column): text and audio
carry
their 1-D position on all three axes (so axial rotary embedding reduces to plain 1-D rotary for them,
as in Qwen2-VL's M-RoPE), images (0, row, column) and video (time, row, column), all offset by the
prefix length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import vocab

NO_SEGMENT = -1
"""The segment id of padding positions: they attend only to the padding of their own row."""

LIMITS = (
    "batch.max_rows_per_device",
    "batch.max_segments_per_device",
    "batch.max_bags_per_device",
    "late_interaction.max_query_tokens_per_device",
    "late_interaction.max_documents_per_device",
    "late_interaction.max_document_tokens_per_device",
)
"""The config fields whose room can run out, in the order `Layout.lost_to` indexes them."""
_ROWS, _SEGMENTS, _BAGS, _LATE = 0, 1, 2, 3


@dataclass
class Layout:
    """Where each item's segment landed; -1 marks a dropped item."""

    row: np.ndarray
    """[N] int64: the row of each item's segment."""
    column: np.ndarray
    """[N] int64: its first column."""
    length: np.ndarray
    """[N] int64: the positions it occupies (prefix + kept content); zero when dropped."""
    slot: np.ndarray
    """[N] int64: its segment slot, the index of its pooled embedding."""
    truncated: np.ndarray
    """[N] bool: cut at the row's width."""
    item_of_slot: np.ndarray
    """[S] int64: the item each slot holds, -1 for an empty slot."""

    @property
    def placed(self) -> np.ndarray:
        """[N] bool: items that landed."""
        return self.slot >= 0

    skipped: np.ndarray | None = None
    """[N] bool: items left out before packing (media that failed to decode); not counted as dropped."""
    lost_to: np.ndarray | None = None
    """[N] int8: for a dropped item, the index in `LIMITS` of the limit that had no room for it; else -1."""

    def drops(self) -> dict[str, int]:
        """Dropped items counted by the config field whose room ran out (`LIMITS`), those with any."""
        if self.lost_to is None:
            return {}
        counts = np.bincount(self.lost_to[self.lost_to >= 0], minlength=len(LIMITS))
        return {LIMITS[k]: int(c) for k, c in enumerate(counts) if c}

    @property
    def dropped(self) -> int:
        lost = self.slot < 0
        if self.skipped is not None:
            lost &= ~self.skipped
        return int(lost.sum())


@dataclass
class LateRoom:
    """What late interaction takes of a step, beside rows and segments: each placed query item takes its
    first `span` token rows past its prefix, each document item a document column and every token row
    past its prefix. An item for which the step's late-interaction capacities have no room is dropped
    whole, like one for which the rows have no room."""

    query: np.ndarray
    """[N] bool: the item plays the query side (Query or QueryAndDocument)."""
    document: np.ndarray
    """[N] bool: the item plays the document side (Document or QueryAndDocument)."""
    prefix: np.ndarray
    """[N] int64: its prefix length."""
    span: int
    """`max_query_span`."""
    query_tokens: int
    """`max_query_tokens_per_device` (Qt)."""
    documents: int
    """`max_documents_per_device` (Dd)."""
    document_tokens: int
    """`max_document_tokens_per_device` (Dt)."""

    def needs(self, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(query token rows, document columns, document token rows) [N] each item takes, from its kept
        length (prefix + content cut to the row); an item with no token past its prefix takes none."""
        tokens = np.maximum(kept - self.prefix, 0)
        query = np.where(self.query, np.minimum(tokens, self.span), 0)
        document = np.where(self.document, tokens, 0)
        return query, (document > 0).astype(np.int64), document


def first_fit(free: list[int], need: int) -> int:
    """The lowest row with room for `need` positions, of rows with `free` positions left at their ends; -1 when
    none has. Over Python ints: a numpy search an item was most of a plan's time, and each numpy call lets go of
    the interpreter lock, a hand-off where other threads wait for it."""
    return next((k for k, left in enumerate(free) if left >= need), -1)


def plan(
    lengths: np.ndarray,
    bags: np.ndarray,
    *,
    skip: np.ndarray | None = None,
    rows: int,
    columns: int,
    segments: int,
    max_bags: int,
    rng: np.random.Generator,
    late: LateRoom | None = None,
) -> Layout:
    """Lays out N segments of `lengths` positions (prefix + content) into `rows` x `columns`.

    `bags` [N] gives each item's routing unit (items sharing one land on this device together); at most
    `max_bags` distinct bags are taken when it is positive, the rest dropped whole. Items marked in
    `skip` [N] (media that failed to decode) take no room and are neither placed nor counted as dropped.
    `late`, where late interaction is on, bounds its token rows and documents (see `LateRoom`).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    count = len(lengths)
    kept = np.minimum(lengths, columns)
    truncated = lengths > columns
    if late is not None:
        need_query, need_documents, need_document_tokens = late.needs(kept)
        room = np.array([late.query_tokens, late.documents, late.document_tokens], dtype=np.int64)
        needs = np.stack([need_query, need_documents, need_document_tokens], axis=1)  # [N, 3]
    used_late = np.zeros(3, dtype=np.int64)

    # Bags in a keyed shuffled order, each bag's items in the caller's order.
    unique, _first, inverse = np.unique(np.asarray(bags, dtype=np.int64), return_index=True, return_inverse=True)
    order = rng.permutation(len(unique))
    members: list[list[int]] = [[] for _ in unique]
    for item, unit in enumerate(inverse.tolist()):
        members[unit].append(item)

    # Over Python ints (`first_fit`): numpy's scalar reads and writes an item were most of the plan's time.
    free = [columns] * rows  # positions left at the end of each row
    need_of = kept.tolist()
    skipped_item = [False] * count if skip is None else np.asarray(skip, dtype=bool).tolist()
    row_of = [-1] * count
    column_of = [-1] * count
    used_segments = 0
    used_bags = 0
    lost_to = np.full(count, -1, dtype=np.int8)  # the limit that refused each item (LIMITS)
    for at, bag in enumerate(order.tolist()):
        if max_bags > 0 and used_bags >= max_bags:
            lost_to[[i for b in order[at:] for i in members[b]]] = _BAGS
            break
        took_any = False
        for item in members[bag]:
            if skipped_item[item]:
                continue
            need = need_of[item]
            if used_segments >= segments:
                lost_to[item] = _SEGMENTS
                continue
            if late is not None and np.any(used_late + needs[item] > room):
                lost_to[item] = _LATE + int(np.argmax(used_late + needs[item] > room))
                continue
            r = first_fit(free, need)
            if r < 0:
                lost_to[item] = _ROWS
                continue
            if late is not None:
                used_late += needs[item]
            row_of[item] = r
            column_of[item] = columns - free[r]
            free[r] -= need
            used_segments += 1
            took_any = True
        used_bags += took_any
    row = np.array(row_of, dtype=np.int64)
    column = np.array(column_of, dtype=np.int64)

    placed = row >= 0
    slot = np.full(count, -1, dtype=np.int64)
    placed_items = np.flatnonzero(placed)
    by_position = placed_items[np.lexsort((column[placed_items], row[placed_items]))]
    slot[by_position] = np.arange(len(by_position))
    item_of_slot = np.full(segments, -1, dtype=np.int64)
    item_of_slot[: len(by_position)] = by_position
    return Layout(
        row=row,
        column=column,
        length=np.where(placed, kept, 0),
        slot=slot,
        truncated=truncated & placed,
        item_of_slot=item_of_slot,
        skipped=None if skip is None else np.asarray(skip, dtype=bool),
        lost_to=lost_to if skip is None else np.where(np.asarray(skip, dtype=bool), -1, lost_to).astype(np.int8),
    )


@dataclass
class Rows:
    """The packed input of one device's step, before corruption."""

    tokens: np.ndarray
    """[R, C] int64 token ids (bytes, specials, PAD)."""
    positions: np.ndarray
    """[R, C, 3] int64 axial positions, restarting in every segment."""
    segments: np.ndarray
    """[R, C] int64 segment slot of every position, NO_SEGMENT for padding."""
    content: np.ndarray
    """[R, C] bool: positions holding content (not prefix, not padding)."""

    @classmethod
    def empty(cls, rows: int, columns: int) -> Rows:
        return cls(
            tokens=np.full((rows, columns), vocab.PAD, dtype=np.int64),
            positions=np.zeros((rows, columns, 3), dtype=np.int64),
            segments=np.full((rows, columns), NO_SEGMENT, dtype=np.int64),
            content=np.zeros((rows, columns), dtype=bool),
        )


def fill_texts(
    rows: Rows, layout: Layout, items: list[int], prefixes: list[list[int]], contents: Sequence[bytes | memoryview]
) -> list[tuple[int, int, int]]:
    """Writes placed text items: item k of `items` its prefix ids `prefixes[k]`, then the bytes `contents[k]`
    cut to its segment's kept length, positions 0.. along every axis and its slot, content marked past the
    prefix. Answers each item's content span (row, first column past its prefix, positions), as
    `corrupt.corrupt_text` takes them. A few numpy calls for all the items, as `fill_media` (and for the same
    reason): one item at a time it was five numpy calls an item, a quarter of serving's packing of a 256-text
    batch."""
    if not items:
        return []
    columns = rows.tokens.shape[1]
    at = np.asarray(items, dtype=np.int64)
    length = layout.length[at]  # [M] positions of each item, its prefix included
    start = layout.row[at] * columns + layout.column[at]  # [M] flat first position
    prefix_of = np.array([len(q) for q in prefixes], dtype=np.int64)  # [M]
    body = length - prefix_of  # [M] bytes kept of each item (plan keeps prefix + content, cut to the row)
    kept = body.tolist()
    joined = b"".join([c[:k] for c, k in zip(contents, kept, strict=True)])  # one buffer of every kept byte
    tokens = rows.tokens.reshape(-1)
    _write_prefixes(tokens, start, prefixes, prefix_of)
    flat = _runs(start, length)  # [L] every position of every item
    rows.positions.reshape(-1, 3)[flat] = (flat - np.repeat(start, length))[:, None]
    rows.segments.reshape(-1)[flat] = np.repeat(layout.slot[at], length)
    where = _runs(start + prefix_of, body)  # [B] the positions of their bytes
    tokens[where] = np.frombuffer(joined, dtype=np.uint8)
    rows.content.reshape(-1)[where] = True
    return list(zip(layout.row[at].tolist(), (layout.column[at] + prefix_of).tolist(), kept, strict=True))


def fill_media(
    rows: Rows, layout: Layout, items: list[int], prefixes: list[list[int]], marker: int, positions: list[np.ndarray]
) -> np.ndarray:
    """Writes placed media items of one modality: item k of `items` its prefix ids `prefixes[k]`, then the
    modality `marker` at each of its units, whose axial `positions[k]` [N, 3] (from 0) are offset by the prefix
    length. Answers the units' flat indices (row * C + column) [U], item after item, where the tower adds their
    unit embeddings. A few numpy calls for all the items instead of five an item:
    each numpy call lets go of the interpreter lock and takes it back, and where another thread holds it that is a
    hand-off between threads every call, so 192 images packed one by one spent a third of serving's host thread
    waiting for the lock (py-spy on the H200 host, BENCHMARKS.md)."""
    if not items:
        return np.zeros(0, dtype=np.int64)
    columns = rows.tokens.shape[1]
    at = np.asarray(items, dtype=np.int64)
    length = layout.length[at]  # [M] positions of each item, its prefix included
    start = layout.row[at] * columns + layout.column[at]  # [M] flat first position
    prefix_of = np.array([len(q) for q in prefixes], dtype=np.int64)  # [M]
    units = length - prefix_of  # [M] units kept of each item
    tokens = rows.tokens.reshape(-1)
    axial = rows.positions.reshape(-1, 3)
    segments = rows.segments.reshape(-1)
    slot = layout.slot[at]  # [M]
    _write_prefixes(tokens, start, prefixes, prefix_of)
    head = _runs(start, prefix_of)  # [P] every prefix position
    axial[head] = (head - np.repeat(start, prefix_of))[:, None]
    segments[head] = np.repeat(slot, prefix_of)
    index = _runs(start + prefix_of, units)  # [U] every unit's position
    tokens[index] = marker
    segments[index] = np.repeat(slot, units)
    kept = np.concatenate([q[:u] for q, u in zip(positions, units.tolist(), strict=True)])  # [U, 3] from 0
    kept += prefix_of[0] if (prefix_of == prefix_of[0]).all() else np.repeat(prefix_of, units)[:, None]
    axial[index] = kept
    return index


def _runs(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """[sum(length)] int64: the flat positions of runs of `length[k]` positions from `start[k]`, run after run
    (run k's j-th position: its start less the positions of the runs before it, plus the running rank)."""
    before = np.cumsum(length) - length
    return np.repeat(start - before, length) + np.arange(int(length.sum()), dtype=np.int64)


def _write_prefixes(tokens: np.ndarray, start: np.ndarray, prefixes: list[list[int]], prefix_of: np.ndarray) -> None:
    """Writes item k's prefix ids `prefixes[k]` (`prefix_of[k]` of them) into the flat `tokens` from `start[k]`:
    one write for each prefix length (a step's prefixes are of one length or two)."""
    for p in np.unique(prefix_of).tolist():
        if p:
            chosen = np.flatnonzero(prefix_of == p)
            tokens[start[chosen, None] + np.arange(p)] = np.array(
                [prefixes[k] for k in chosen.tolist()], dtype=np.int64
            )


def fill_state(rows: Rows, layout: Layout, item: int, prefix: list[int], content: bytes | memoryview) -> int:
    """Writes a placed text item that makes a choice: prefix ids, then its bytes with a MASK appended,
    the bytes' head cut where the segment is shorter (so the MASK always ends it). Answers the MASK's
    flat index (row * C + column)."""
    r, c0, n = int(layout.row[item]), int(layout.column[item]), int(layout.length[item])
    p = len(prefix)
    keep = max(0, min(len(content), n - p - 1))
    body = np.frombuffer(content, dtype=np.uint8)[len(content) - keep :]
    span = slice(c0, c0 + n)
    rows.tokens[r, c0 : c0 + p] = prefix
    rows.tokens[r, c0 + p : c0 + p + keep] = body
    rows.tokens[r, c0 + p + keep] = vocab.MASK
    rows.positions[r, span, :] = np.arange(n, dtype=np.int64)[:, None]
    rows.segments[r, span] = layout.slot[item]
    rows.content[r, c0 + p : c0 + n] = True
    return r * rows.tokens.shape[1] + c0 + p + keep
