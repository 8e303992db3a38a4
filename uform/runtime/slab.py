"""A slab: a file of shared memory that a helper process and its owner both map, so large buffers cross
between them as one memcpy instead of through a pipe.

A pipe moves 64 KiB per round trip between two processes, which made the owner of a 16-process decode pool the
bottleneck (about 0.45 GB/s in all); a slab is a memcpy. A slab's file lives under /dev/shm and is unlinked as
soon as it is made: the other process maps it through a duplicate of its descriptor passed when that process
starts (`SlabFile`), so no name outlives a process killed at any moment, and its pages go with the last
descriptor and mapping.

A message crosses a slab as pickle protocol 5 (`write_out_of_band`): its large buffers (numpy arrays,
`pickle.PickleBuffer`) are written into an area of the slab, and the small pickled rest names where they lie;
`read_out_of_band` unpickles around them, as copies or as views of the slab. Pages are reserved before they are
written where the writer has the descriptor (``posix_fallocate``, `reserve_area`), so a full /dev/shm sends the
message through the pipe instead of killing a process with SIGBUS.

Standard library only: the decode pool's workers import it before anything else.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import tempfile
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

__all__ = [
    "SLAB_ALIGN",
    "SlabFile",
    "create_slab",
    "read_out_of_band",
    "release_slab",
    "reserve_area",
    "reserve_slab",
    "write_out_of_band",
]

SLAB_FOLDER = "/dev/shm"
SLAB_ALIGN = 64
"""Every buffer in a slab starts at a multiple of this many bytes."""

Spans = list[tuple[int, int]]
"""Where a message's out-of-band buffers lie in a slab: (offset, length) each, in pickling order."""


def create_slab(size: int, prefix: str = "uform-slab-") -> tuple[mmap.mmap | None, int | None]:
    """A fresh zero-filled (sparse) slab of `size` bytes under /dev/shm, mapped here: (mapping, open descriptor),
    or (None, None) where there is none. Its file is unlinked at once (see the module's docstring)."""
    if not os.path.isdir(SLAB_FOLDER):
        return None, None
    try:
        fd, path = tempfile.mkstemp(prefix=prefix, dir=SLAB_FOLDER)
    except OSError:
        return None, None
    with contextlib.suppress(OSError):
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size), fd
    except (OSError, ValueError, OverflowError):
        os.close(fd)
        return None, None


class SlabFile:
    """A slab's descriptor as an argument of a helper process, so the slab needs no name on the file system: a
    `uform.runtime.child.Child` inherits it under the same number (``inherited_fd``), and for a process that
    `multiprocessing` starts it pickles as a duplicate sent to the child (as a `Connection` does)."""

    inherited_fd = True  # uform.runtime.child's mark: crosses to a Child as `fd`, rebuilt there as SlabFile(fd)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_slab_file, (reduction.DupFd(self.fd),)  # only while a process is being started

    def map(self, size: int) -> mmap.mmap:
        return mmap.mmap(self.fd, size)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _rebuild_slab_file(duplicate: Any) -> SlabFile:
    return SlabFile(duplicate.detach())


def reserve_slab(fd: int, offset: int, length: int) -> bool:
    """Backs `length` bytes of a slab file from `offset` with memory now (``posix_fallocate``), so that writing
    them cannot fault with SIGBUS when /dev/shm is full; False when there is no room (the caller sends in band)."""
    if length <= 0:
        return True
    try:
        os.posix_fallocate(fd, offset, length)
    except (OSError, AttributeError):  # ENOSPC, or no posix_fallocate on this platform
        return False
    return True


def reserve_area(fd: int | None, reserved: list[int], index: int, start: int, length: int) -> bool:
    """Backs the first `length` bytes of area `index` of a slab file, which begins at `start`, with memory
    (`reserve_slab`); `reserved[index]` counts the bytes already backed and grows (an area keeps its pages, so
    each byte is reserved once). False when there is no room, or no file."""
    if length <= reserved[index]:
        return True
    if fd is None or not reserve_slab(fd, start + reserved[index], length - reserved[index]):
        return False
    reserved[index] = length
    return True


def release_slab(slab: mmap.mmap | None) -> None:
    """Closes a slab's mapping (unless views of it live on: it then goes with the last of them)."""
    if slab is not None:
        with contextlib.suppress(BufferError, ValueError):
            slab.close()


def write_out_of_band(
    message: Any,
    slab: mmap.mmap,
    start: int = 0,
    end: int | None = None,
    reserve: Callable[[int], bool] | None = None,
    in_band_below: int = 0,
) -> tuple[bytes, Spans] | None:
    """(header, spans): `message` pickled with its out-of-band buffers (those of `in_band_below` bytes or more)
    written into `slab[start:end]`; None when it has none, or they do not fit, or `reserve(length)` (which backs
    the first `length` bytes of that area) says there is no room: the message then crosses whole. Raises what
    pickling raises (a non-contiguous buffer too, which cannot go out of band)."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        with buffer.raw() as raw:
            if raw.nbytes < in_band_below:
                return True
        buffers.append(buffer)
        return False

    header = pickle.dumps(message, protocol=5, buffer_callback=out_of_band)
    if not buffers:
        return None
    end = len(slab) if end is None else end
    views = [b.raw() for b in buffers]
    spans, at = [], start
    for view in views:
        if at + view.nbytes > end:
            return None
        spans.append((at, view.nbytes))
        at += -(-view.nbytes // SLAB_ALIGN) * SLAB_ALIGN
    if reserve is not None and not reserve(spans[-1][0] + spans[-1][1] - start):
        return None
    for view, (at, length) in zip(views, spans, strict=True):
        slab[at : at + length] = view  # the one copy, into the slab
    return header, spans


def read_out_of_band(header: bytes, spans: Spans, slab: mmap.mmap, copy: bool = True) -> Any:
    """The message `write_out_of_band` wrote. `copy` takes each buffer out of the slab (the one copy); without
    it the message's arrays are views of the slab, valid until the writer reuses those bytes."""
    if not copy:
        view = memoryview(slab)
        return pickle.loads(header, buffers=[view[at : at + length] for at, length in spans])
    with memoryview(slab) as view:
        buffers = [bytearray(view[at : at + length]) for at, length in spans]
    return pickle.loads(header, buffers=buffers)
