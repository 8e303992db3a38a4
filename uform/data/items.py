"""A step's items as callers hand them in, checked and normalised before anything runs.

`modalities`: a sequence of `Modality` (or their words / integer values), one per item.
`contents`: a sequence of bytes-like or `str` (UTF-8), one per item, or a `(data, offsets)` tape of numpy
arrays (data: uint8 [bytes], offsets: integers [items + 1], non-decreasing from 0 to len(data)).
Per-item sequences of the step config (`bags`, `temperature_groups`, `sides`) are checked here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
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
    if np.any(offsets[1:] < offsets[:-1]):  # compared, not differenced: a uint64 difference wraps round
        raise ValueError(f"{field}: a tape's offsets must be non-decreasing")
    if offsets[-1] != len(data):
        raise ValueError(f"{field}: a tape's offsets must end at len(data) = {len(data)}, got {offsets[-1]}")
    view = memoryview(np.ascontiguousarray(data))  # type: ignore[arg-type]
    return [view[int(a) : int(b)] for a, b in itertools.pairwise(offsets)]


def utf8(text: str, field: str) -> bytes:
    """`text` as UTF-8; a lone surrogate (which UTF-8 cannot hold) is a `ValueError` naming `field`."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{field}: not valid Unicode text: {error.reason} at character {error.start} "
            f"({text[error.start]!r}); pass bytes to train on raw bytes"
        ) from None


def parse_modalities(modalities: Any) -> list[Modality]:
    if isinstance(modalities, (str, bytes)) or not isinstance(modalities, (Sequence, np.ndarray)):
        raise TypeError(f"modalities: expected a sequence of Modality, got {type(modalities).__name__}")
    # Each distinct word parsed once (a call's modalities are a few words repeated: 4,096 parsed one by one took
    # 13.6 ms on a 2-core machine, 0.62 so), keyed by type as well, so that 1 and True stay apart.
    parsed: dict[tuple[type, Any], Modality] = {}
    out = []
    for i, m in enumerate(modalities):
        try:
            key = (type(m), m)
            out.append(parsed[key])
        except KeyError:
            out.append(parsed.setdefault(key, Modality.parse(m, f"modalities[{i}]")))
        except TypeError:  # unhashable: parse names its type
            out.append(Modality.parse(m, f"modalities[{i}]"))
    return out


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
                items.append(utf8(c, f"contents[{i}]"))
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


def _per_item(values: Any, field: str) -> list[Any] | None:
    """A per-item sequence's values as a list, None when absent or empty; anything that is not a sequence
    (a bare int, a string, a set, a generator) is a `TypeError` naming `field`."""
    if values is None:
        return None
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise TypeError(f"{field}: expected a flat sequence, one value per item, got {values.ndim} dims")
        return values.tolist() or None
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Sequence):
        raise TypeError(f"{field}: expected a sequence with one value per item, got {type(values).__name__}")
    return list(values) or None


def per_item_integers(values: Any, count: int, field: str, below: int | None = None) -> np.ndarray | None:
    """A per-item integer sequence: empty answers None; else exactly `count` values in [0, below).

    Checked on the Python values before any conversion, so a value past int64 is a `ValueError` naming
    `field[i]`, never an `OverflowError` (nor a uint64 wrapped to a negative int64)."""
    listed = _per_item(values, field)
    if listed is None:
        return None
    for i, v in enumerate(listed):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{field}[{i}]: expected an int, got {type(v).__name__}")
    if len(listed) != count:
        raise ValueError(f"{field}: {len(listed)} values, but the step has {count} items; it must be empty or as long")
    limit = 2**63 if below is None else min(below, 2**63)
    for i, v in enumerate(listed):
        if int(v) < 0:
            raise ValueError(f"{field}[{i}]: must not be negative, got {int(v)}")
        if int(v) >= limit:
            raise ValueError(f"{field}[{i}]: must lie below {limit}, got {int(v)}")
    return np.array([int(v) for v in listed], dtype=np.int64)


def parse_sides(sides: Any, count: int) -> list[LateInteractionSide] | None:
    listed = _per_item(sides, "sides")
    if listed is None:
        return None
    if len(listed) != count:
        raise ValueError(f"sides: {len(listed)} values, but the step has {count} items; it must be empty or as long")
    return [LateInteractionSide.parse(s, f"sides[{i}]") for i, s in enumerate(listed)]  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# Choices: each item's legal bytes and their target probabilities, as two (data, offsets) tapes

CHOICE_SUM_TOLERANCE = 1e-3
"""How far an item's target probabilities may sum from one."""


@dataclass
class ChoiceTapes:
    """A step's checked choices, owned (never the caller's buffers): item i offers the legal bytes
    `data[offsets[i]:offsets[i + 1]]` with the target probabilities `targets[...]` of the same slice,
    renormalised to sum to one exactly (in float64, then stored as float32)."""

    data: np.ndarray
    """[T] uint8: every item's legal bytes, back to back."""
    offsets: np.ndarray
    """[N + 1] int64."""
    targets: np.ndarray
    """[T] float32."""

    def of(self, item: int) -> tuple[np.ndarray, np.ndarray]:
        """(legal bytes, targets) of one item; both empty when it makes no choice."""
        a, b = int(self.offsets[item]), int(self.offsets[item + 1])
        return self.data[a:b], self.targets[a:b]

    def offers(self, item: int) -> bool:
        return int(self.offsets[item + 1]) > int(self.offsets[item])


def _is_empty_tape(value: Any) -> bool:
    """None, an empty sequence, a pair of empty sequences (the config's default `((), ())`), or a tape
    whose offsets are empty: "empty offsets make no choices"."""
    if value is None:
        return True
    if isinstance(value, np.ndarray):
        return value.size == 0
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        return False
    if len(value) == 0:
        return True
    if isinstance(value, tuple) and len(value) == 2:
        data, offsets = value
        sized = all(isinstance(v, (Sequence, np.ndarray)) for v in (data, offsets))
        return sized and len(offsets) == 0 and (len(data) == 0 or isinstance(offsets, np.ndarray))
    return False


def _tape_offsets(offsets: Any, size: int, count: int, field: str) -> np.ndarray:
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise TypeError(f"{field}: a tape's offsets must be a 1-D integer array, got {offsets.dtype}")
    if len(offsets) != count + 1:
        raise ValueError(f"{field}: a tape's offsets must hold items + 1 = {count + 1} entries, got {len(offsets)}")
    if offsets[0] != 0:
        raise ValueError(f"{field}: a tape's offsets must start at 0, got {int(offsets[0])}")
    falls = offsets[1:] < offsets[:-1]  # compared, not differenced: a uint64 difference wraps round
    if np.any(falls):
        at = int(np.argmax(falls))
        raise ValueError(
            f"{field}: a tape's offsets must be non-decreasing, got {int(offsets[at])} then {int(offsets[at + 1])}"
        )
    if offsets[-1] != size:
        raise ValueError(f"{field}: a tape's offsets must end at len(data) = {size}, got {int(offsets[-1])}")
    return offsets.astype(np.int64)


def _choice_bytes(value: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(data uint8, offsets int64) of `choices` in either form, shapes checked."""
    if is_tape(value):
        data = value[0]
        if data.ndim != 1 or data.dtype != np.uint8:
            raise TypeError(f"choices: a tape's data must be a 1-D uint8 array, got {data.dtype} of {data.ndim} dims")
        return data.copy(), _tape_offsets(value[1], len(data), count, "choices")
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        raise TypeError(
            f"choices: expected a (data, offsets) tape of numpy arrays or a sequence of bytes per item, "
            f"got {type(value).__name__}"
        )
    if len(value) != count:
        raise ValueError(f"choices: {len(value)} entries, but the step has {count} items; it must be empty or as long")
    parts = []
    for i, entry in enumerate(value):
        if isinstance(entry, str):
            parts.append(np.frombuffer(utf8(entry, f"choices[{i}]"), dtype=np.uint8))
        elif isinstance(entry, (bytes, bytearray, memoryview)):
            parts.append(np.frombuffer(memoryview(entry).tobytes(), dtype=np.uint8))
        elif isinstance(entry, np.ndarray) and entry.dtype == np.uint8 and entry.ndim == 1:
            parts.append(entry)
        else:
            raise TypeError(
                f"choices[{i}]: expected bytes-like (one legal byte each) or str, got {type(entry).__name__}"
            )
    offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
    data = np.concatenate(parts).astype(np.uint8) if parts else np.zeros(0, dtype=np.uint8)
    return data, offsets


def _choice_targets(value: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(data float64, offsets int64) of `choice_targets` in either form, shapes checked."""
    if is_tape(value):
        data = value[0]
        if data.ndim != 1 or data.dtype.kind not in "fiu":
            raise TypeError(
                f"choice_targets: a tape's data must be a 1-D array of real numbers, got {data.dtype} of {data.ndim} dims"
            )
        return data.astype(np.float64), _tape_offsets(value[1], len(data), count, "choice_targets")
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        raise TypeError(
            f"choice_targets: expected a (data, offsets) tape of numpy arrays or a sequence of float sequences "
            f"per item, got {type(value).__name__}"
        )
    if len(value) != count:
        raise ValueError(
            f"choice_targets: {len(value)} entries, but the step has {count} items; it must be as long as choices"
        )
    parts = []
    for i, entry in enumerate(value):
        if isinstance(entry, (str, bytes, bytearray, memoryview)) or not isinstance(entry, (Sequence, np.ndarray)):
            raise TypeError(f"choice_targets[{i}]: expected a sequence of probabilities, got {type(entry).__name__}")
        if any(isinstance(v, (bool, np.bool_)) for v in entry):
            raise TypeError(f"choice_targets[{i}]: expected real numbers, got a bool")
        try:
            array = np.asarray(entry, dtype=np.float64)
        except OverflowError:
            raise ValueError(f"choice_targets[{i}]: a target probability is past the float range") from None
        except (TypeError, ValueError):
            raise TypeError(f"choice_targets[{i}]: expected a flat sequence of real numbers") from None
        if array.ndim != 1:
            raise TypeError(f"choice_targets[{i}]: expected a flat sequence of real numbers, got {array.ndim} dims")
        parts.append(array)
    offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
    data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)
    return data, offsets


def parse_choices(choices: Any, targets: Any, modalities: Sequence[Modality], max_choices: int) -> ChoiceTapes | None:
    """A step's `choices` and `choice_targets`, checked against its items; None when it offers none.

    Raises `ValueError` (or `TypeError` for a wrong type) naming `choices` / `choice_targets` and the
    rule: offsets of items + 1 entries, from 0, non-decreasing, to the data's end; each item's legal
    bytes unique and at most `max_choices` (`batch.max_choices_per_item`); only text items offer
    choices; targets as long as their choices, finite, non-negative, each item's summing to one within
    `CHOICE_SUM_TOLERANCE`. Reads, never writes, its input.
    """
    count = len(modalities)
    if _is_empty_tape(choices):
        if not _is_empty_tape(targets):
            raise ValueError("choice_targets: given without choices; both must be empty or both given")
        return None
    data, offsets = _choice_bytes(choices, count)
    if _is_empty_tape(targets):
        raise ValueError("choice_targets: choices are given, so every choice needs its target probability")
    values, target_offsets = _choice_targets(targets, count)
    for i in range(count):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if b == a:
            continue
        if modalities[i] != Modality.Text:
            raise ValueError(f"choices[{i}]: a {modalities[i]} item cannot offer choices; only text items do")
        legal = data[a:b]
        if b - a > max_choices:
            raise ValueError(
                f"choices[{i}]: offers {b - a} legal bytes, more than batch.max_choices_per_item ({max_choices})"
            )
        if len(np.unique(legal)) != len(legal):
            seen = np.unique(legal, return_counts=True)
            repeated = int(seen[0][np.argmax(seen[1] > 1)])
            raise ValueError(f"choices[{i}]: legal bytes must be unique, byte {repeated} appears twice")
    if not np.array_equal(offsets, target_offsets):
        at = int(np.argmax(np.diff(offsets) != np.diff(target_offsets)))
        raise ValueError(
            f"choice_targets[{at}]: holds {int(target_offsets[at + 1] - target_offsets[at])} targets, but "
            f"choices[{at}] offers {int(offsets[at + 1] - offsets[at])}; each entry must be as long as its choices"
        )
    if not np.all(np.isfinite(values)):
        raise ValueError("choice_targets: every target probability must be finite")
    if np.any(values < 0):
        raise ValueError(f"choice_targets: target probabilities must not be negative, got {float(values.min())}")
    sums = np.array([values[int(a) : int(b)].sum() for a, b in itertools.pairwise(offsets)])
    for i in range(count):
        if offsets[i + 1] > offsets[i] and abs(sums[i] - 1.0) > CHOICE_SUM_TOLERANCE:
            raise ValueError(
                f"choice_targets[{i}]: the target probabilities must sum to one (within {CHOICE_SUM_TOLERANCE}), "
                f"got {sums[i]:.6g}"
            )
    normalised = values.copy()
    for i in range(count):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if b > a:
            normalised[a:b] /= sums[i]
    return ChoiceTapes(data=data, offsets=offsets, targets=normalised.astype(np.float32))
