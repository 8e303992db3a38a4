"""The arguments of the serving verbs (`uform.serve`, `uform.encode_file`, `uform.onnx_encoder.OnnxEncoder`),
checked: each refusal names its field and its rule, a `TypeError` for the wrong kind of value and a `ValueError`
for a value out of its range, before the call changes anything.

Shape legend: N items of a call, T token vectors of a call, W a token vector's width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .data.items import is_tape, parse_sides, tape_items
from .enums import LateInteractionSide
from .replica.checkpoint import ProgressCallback

__all__ = [
    "ERRORS",
    "ProgressCallback",
    "check_errors",
    "check_progress",
    "check_width",
    "natural",
    "parse_choices",
    "parse_side",
    "parse_texts",
    "precision_bf16",
    "vectors_tape",
]

ERRORS = ("raise", "mask")
"""What a call does with a media item it cannot embed (`errors`): raise `MediaError`, or answer a mask."""


def natural(value: Any, field: str) -> int:
    """`value` as a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{field}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{field}: must not be negative, got {value}")
    return int(value)


def precision_bf16(precision: str | None, device: torch.device) -> bool:
    """Whether the forward runs under bf16 autocast: "bf16", "f32", or None (bf16 on CUDA, f32 elsewhere)."""
    if precision is None:
        return device.type == "cuda"
    if precision not in ("bf16", "f32"):
        raise ValueError(f"precision: expected 'bf16', 'f32' or None, got {precision!r}")
    return precision == "bf16"


def check_width(width: Any, hidden: int) -> int:
    """A Matryoshka width: an int in [1, hidden] (None, the full width, is the caller's to derive)."""
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise TypeError(f"width: expected an int or None, got {type(width).__name__}")
    if not 1 <= width <= hidden:
        raise ValueError(f"width: must lie in [1, hidden = {hidden}], got {width}")
    return int(width)


def check_errors(errors: Any) -> str:
    """One of `ERRORS`."""
    if not isinstance(errors, str):
        raise TypeError(f"errors: expected one of {ERRORS}, got {type(errors).__name__}")
    if errors not in ERRORS:
        raise ValueError(f"errors: expected one of {ERRORS}, got {errors!r}")
    return errors


def check_progress(progress: Any, progress_steps: Any) -> int:
    """The reports a call makes at most (zero derives ten), once `progress` is a callable or None."""
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected a callable or None, got {type(progress).__name__}")
    return natural(progress_steps, "progress_steps") or 10


def parse_side(side: Any, count: int) -> list[LateInteractionSide]:
    """One side for every item (a `LateInteractionSide`, its word or value) or a sequence of one per item;
    never `None_`, which takes no part in late interaction."""
    if isinstance(side, (LateInteractionSide, str, int)):
        sides = [LateInteractionSide.parse(side, "side")] * count
        field = "side"
    elif isinstance(side, (Sequence, np.ndarray)):
        if len(side) != count:
            raise ValueError(f"side: {len(side)} values, but the call has {count} items; give one side or one per item")
        sides = parse_sides(side, count) or []
        field = "side[{}]"
    else:
        raise TypeError(f"side: expected a LateInteractionSide or one per item, got {type(side).__name__}")
    for i, s in enumerate(sides):
        if s == LateInteractionSide.None_:
            raise ValueError(
                f"{field.format(i)}: an item of side None takes no part in late interaction; "
                "ask for Query, Document or QueryAndDocument"
            )
    return sides


def parse_texts(texts: Any) -> list[bytes | memoryview]:
    """`text_choose`'s texts: a sequence of bytes-like or str (UTF-8), or a (data, offsets) tape."""
    if is_tape(texts):
        return list(tape_items(texts[0], texts[1], "texts"))
    if isinstance(texts, (str, bytes, bytearray, memoryview)) or not isinstance(texts, Sequence):
        raise TypeError(
            f"texts: expected a sequence of bytes or str, or a (data, offsets) tape, got {type(texts).__name__}"
        )
    out: list[bytes | memoryview] = []
    for i, t in enumerate(texts):
        if isinstance(t, str):
            out.append(t.encode("utf-8"))
        elif isinstance(t, (bytes, bytearray, memoryview)):
            out.append(bytes(t))
        else:
            raise TypeError(f"texts[{i}]: expected bytes-like or str, got {type(t).__name__}")
    return out


def parse_choices(choices: Any, count: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    """The legal bytes of each of `count` items as (uint8 data, int64 offsets [count + 1]): at least one and at
    most `most` distinct bytes an item."""
    if is_tape(choices):
        parts = [np.frombuffer(v, dtype=np.uint8) for v in tape_items(choices[0], choices[1], "choices")]
    elif isinstance(choices, (str, bytes, bytearray, memoryview)) or not isinstance(choices, Sequence):
        raise TypeError(
            f"choices: expected a (data, offsets) tape or a sequence of legal bytes per item, got {type(choices).__name__}"
        )
    else:
        parts = []
        for i, c in enumerate(choices):
            if isinstance(c, str):
                c = c.encode("utf-8")
            if isinstance(c, (bytes, bytearray, memoryview)):
                parts.append(np.frombuffer(bytes(c), dtype=np.uint8))
            elif isinstance(c, np.ndarray) and c.dtype == np.uint8 and c.ndim == 1:
                parts.append(c.copy())
            else:
                raise TypeError(f"choices[{i}]: expected bytes-like (one legal byte each), got {type(c).__name__}")
    if len(parts) != count:
        raise ValueError(f"choices: {len(parts)} items, but texts has {count}; they must be the same length")
    for i, p in enumerate(parts):
        if len(p) == 0:
            raise ValueError(f"choices[{i}]: an item needs at least one legal byte")
        if len(p) > most:
            raise ValueError(f"choices[{i}]: {len(p)} legal bytes, more than max_choices_per_item = {most}")
        if len(np.unique(p)) != len(p):
            raise ValueError(f"choices[{i}]: each legal byte may appear once, got {bytes(p)!r}")
    offsets = np.zeros(count + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return data.astype(np.uint8), offsets


def vectors_tape(tape: Any, field: str) -> tuple[Tensor, np.ndarray]:
    """A (data [T, W] float, offsets [N + 1] rising from 0 to T) tape of vectors, as `Model.tokens` answers it."""
    if not (isinstance(tape, tuple) and len(tape) == 2):
        raise TypeError(f"{field}: expected a (data, offsets) tape, as tokens answers it")
    data, offsets = tape
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if not isinstance(data, Tensor) or data.ndim != 2:
        raise TypeError(f"{field}: a tape's data must be a [vectors, width] tensor or array")
    if not data.is_floating_point():
        raise TypeError(f"{field}: a tape's data must hold float vectors, got {data.dtype}")
    offsets = offsets.numpy() if isinstance(offsets, Tensor) else np.asarray(offsets)
    if offsets.ndim != 1 or len(offsets) == 0 or offsets.dtype.kind not in "iu":
        raise TypeError(f"{field}: a tape's offsets must be a flat integer array of items + 1 entries")
    if offsets[0] != 0 or offsets[-1] != data.shape[0] or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{field}: a tape's offsets must rise from 0 to len(data) = {data.shape[0]}")
    return data, offsets.astype(np.int64)
