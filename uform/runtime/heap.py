"""The C heap of a helper process that handles buffers of the same few sizes over and over (a decoder: an image's
pixels, its units; a preparer process: a step's arrays): keep them in the heap instead of fresh pages.

glibc's malloc serves each block of 128 KiB or more (its starting mmap threshold) from pages of its own, mapped
for it and unmapped when it is freed, so every such block is page-faulted in again, one fault per 4 KiB page. The
threshold grows only when such a block is freed, to that block's size; a process whose messages once carried a
large buffer (a chunk of JPEG bytes through the pipe) raised it that way by chance, and one whose messages are
small (the bytes now cross shared memory) never does. A 256 x 256 JPEG's decode then cost about 0.16 ms more on
this project's CPU machine (PIL's 196 KiB RGB image, its copy, its RGBA conversion, `tobytes`, the 256 KiB units:
each a fresh mapping), measured with one decoder: 75 -> 95 ms of a step's 128 images. `keep_heap` fixes both
thresholds instead (`mallopt`), so blocks up to `MMAP_BYTES` come from the heap and up to `TRIM_BYTES` of freed
heap stay mapped for the next. Elsewhere than glibc it does nothing.

Standard library only: the decode pool's workers import it before anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

__all__ = ["MMAP_BYTES", "TRIM_BYTES", "keep_heap"]

MMAP_BYTES = 8 << 20
"""Blocks below this come from the heap (a 1000 x 1000 RGBA image is 4 MB; a larger one keeps its own pages)."""
TRIM_BYTES = 64 << 20
"""Free heap kept mapped at most, beyond which its top is returned to the system."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_heap(mmap_bytes: int = MMAP_BYTES, trim_bytes: int = TRIM_BYTES) -> bool:
    """Sets this process's malloc thresholds (see the module's docstring); answers whether it could (glibc only)."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
    return False
