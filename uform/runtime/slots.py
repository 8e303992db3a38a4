"""The slots of a host-stage process (a trainer's preparer processes, `uform.runtime.preparers`, and a serving
model's host processes, `uform.runtime.serve_host`): how a job crosses into a slot's input area and its answer out
of the slot's output area, both areas of the process's shared-memory slab (`uform.runtime.helper`).

A job's items are copied once, back to back, into the input area (`write_contents`) and read there as views
(`contents_views`); its enums cross as int8 codes (`enum_codes`, `enum_members`). Its answer's media arrays are
built straight into the output area (`Built`, the `data.batch.Alloc` of a prepared step or batch), so the answer
names them where they lie and copies only the rest. Pages are reserved before they are written
(``posix_fallocate``, `uform.runtime.slab.reserve_area`): what finds no room crosses the pipe instead.
"""

from __future__ import annotations

import enum
import itertools
import pickle
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from .child import START_METHOD
from .helper import Endpoint
from .slab import SLAB_ALIGN, reserve_area

__all__ = [
    "DECODER_CONTEXT",
    "DECODER_PRELOAD",
    "IN_BAND_BELOW",
    "Built",
    "contents_views",
    "enum_codes",
    "enum_members",
    "write_contents",
]

IN_BAND_BELOW = 4096
"""Buffers smaller than this travel inside the pickled message rather than through the slab."""

# A host-stage process's main module is uform.runtime.child's boot, so multiprocessing's fork server may start its
# decoders: it re-imports nothing of the user's, and preloads the decoding libraries once for all of them.
DECODER_CONTEXT = "forkserver" if sys.platform.startswith("linux") else START_METHOD
DECODER_PRELOAD = ["uform.media.decode", "uform.media.image", "uform.media.video", "uform.media.audio"]

E = TypeVar("E", bound=enum.IntEnum)


def write_contents(
    slab: Any, fd: int | None, reserved: list[int], index: int, start: int, room: int, contents: Sequence[Any]
) -> tuple[np.ndarray, list[pickle.PickleBuffer] | None]:
    """Items' bytes copied once, back to back, into area `index` of a helper's slab, `room` bytes from `start` (its
    pages reserved first, `reserve_area`): answers (offsets [N + 1], None). Where they do not fit, or there is no
    slab or no room in /dev/shm: (offsets, the items as pickle buffers), to cross in band, pickled straight from the
    caller's buffers (still the one copy). `contents_views` reads them on the other side."""
    offsets = np.zeros(len(contents) + 1, dtype=np.int64)
    np.cumsum(np.fromiter((len(c) for c in contents), dtype=np.int64, count=len(contents)), out=offsets[1:])
    total = int(offsets[-1])
    if slab is None or total > room or not reserve_area(fd, reserved, index, start, total):
        return offsets, [pickle.PickleBuffer(c) for c in contents]
    for content, a, b in zip(contents, offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        slab[start + a : start + b] = content
    return offsets, None


def enum_codes(members: Sequence[enum.IntEnum]) -> np.ndarray:
    """[N] int8: the values of enum members (a job's modalities or sides), to cross to a helper process."""
    return np.fromiter((int(m) for m in members), dtype=np.int8, count=len(members))


def enum_members(codes: np.ndarray, kind: type[E]) -> list[E]:
    """The members `enum_codes` wrote, through a table (an enum call per item took 1.48 ms for 2,048 items on a
    2-core machine, the table 0.09)."""
    table = {int(m): m for m in kind}
    return [table[c] for c in codes.tolist()]


def contents_views(
    slab: Any, start: int, offsets: np.ndarray | None, inline: Sequence[Any] | None
) -> Sequence[bytes | memoryview]:
    """The items `write_contents` wrote at `start` of the slab, as views of it (no copy), or those that crossed in
    band."""
    if inline is not None:
        return inline
    assert slab is not None and offsets is not None
    view = memoryview(slab)[start : start + int(offsets[-1])]
    return [view[a:b] for a, b in itertools.pairwise(offsets.tolist())]


class Built:
    """The `data.batch.Alloc` of a step prepared in a preparer process (and of a serving batch packed in a serving
    host process, `uform.runtime.serve_host`): the step's media arrays (its largest by
    far: 32 MiB of image patches at the reference geometry) are built straight into its slot's output area, one
    after the other from its start, so its answer names them where they lie and copies only the rest
    (`write_out_of_band`'s ``placed``). Pages are reserved first; an array that finds no room is made in this
    process's memory and copied in with the rest. The trainer's process is done with the area's previous answer
    before the slot's next step is sent (`Preparers.prepare` frees a slot only once its answer came back and was
    copied), so nothing here writes over bytes still read."""

    def __init__(self, slab: Any, fd: int | None, reserved: list[int], slot: int, start: int, end: int) -> None:
        self.slab, self.fd, self.reserved, self.slot = slab, fd, reserved, slot
        self.start, self.end = start, end
        self.at = start  # the end of the arrays built so far (aligned)

    def __call__(self, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * np.dtype(dtype).itemsize
        after = self.at + -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN
        room = self.slab is not None and nbytes > 0 and after <= self.end
        if not room or not reserve_area(self.fd, self.reserved, self.slot, self.start, after - self.start):
            return np.empty(shape, dtype)
        array = np.frombuffer(self.slab, dtype=dtype, count=count, offset=self.at).reshape(shape)
        self.at = after
        return array

    def reply(self, endpoint: Endpoint, ident: int, answer: Any) -> None:
        """Sends `answer`, whose arrays built here are named where they lie and whose other large buffers are
        copied into the area after them (pages reserved as they go; what finds no room crosses in band)."""
        at, start, end, slot = self.at, self.start, self.end, self.slot
        endpoint.reply(
            ident,
            answer,
            area=(at, end),
            reserve=lambda length: reserve_area(self.fd, self.reserved, slot, start, at - start + length),
            in_band_below=IN_BAND_BELOW,
            placed=(start, at),
        )
