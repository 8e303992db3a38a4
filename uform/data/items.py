"""A step's items as callers hand them in, checked and normalised before anything runs.

`modalities`: a sequence of `Modality` (or their words / integer values), one per item.
`contents`: a sequence of bytes-like or `str` (UTF-8), one per item, or a `(data, offsets)` tape of numpy
arrays (data: uint8 [bytes], offsets: integers [items + 1], non-decreasing from 0 to len(data)).
Per-item sequences of the step config (`bags`, `temperature_groups`, `sides`) are checked here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..enums import LateInteractionSide, Modality


def is_tape(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], np.ndarray)
        and isinstance(value[1], np.ndarray)
    )


def tape_items(data: Any, offsets: Any, field: str) -> list[memoryview]:
    """Splits a (data, offsets) tape into per-item views, checking its shape."""
    data = np.asarray(data)
    offsets = np.asarray(offsets)
    if data.ndim != 1 or data.dtype != np.uint8:
        raise TypeError(f"{field}: a tape's data must be a 1-D uint8 array, got {data.dtype} of {data.ndim} dims")
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise TypeError(f"{field}: a tape's offsets must be a 1-D integer array, got {offsets.dtype}")
    if len(offsets) == 0 or offsets[0] != 0:
        raise ValueError(f"{field}: a tape's offsets must start at 0 and hold items + 1 entries")
    if np.any(np.diff(offsets) < 0):
        raise ValueError(f"{field}: a tape's offsets must be non-decreasing")
    if offsets[-1] != len(data):
        raise ValueError(f"{field}: a tape's offsets must end at len(data) = {len(data)}, got {offsets[-1]}")
    view = memoryview(np.ascontiguousarray(data))  # type: ignore[arg-type]
    return [view[int(a) : int(b)] for a, b in itertools.pairwise(offsets)]


def parse_modalities(modalities: Any) -> list[Modality]:
    if isinstance(modalities, (str, bytes)) or not isinstance(modalities, (Sequence, np.ndarray)):
        raise TypeError(f"modalities: expected a sequence of Modality, got {type(modalities).__name__}")
    return [Modality.parse(m, f"modalities[{i}]") for i, m in enumerate(modalities)]  # type: ignore[misc]


def parse_contents(contents: Any, count: int) -> list[bytes | memoryview]:
    """Per-item bytes; `count` is the number of modalities, which the contents must match."""
    if is_tape(contents):
        items: list[bytes | memoryview] = list(tape_items(contents[0], contents[1], "contents"))
    elif isinstance(contents, (str, bytes, bytearray, memoryview)) or not isinstance(contents, Sequence):
        raise TypeError(
            f"contents: expected a sequence of bytes or str per item, or a (data, offsets) tape, "
            f"got {type(contents).__name__}"
        )
    else:
        items = []
        for i, c in enumerate(contents):
            if isinstance(c, str):
                items.append(c.encode("utf-8"))
            elif isinstance(c, bytes):
                items.append(c)
            elif isinstance(c, np.ndarray):
                if c.dtype != np.uint8 or c.ndim != 1:
                    raise TypeError(f"contents[{i}]: an array item must be 1-D uint8, got {c.dtype} of {c.ndim} dims")
                items.append(memoryview(np.ascontiguousarray(c)))  # type: ignore[arg-type]
            elif isinstance(c, (bytearray, memoryview)):
                view = memoryview(c)
                items.append(view.cast("B") if view.c_contiguous else view.tobytes())
            else:
                raise TypeError(f"contents[{i}]: expected bytes-like or str, got {type(c).__name__}")
    if len(items) != count:
        raise ValueError(f"contents: {len(items)} items, but modalities names {count}; they must be the same length")
    return items


def per_item_integers(values: Any, count: int, field: str, below: int | None = None) -> np.ndarray | None:
    """A per-item integer sequence: empty answers None; else exactly `count` values in [0, below)."""
    if values is None or len(values) == 0:
        return None
    array = np.asarray(values)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.dtype == object):
        raise TypeError(f"{field}: expected a sequence of integers")
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in array.tolist()):
        raise TypeError(f"{field}: expected a sequence of integers")
    if len(array) != count:
        raise ValueError(f"{field}: {len(array)} values, but the step has {count} items; it must be empty or as long")
    array = array.astype(np.int64)
    if np.any(array < 0):
        raise ValueError(f"{field}: values must not be negative")
    if below is not None and np.any(array >= below):
        raise ValueError(f"{field}: values must lie below {below}, got {int(array.max())}")
    return array


def parse_sides(sides: Any, count: int) -> list[LateInteractionSide] | None:
    if sides is None or len(sides) == 0:
        return None
    if len(sides) != count:
        raise ValueError(f"sides: {len(sides)} values, but the step has {count} items; it must be empty or as long")
    return [LateInteractionSide.parse(s, f"sides[{i}]") for i, s in enumerate(sides)]  # type: ignore[misc]
