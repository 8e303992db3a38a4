"""Text span corruption for the masked objective (docs/design.md §5).

Shape legend: R rows, C columns, P covered positions of the step.

In every text segment of n content bytes, spans of geometric length (mean `token_mean_span`) are drawn
until they cover exactly k = round(token_mask_probability * n) positions, the last cut to what is still
needed, and placed apart from each other around a circle of n positions turned by a uniform rotation, so
every position is covered with chance exactly k / n (`cover_spans`). This is T5's and SpanBERT's span
masking with BERT's 80/10/10 split of what a covered position shows: of the k covered
positions of a segment, replace_fraction * k show MASK and random_fraction * k a uniform random byte (each
rounded stochastically: down or up with the odds that make it exact in expectation), and the rest keep
their byte. Every draw of a segment comes from its item's own generator, keyed by (seed, step, the item).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import vocab
from ..config import Masking


def cover_spans(length: int, count: int, mean_span: float, rng: np.random.Generator) -> np.ndarray:
    """Answers a [length] bool mask with exactly `count` positions covered by geometric spans, every
    position equally likely to be covered.

    Span lengths are geometric (mean `mean_span`), drawn until they add up to `count`, the last cut to what
    is still needed. The spans and a uniformly random composition of the `length - count` free positions
    into as many gaps (each at least one where there is room, so spans stay apart) alternate around a
    circle of `length` positions, turned by a uniform rotation and cut open at position zero. The rotation
    makes every position's chance exactly count / length, which a start drawn where the whole span fits
    (T5's and SpanBERT's linear placement) does not: on short texts it piles coverage onto the head.
    """
    covered = np.zeros(length, dtype=bool)
    _cover(covered, count, mean_span, rng)
    return covered


def _cover(covered: np.ndarray, count: int, mean_span: float, rng: np.random.Generator) -> None:
    """`cover_spans` written into `covered` [length] (all False), draw for draw. A segment holds about
    count / mean_span spans (ten for a 200-byte caption), so they are laid in Python: numpy's per-call cost
    on arrays that short was most of a text step's corruption (4.3 ms of 128 captions, measured)."""
    length = len(covered)
    if count <= 0:
        return
    if count >= length:
        covered[:] = True
        return
    p = 1.0 / max(mean_span, 1.0)
    spans: list[int] = []
    total = 0
    while total < count:  # in batches: about count / mean_span draws in all, rarely a second batch
        drawn = rng.geometric(p, size=int(count * p) + 4).tolist()
        spans += drawn
        total += sum(drawn)
    used, reached = 0, 0
    while reached < count:  # the first span that reaches the count is the last
        reached += spans[used]
        used += 1
    del spans[used:]
    spans[-1] -= reached - count
    free = length - count
    floor = 1 if free >= used else 0
    slack = free - floor * used
    # Stars and bars: S - 1 bars among slack + S - 1 places give a uniform composition of slack into S parts.
    bars = sorted(rng.choice(slack + used - 1, size=used - 1, replace=False).tolist())
    bars.append(slack + used - 1)
    turn = int(rng.integers(0, length))
    at, previous = 0, -1  # at: where the span starts on the unturned circle
    for span, bar in zip(spans, bars, strict=True):
        first = (at + turn) % length
        last = first + span
        covered[first:last] = True
        if last > length:  # it wraps past the cut at position zero
            covered[: last - length] = True
        at += span + bar - previous - 1 + floor  # the span, then its gap
        previous = bar


def corrupt_text(
    tokens: np.ndarray,
    spans: list[tuple[int, int, int]],
    masking: Masking,
    rngs: Sequence[np.random.Generator],
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupts the text content `spans` (row, first column, length) of `tokens` [R, C], span i drawing
    from `rngs[i]` alone (each item's own keyed generator, so an item's corruption does not depend on the
    other items of its step, nor on which device they share).

    Answers (inputs [R, C] int64, covered [R, C] bool); the targets are `tokens[covered]`.
    """
    if len(rngs) != len(spans):
        raise ValueError(f"corrupt_text: {len(spans)} spans need as many generators, got {len(rngs)}")
    inputs = tokens.copy()
    covered = np.zeros(tokens.shape, dtype=bool)
    flat = inputs.reshape(-1)
    width = tokens.shape[1]
    for (r, c0, n), rng in zip(spans, rngs, strict=True):
        k = round(masking.token_mask_probability * n)
        if k <= 0:
            continue
        mask = covered[r, c0 : c0 + n]  # [n] a view: the segment's spans are laid in place
        _cover(mask, k, masking.token_mean_span, rng)
        shuffled = rng.permutation(np.flatnonzero(mask) + (r * width + c0))
        # Both cumulative shares rounded stochastically with one draw: each is exact in expectation even
        # for a three-byte caption, and together they never exceed k.
        u = rng.random()
        n_mask = min(k, int(masking.replace_fraction * k + u))
        n_random = min(k, int((masking.replace_fraction + masking.random_fraction) * k + u)) - n_mask
        flat[shuffled[:n_mask]] = vocab.MASK
        flat[shuffled[n_mask : n_mask + n_random]] = rng.integers(0, vocab.BYTES, size=n_random)
    return inputs, covered
