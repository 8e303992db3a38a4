"""A slab: a file of shared memory that a helper process and its owner both map, so large buffers cross
between them as one memcpy instead of through a pipe.

A pipe moves 64 KiB per round trip between two processes, which made the owner of a 16-process decode pool the
bottleneck (about 0.45 GB/s in all); a slab is a memcpy. A slab's file lives under /dev/shm and is unlinked as
soon as it is made: the other process maps it through a duplicate of its descriptor passed when that process
starts (`SlabFile`), so no name outlives a process killed at any moment, and its pages go with the last
descriptor and mapping.

A message crosses a slab as pickle protocol 5 (`write_out_of_band`): its large buffers (numpy arrays,
`pickle.PickleBuffer`) are written into an area of the slab, and the small pickled rest names where they lie;
`read_out_of_band` unpickles around them, as copies or as views of the slab (held views: each message's views
hold one exporter of the slab of their own, whose collection tells the owner those bytes are free again). A
buffer the writer already built inside the slab (`write_out_of_band`'s ``placed``) is named where it lies, not
copied. Pages are reserved before they are
written where the writer has the descriptor (``posix_fallocate``, `reserve_area`), so a full /dev/shm sends the
message through the pipe instead of killing a process with SIGBUS.

Standard library only: the decode pool's workers import it before anything else.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import mmap
import os
import pickle
import tempfile
import threading
import weakref
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

__all__ = [
    "SLAB_ALIGN",
    "Areas",
    "SlabFile",
    "buffer_address",
    "create_slab",
    "message_area",
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
    placed: tuple[int, int] | None = None,
) -> tuple[bytes, Spans] | None:
    """(header, spans): `message` pickled with its out-of-band buffers (those of `in_band_below` bytes or more)
    written into `slab[start:end]`; None when it has none, or they do not fit, or `reserve(length)` (which backs
    the first `length` bytes of that area) says there is no room: the message then crosses whole. A buffer that
    already lies wholly within `slab[placed[0]:placed[1]]` (built there by the writer, whose pages it reserved) is
    named where it lies and not copied; that range must not overlap `slab[start:end]`. Raises what pickling
    raises (a non-contiguous buffer too, which cannot go out of band)."""
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
    base = buffer_address(slab) if placed is not None else None
    spans, copies, at = [], [], start
    for view in views:
        where = None if base is None or placed is None else _offset_in(view, base, placed)
        if where is not None:
            spans.append((where, view.nbytes))
            continue
        if at + view.nbytes > end:
            return None
        spans.append((at, view.nbytes))
        copies.append((view, at))
        at += -(-view.nbytes // SLAB_ALIGN) * SLAB_ALIGN
    if copies and reserve is not None and not reserve(copies[-1][1] + copies[-1][0].nbytes - start):
        return None
    for view, offset in copies:
        slab[offset : offset + view.nbytes] = view  # the one copy, into the slab
    return header, spans


def buffer_address(buffer: Any) -> int | None:
    """The address of a writable buffer's first byte (None for a read-only one, which cannot lie in a slab that
    its writer built in place)."""
    try:
        anchor = ctypes.c_char.from_buffer(buffer)
    except (TypeError, ValueError):  # read-only, or empty
        return None
    address = ctypes.addressof(anchor)
    del anchor  # its export of the buffer goes with it
    return address


def _offset_in(view: memoryview, base: int, placed: tuple[int, int]) -> int | None:
    """Where `view` lies in the slab mapped at `base`, if wholly within `placed`; else None."""
    address = buffer_address(view) if view.nbytes else None
    if address is None:
        return None
    offset = address - base
    return offset if placed[0] <= offset and offset + view.nbytes <= placed[1] else None


def read_out_of_band(
    header: bytes, spans: Spans, slab: mmap.mmap, copy: bool = True, freed: Callable[[], None] | None = None
) -> Any:
    """The message `write_out_of_band` wrote. `copy` takes each buffer out of the slab (the one copy); without
    it the message's arrays are views of the slab, valid until the writer reuses those bytes. With `freed`, they
    are held views: they share one exporter of the slab, and `freed()` runs once the last of them is gone (on
    the thread that dropped it), so the owner reuses those bytes only then."""
    if freed is not None:
        try:
            exporter = (ctypes.c_char * len(slab)).from_buffer(slab)
        except BaseException:  # nothing views the bytes: they are free at once
            freed()
            raise
        handle = weakref.finalize(exporter, freed)  # also when unpickling fails below: the exporter goes then
        handle.atexit = False
        with memoryview(exporter) as typed:
            view = typed.cast("B")
        del exporter  # the views hold it now, through `view`
        try:
            return pickle.loads(header, buffers=[view[at : at + length] for at, length in spans])
        except BaseException:
            del view  # not kept alive by the traceback's frame: nothing views the bytes, so they are free now
            raise
    if not copy:
        view = memoryview(slab)
        return pickle.loads(header, buffers=[view[at : at + length] for at, length in spans])
    with memoryview(slab) as view:
        buffers = [bytearray(view[at : at + length]) for at, length in spans]
    return pickle.loads(header, buffers=buffers)


def message_area(spans: Spans) -> tuple[int, int]:
    """(start, end): the bytes of a slab that a message's out-of-band buffers span."""
    return min(at for at, _ in spans), max(at + length for at, length in spans)


class Areas:
    """Which bytes of one slab hold a helper's replies that its owner still views (`read_out_of_band`'s held
    views), so that the helper writes its next reply elsewhere: each call is offered one free gap (`offer`), and
    the reply's bytes are held (`hold`, the helper's `lease`) until the last view of them is gone. One call at a
    time per slab (a decoder gets its next job only once it answered the last), so an offer needs no keeping: a
    reply that did not use it (it crossed the pipe, or failed) took nothing.

    A freed area is queued (a deque's append, safe from any thread and from a finalizer that runs inside this
    object's own lock) and returned to the free bytes at the next `offer` or `hold`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._held: dict[int, int] = {}  # start -> end of each held area; they never overlap
        self._want = 0  # the largest reply held so far: offers prefer the lowest gap at least this long
        self._freed: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()

    def offer(self) -> tuple[int, int]:
        """(start, end): the gap the next reply may be written into (the lowest at least as long as the largest
        reply so far, else the longest; (0, 0) when every byte is held)."""
        with self._lock:
            self._drain()
            taken = sorted(self._held.items())
            gaps, at = [], 0
            for start, end in taken:
                if start > at:
                    gaps.append((at, start))
                at = max(at, end)
            if at < self.size:
                gaps.append((at, self.size))
            roomy = [g for g in gaps if g[1] - g[0] >= self._want]
            return roomy[0] if roomy else max(gaps, key=lambda g: g[1] - g[0], default=(0, 0))

    def hold(self, spans: Spans) -> Callable[[], None]:
        """Holds the bytes a reply's buffers span (they lie in the gap it was offered); answers the callback that
        frees them."""
        start, end = message_area(spans)
        end = -(-end // SLAB_ALIGN) * SLAB_ALIGN
        with self._lock:
            self._drain()
            self._held[start] = end
            self._want = max(self._want, end - start)
        return functools.partial(self._freed.append, start)

    @property
    def held(self) -> list[tuple[int, int]]:
        """The held areas, (start, end) each, in order (for inspection and tests)."""
        with self._lock:
            self._drain()
            return sorted(self._held.items())

    def _drain(self) -> None:
        while self._freed:
            self._held.pop(self._freed.popleft(), None)
