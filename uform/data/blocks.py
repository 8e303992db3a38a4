"""FlexAttention's block-sparse tables of the document mask, computed on the host from segment ids.

This module needs numpy only (no torch), so the preparer process that prepares steps (`uform.runtime.preparers`) computes the
tables without importing torch; `uform.model.attention` builds the block mask from them.
"""

from __future__ import annotations

import numpy as np

BLOCK = 128
"""FlexAttention's tile side: the block mask marks (query tile, key tile) pairs."""


def block_tables(segments: np.ndarray, block: int = BLOCK) -> dict[str, np.ndarray]:
    """The block-sparse tables of the document mask, computed on the host from segment ids [R, C].

    Segment ids never decrease along a row (slots are numbered in row, column order and padding carries
    the largest id), so every tile holds a contiguous run of ids [lowest, highest], and two tiles share a
    segment exactly when their runs overlap (for any other ids, such as padding at NO_SEGMENT, overlapping
    ranges are still a superset of sharing, so the tables stay correct, only less sparse). A pair of
    tiles is *full* when both are whole tiles holding one and the same segment (no mask needed inside),
    *partial* when their ranges overlap otherwise, and skipped when they do not overlap. Answers
    FlexAttention's (kv_num_blocks [R, 1, Q], kv_indices [R, 1, Q, K]) for the partial and the full
    pairs, Q = K = ceil(C / block) tiles; a last tile cut short by C is never full, as in
    `create_block_mask`.
    """
    columns = segments.shape[1]
    starts = np.arange(0, columns, block)
    lowest = np.minimum.reduceat(segments, starts, axis=1)  # [R, T]
    highest = np.maximum.reduceat(segments, starts, axis=1)  # [R, T]
    whole = np.minimum(starts + block, columns) - starts == block  # [T]
    overlap = (lowest[:, :, None] <= highest[:, None, :]) & (lowest[:, None, :] <= highest[:, :, None])  # [R, Tq, Tk]
    single = (lowest == highest) & whole  # [R, T]
    full = single[:, :, None] & single[:, None, :] & (lowest[:, :, None] == lowest[:, None, :])
    partial = overlap & ~full
    rows, tiles = lowest.shape
    out = {}
    for name, chosen in (("", partial), ("full_", full)):
        # Stable argsort of "not chosen" lists each query tile's chosen key tiles first, in ascending order.
        order = np.argsort(~chosen, axis=2, kind="stable").astype(np.int32)  # [R, Tq, Tk]
        # reshape, not [:, None]: the head axis must carry a real C-order stride. A zero stride (what
        # [:, None] gives, and what torch.from_numpy, .contiguous() and .to() keep) makes the compiled
        # CUDA FlexAttention kernel read the wrong blocks, silently.
        out[f"{name}kv_num_blocks"] = chosen.sum(axis=2).astype(np.int32).reshape(rows, 1, tiles)  # [R, 1, Tq]
        out[f"{name}kv_indices"] = order.reshape(rows, 1, tiles, tiles)  # [R, 1, Tq, Tk]
    return out


UNIFORM_LEAST = 128
"""The shortest segment `uniform_length` answers: short sequences leave dense attention's kernels mostly idle (H200,
`bench/attention.py --sdpa`, forward + backward: cuDNN's over 192 sequences of 64 at 17 TFLOP/s, over 256 of 256 at
144; BENCHMARKS.md "Issue 12, eleventh day"), where FlexAttention packs several segments into one tile."""


def uniform_length(segments: np.ndarray, slots: int) -> int:
    """L where every row [R, C] is C / L whole segments of exactly L positions (ids in [0, slots), no padding, no
    segment in two places), else 0; L < `UNIFORM_LEAST` answers 0 too.

    Such a layout (fixed-length chunks packed edge to edge, as BERT-style pretraining packs text) is the document
    mask of a batch of R C / L independent sequences: attention can run dense over [R C / L, H, L, K] views with
    no mask at all (`model.attention`, kind "uniform")."""
    rows, columns = segments.shape
    if rows == 0 or columns == 0:
        return 0
    first = segments[0]
    changes = np.flatnonzero(first[1:] != first[:-1])
    length = int(changes[0]) + 1 if changes.size else columns
    if length < UNIFORM_LEAST or columns % length:
        return 0
    groups = segments.reshape(-1, length)  # [R C / L, L]: one segment each, if uniform
    heads = groups[:, 0]
    if heads.min() < 0 or heads.max() >= slots or not (groups == heads[:, None]).all():
        return 0
    if np.unique(heads).size != heads.size:  # one id in two groups: a segment longer than L, or split
        return 0
    return length


def equal_length(counts: np.ndarray) -> tuple[int, int]:
    """(N, L) where the N slots that hold positions all hold exactly L, from a batch's positions per slot
    (`Batch.counts` [S], padding not among them), else (0, 0); L < `UNIFORM_LEAST` answers (0, 0) too. A packer
    lays every segment in one run of a row, so such a batch is N separate sequences of L however the rows hold them
    (images of one size, whose 257 positions never tile a row): attention can gather them into [N, H, L, K] and
    run dense, unmasked, forward only (`model.attention`, kind "gathered")."""
    held = counts[counts > 0]
    if held.size == 0:
        return 0, 0
    length = int(held[0])
    if length < UNIFORM_LEAST or (held != length).any():
        return 0, 0
    return int(held.size), length


def gathered_shape(counts: np.ndarray, block: int = BLOCK) -> tuple[int, int]:
    """(N, L) where a forward without gradients on the flex path gathers a batch into dense attention
    (`model.attention`, kind "gathered"): `equal_length`'s N slots of one length L, L not a whole number of tiles
    of `block` (segments that fill whole tiles leave FlexAttention nothing to skip); else (0, 0). The one rule both
    sides read: serving's host stage makes no block tables for such a batch (`data.windows`), and
    `model.inputs.to_device` takes the kind."""
    count, length = equal_length(counts)
    return (0, 0) if length % block == 0 else (count, length)
