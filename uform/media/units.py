"""What a decoder answers: one row of values per unit (patch, tube or frame), with its axial position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Units:
    """Decoded units of one media item.

    Images and video give uint8 values (each patch laid out [patch_side, patch_side, channels], each tube
    [tube_frames, patch_side, patch_side, channels]); audio gives float32 frames of `chunk_samples`.
    """

    values: np.ndarray
    """[N, F] uint8 (image, video) or float32 (audio), one row per unit (patch, tube, frame)."""

    positions: np.ndarray
    """[N, 3] int64 axial (time, row, column) positions, from 0; audio frame n sits at (n, n, n)."""

    grid: tuple[int, int, int]
    """Units along (time, rows, columns)."""

    truncated: bool
    """Whether the item was cut (video in time, audio in length) to fit `max_units`."""

    def __len__(self) -> int:
        return int(self.values.shape[0])
