"""Text span corruption for the masked objective (docs/design.md §5).

Shape legend: R rows, C columns, S text segments of the step, J spans (or bars) of a segment at most, P covered
positions of the step.

In every text segment of n content bytes, spans of geometric length (mean `token_mean_span`) are drawn
until they cover exactly k = round(token_mask_probability * n) positions, the last cut to what is still
needed, and placed apart from each other around a circle of n positions turned by a uniform rotation, so
every position is covered with chance exactly k / n. This is T5's and SpanBERT's span masking with BERT's
80/10/10 split of what a covered position shows: of the k covered positions of a segment, replace_fraction * k
show MASK and random_fraction * k a uniform random byte (each rounded stochastically: down or up with the odds
that make it exact in expectation), and the rest keep their byte.

Every draw of a segment is a word of its item's own counter-based stream (`keyed.words`: the item's key, a purpose,
a counter), so an item's corruption depends on nothing else in its step, and the step's segments are drawn
together in a few numpy calls rather than one generator object and half a dozen calls each (those calls were
most of a text step's prepare stage: 8 of 13 ms for 256 segments, BENCHMARKS.md "Issue 12, seventh day").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from .. import vocab
from ..config import Masking
from .keyed import words

_SPAN, _BAR, _TURN, _ROUND, _RANK, _BYTE = range(6)
"""The purposes a segment draws words for, each a stream of its own."""


def _below(word: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Integers uniform in [0, bound) from 64-bit words, bound < 2^31 (the top 32 bits scaled: Lemire's
    multiply-shift, biased by at most bound / 2^32)."""
    return ((word >> np.uint64(32)) * np.asarray(bound, dtype=np.uint64)) >> np.uint64(32)


@functools.lru_cache(maxsize=16)
def _geometric_table(mean_span: float, limit: int) -> np.ndarray:
    """Ascending 32-bit thresholds t of the geometric law of mean `mean_span` (success chance q = 1 / mean): a
    length exceeds g exactly when a uniform 32-bit word falls below floor((1 - q)^g 2^32), so a word's length is 1
    plus the number of thresholds above it. Empty where q is 1 (every span is one position). Lengths stop at
    `limit` + 1: a span is cut to the count it reaches, and no count is past `limit`, so a longer one would be cut
    to the same (a huge mean span stays a short table)."""
    q = 1.0 / max(mean_span, 1.0)
    table = []
    g = 1
    while q < 1.0 and g <= limit:
        t = math.floor((1.0 - q) ** g * 2.0**32)
        if t <= 0:
            break
        table.append(t)
        g += 1
    return np.array(table[::-1], dtype=np.uint64)


def _ordinals(runs: np.ndarray) -> np.ndarray:
    """[sum(runs)] each element's index within its run, for consecutive runs of the given lengths."""
    return np.arange(int(runs.sum())) - np.repeat(np.cumsum(runs) - runs, runs)


def _span_lengths(keys: np.ndarray, counts: np.ndarray, mean_span: float) -> tuple[np.ndarray, np.ndarray]:
    """Geometric span lengths [S, J] drawn until each segment's reach `counts` [S] (> 0), the last cut to it,
    zeros past it, and the spans each segment uses [S]."""
    longest = int(counts.max())
    table = _geometric_table(mean_span, 1 << longest.bit_length())  # a power of two past every count: few tables
    width = min(longest, math.ceil(longest / max(mean_span, 1.0)) + 8)
    while True:  # span j of a segment is its word j: a wider draw leaves the narrower one as it was
        drawn = words(keys[:, None, :], _SPAN, np.arange(width))  # [S, J]
        spans = (1 + len(table) - np.searchsorted(table, drawn >> np.uint64(32), side="right")).astype(np.int64)
        reach = np.cumsum(spans, axis=1)  # [S, J]
        if (reach[:, -1] >= counts).all() or width >= longest:
            break
        width = min(2 * width, longest)
    used = np.argmax(reach >= counts[:, None], axis=1) + 1  # [S] the first span that reaches the count is the last
    rows = np.arange(len(counts))
    spans[rows, used - 1] -= reach[rows, used - 1] - counts
    spans[np.arange(width)[None, :] >= used[:, None]] = 0
    return spans, used


def _layout(
    keys: np.ndarray, lengths: np.ndarray, counts: np.ndarray, mean_span: float
) -> tuple[np.ndarray, np.ndarray]:
    """Every segment's covered positions, flat in segment order: (segment [P], position within it [P]), each
    segment's exactly `counts` of its `lengths` positions.

    The spans and a random composition of the free positions into as many gaps (each at least one where there is
    room, so spans stay apart; the gaps are the spacings of the sorted bars drawn uniformly in the slack) alternate
    around a circle of `length` positions, turned by a uniform rotation and cut open at position zero. The rotation
    makes every position's chance exactly count / length, which a start drawn where the whole span fits (T5's and
    SpanBERT's linear placement) does not: on short texts it piles coverage onto the head."""
    spans, used = _span_lengths(keys, counts, mean_span)  # [S, J], [S]
    segments, width = spans.shape
    free = lengths - counts
    floor = (free >= used).astype(np.int64)  # [S]
    slack = free - floor * used  # [S]
    bars = _below(words(keys[:, None, :], _BAR, np.arange(width)), (slack + 1)[:, None]).astype(np.int64)  # [S, J]
    bars = np.where(np.arange(width)[None, :] < (used - 1)[:, None], bars, slack[:, None])
    bars.sort(axis=1)
    edges = np.concatenate([np.zeros((segments, 1), np.int64), bars, slack[:, None]], axis=1)  # [S, J + 2]
    gaps = np.diff(edges, axis=1)[:, :width]  # [S, J], zero past a segment's spans
    live = np.arange(width)[None, :] < used[:, None]
    steps = np.where(live, spans + gaps + floor[:, None], 0)
    starts = np.cumsum(steps, axis=1) - steps  # [S, J] where each span starts on the unturned circle
    turn = _below(words(keys, _TURN, np.zeros(segments)), lengths).astype(np.int64)  # [S]
    flat_spans = spans[live]  # [n spans]
    owner = np.repeat(np.arange(segments), used)  # [n spans]
    first = (starts[live] + turn[owner]) % lengths[owner]
    segment = np.repeat(owner, flat_spans)  # [P]
    position = (np.repeat(first, flat_spans) + _ordinals(flat_spans)) % lengths[segment]
    return segment, position


def cover_spans(length: int, count: int, mean_span: float, rng: np.random.Generator) -> np.ndarray:
    """Answers a [length] bool mask with exactly `count` positions covered by geometric spans, every position
    equally likely to be covered: one segment of `corrupt_text`'s layout, keyed by two words of `rng`."""
    covered = np.zeros(length, dtype=bool)
    if count > 0:
        keys = rng.integers(0, 2**64, size=(1, 2), dtype=np.uint64, endpoint=False)
        _, position = _layout(keys, np.array([length]), np.array([min(count, length)]), mean_span)
        covered[position] = True
    return covered


def corrupt_text(
    tokens: np.ndarray,
    spans: list[tuple[int, int, int]],
    masking: Masking,
    keys: np.ndarray | Sequence[Sequence[int]],
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupts the text content `spans` (row, first column, length) of `tokens` [R, C], span i drawing from
    `keys[i]` alone ([S, 2] uint64: each item's own keyed stream, `data.keyed.keyed_states`, so an item's
    corruption does not depend on the other items of its step, nor on which device they share).

    Answers (inputs [R, C] int64, covered [R, C] bool); the targets are `tokens[covered]`.
    """
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1, 2)
    if len(keys) != len(spans):
        raise ValueError(f"corrupt_text: {len(spans)} spans need as many keys, got {len(keys)}")
    inputs = tokens.copy()
    covered = np.zeros(tokens.shape, dtype=bool)
    if not spans:
        return inputs, covered
    table = np.array(spans, dtype=np.int64).reshape(-1, 3)  # [S, 3] row, first column, length
    counts = np.array([round(masking.token_mask_probability * n) for n in table[:, 2].tolist()], dtype=np.int64)
    live = counts > 0
    if not live.any():
        return inputs, covered
    table, counts, keys = table[live], counts[live], keys[live]
    segment, position = _layout(keys, table[:, 2], counts, masking.token_mean_span)  # [P], [P]
    at = table[segment, 0] * tokens.shape[1] + table[segment, 1] + position  # [P] flat positions
    covered.reshape(-1)[at] = True
    # Which covered positions show MASK, a random byte or their own: each segment's ranked by a word apiece,
    # the lowest `shown` MASK, the next `drawn` a byte. Both cumulative shares are rounded stochastically with one
    # draw: each is exact in expectation even for a three-byte caption, and together they never exceed k.
    ordinal = _ordinals(counts)  # [P] within its segment
    order = np.lexsort((ordinal, words(keys[segment], _RANK, ordinal), segment))
    rank = np.empty(len(segment), dtype=np.int64)
    rank[order] = ordinal  # each segment's run is the same places in sorted order, so the ordinals rank them
    u = (words(keys, _ROUND, np.zeros(len(keys))) >> np.uint64(11)).astype(np.float64) / 2.0**53  # [S] in [0, 1)
    shown = np.minimum(counts, np.floor(masking.replace_fraction * counts + u).astype(np.int64))
    upto = np.floor((masking.replace_fraction + masking.random_fraction) * counts + u).astype(np.int64)
    drawn = np.minimum(counts, upto) - shown
    shown, drawn = shown[segment], drawn[segment]  # [P]
    flat = inputs.reshape(-1)
    flat[at[rank < shown]] = vocab.MASK
    random = (rank >= shown) & (rank < shown + drawn)
    flat[at[random]] = (words(keys[segment[random]], _BYTE, ordinal[random]) >> np.uint64(56)).astype(np.int64)
    return inputs, covered
