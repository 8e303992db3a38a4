"""Text span corruption for the masked objective (DESIGN.md section 3).

Shape legend: R rows, C columns, P covered positions of the step.

In every text segment of n content bytes, spans of geometric length (mean `token_mean_span`, clipped to
the segment) are drawn at uniform starts until exactly round(token_mask_probability * n) positions are
covered; the span that would overshoot covers only its first uncovered positions. This is T5's and
SpanBERT's span masking with BERT's 80/10/10 split of what a covered position shows: of all covered
positions of the step, round(replace_fraction * P) show MASK, round(random_fraction * P) a uniform random
byte, and the rest keep their byte. Every draw comes from the generator the caller keyed by (seed, step).
"""

from __future__ import annotations

import numpy as np

from .. import vocab
from ..config import Masking


def cover_spans(length: int, count: int, mean_span: float, rng: np.random.Generator) -> np.ndarray:
    """Answers a [length] bool mask with exactly `count` positions covered by geometric spans."""
    covered = np.zeros(length, dtype=bool)
    have = 0
    p = 1.0 / max(mean_span, 1.0)
    for _ in range(64 * max(count, 1)):
        if have >= count:
            return covered
        span = min(int(rng.geometric(p)), length)
        start = int(rng.integers(0, length - span + 1))
        fresh = np.flatnonzero(~covered[start : start + span]) + start
        fresh = fresh[: count - have]
        covered[fresh] = True
        have += len(fresh)
    if have < count:  # vanishingly rare: finish with uniformly chosen free positions
        free = np.flatnonzero(~covered)
        covered[rng.choice(free, size=count - have, replace=False)] = True
    return covered


def corrupt_text(
    tokens: np.ndarray, spans: list[tuple[int, int, int]], masking: Masking, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupts the text content `spans` (row, first column, length) of `tokens` [R, C].

    Answers (inputs [R, C] int64, covered [R, C] bool); the targets are `tokens[covered]`.
    """
    inputs = tokens.copy()
    covered = np.zeros(tokens.shape, dtype=bool)
    for r, c0, n in spans:
        k = round(masking.token_mask_probability * n)
        if k > 0:
            covered[r, c0 : c0 + n] = cover_spans(n, k, masking.token_mean_span, rng)
    where = np.flatnonzero(covered.reshape(-1))
    total = len(where)
    shuffled = rng.permutation(where)
    n_mask = round(masking.replace_fraction * total)
    n_random = min(round(masking.random_fraction * total), total - n_mask)
    flat = inputs.reshape(-1)
    flat[shuffled[:n_mask]] = vocab.MASK
    flat[shuffled[n_mask : n_mask + n_random]] = rng.integers(0, vocab.BYTES, size=n_random)
    return inputs, covered
