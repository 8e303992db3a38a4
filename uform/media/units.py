"""What a decoder answers: one row of values per unit (patch, tube or frame), with its axial position."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np

from ..enums import Modality


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

    key: int | None = None
    """The item's `item_key`, where the decoder computed it from the bytes it decoded (in parallel, off the
    preparing thread); None leaves it to whoever needs it."""

    source: bytes | None = None
    """The JPEG a GPU decoder decodes into these units on the device (serving's `jpeg="device"`,
    `media.jpeg_plan`); `values` is then a placeholder of the right shape that holds no pixels (zero strides)
    and packing leaves their rows for the device to fill. None: `values` holds the units."""

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def owned(self) -> Units:
        """These units in memory of their own: a decoder pool answers views of its processes' shared memory,
        taken until the views go, so units kept for long (a cache) are copied out first."""
        values = self.values if self.source is not None else np.array(self.values)  # a placeholder stays one
        return dataclasses.replace(self, values=values, positions=np.array(self.positions))


def item_key(modality: Modality, content: bytes | memoryview) -> int:
    """A 128-bit digest of an item's modality and bytes: the key of its own draws (corruption, media masks).

    Keying an item's draws by what it is rather than where it sits makes them the same whichever items
    share its step and whichever device or process it lands on, so the world's step is the same function
    for any number of processes. Two equal items of one step draw alike.
    """
    digest = hashlib.blake2b(content, digest_size=16, person=b"uform.item" + bytes([int(modality)]))
    return int.from_bytes(digest.digest(), "little")
