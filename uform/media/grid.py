"""Shared geometry of images and video frames: the size that fits a row, and tiling into patches."""

from __future__ import annotations

import functools

import numpy as np


def grid_of(width: int, height: int, patch_side: int) -> tuple[int, int]:
    """Patches along (rows, columns) of a `width` x `height` picture padded to multiples of `patch_side`."""
    return -(-height // patch_side), -(-width // patch_side)


def fit_size(width: int, height: int, patch_side: int, max_units: int) -> tuple[int, int]:
    """The largest (width, height), aspect ratio kept, whose patch grid holds at most `max_units` patches;
    the size itself when it fits (pictures are never upscaled). Each side stays at least one pixel."""
    rows, columns = grid_of(width, height, patch_side)
    if rows * columns <= max_units:
        return width, height
    long_side, short_side = max(width, height), min(width, height)

    def sides(length: int) -> tuple[int, int]:
        other = max(1, min(length, round(short_side * length / long_side)))
        return (length, other) if width >= height else (other, length)

    # The patch count only grows with the long side: binary search the largest long side that fits.
    low, high = 1, long_side
    while low < high:
        middle = (low + high + 1) // 2
        rows, columns = grid_of(*sides(middle), patch_side)
        if rows * columns <= max_units:
            low = middle
        else:
            high = middle - 1
    return sides(low)


def tile(pixels: np.ndarray, patch_side: int) -> np.ndarray:
    """[H, W, C] pixels (or [T, H, W, C] frames), zero-padded on the right and bottom, as [rows * columns,
    patch_side² * C] patches (or [rows * columns, T * patch_side² * C] tubes), row-major."""
    frames = pixels if pixels.ndim == 4 else pixels[None]
    count, height, width, channels = frames.shape
    rows, columns = grid_of(width, height, patch_side)
    padded = frames
    if height % patch_side or width % patch_side:  # whole patches need no zero-padded copy
        padded = np.zeros((count, rows * patch_side, columns * patch_side, channels), dtype=frames.dtype)
        padded[:, :height, :width] = frames
    tubes = padded.reshape(count, rows, patch_side, columns, patch_side, channels).transpose(1, 3, 0, 2, 4, 5)
    # Always a fresh array (where a single patch's transpose is a no-op, a view would hand back the input itself).
    return np.array(tubes, order="C").reshape(rows * columns, count * patch_side * patch_side * channels)


@functools.lru_cache(maxsize=256)  # at most ~6 MB: a grid holds at most a row of units
def positions(times: int, rows: int, columns: int) -> np.ndarray:
    """[times * rows * columns, 3] int64 (time, row, column), time-major then row-major; read-only, one array
    per grid shared by every item of that grid (most of a run's pictures share a few grids)."""
    t, r, c = np.meshgrid(np.arange(times), np.arange(rows), np.arange(columns), indexing="ij")
    out = np.stack([t.ravel(), r.ravel(), c.ravel()], axis=1).astype(np.int64)
    out.flags.writeable = False
    return out


def check_arguments(**values: int) -> None:
    """ValueError unless every named argument is a positive int."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
