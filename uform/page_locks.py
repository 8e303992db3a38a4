"""Serving's host-process output areas page-locked in place, so a batch crosses to the GPU straight from where its
host process packed it (`serve_stage.HostStage`, `runtime.serve_host.Lease`).

Why. The serving process copied each batch (~65 MB of 256² image units at the reference capacity) out of the host
process's shared-memory area into PyTorch's page-locked memory before its asynchronous copy to the GPU; py-spy on
the H200 found that copy 49-62% of its host thread's samples over a 4,096-JPEG call (BENCHMARKS.md, "Issue 12,
twenty-third day"), though alone it takes 0.9 ms on 16 idle cores: in serving, the cores are the decoders'. An
area registered with `cudaHostRegister` is page-locked where it lies: the copy engine reads it (1.25 ms for 65 MB,
no core), and the area is released to its host process only once those copies are done (`copies_done`).

Each (slab, area) is registered from its start to the end of the pages its batches have used so far, growing (by
unregistering and registering again) when a batch reaches further, so no page is locked that a host process has not
backed. `unlock` undoes a slab's registrations before that slab is unmapped (`ServeHost.unmapping`).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterable

import numpy as np
import torch

from .runtime.slab import buffer_address

__all__ = ["PageLocks", "copies_done"]


class PageLocks:
    """The registered extents of the areas of serving host processes' slabs, by (slab, area start)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._extents: dict[tuple[int, int], tuple[int, int]] = {}  # (id(slab), start) -> (address, bytes)
        self._bases: dict[int, int] = {}  # id(slab) -> its mapping's address
        self._lock = threading.Lock()

    def lock(self, slab: mmap.mmap, start: int, end: int, arrays: Iterable[np.ndarray]) -> bool:
        """Whether every one of `arrays` that lies in the area [`start`, `end`) of `slab` is in registered memory
        now (registering the area as far as they reach); False where the driver refused, and then nothing
        changed. Arrays elsewhere (small ones that crossed the pipe) are left alone: they are copied as ever."""
        with self._lock:
            base = self._bases.get(id(slab))
            if base is None:
                base = buffer_address(slab)
                assert base is not None  # a slab is a writable mapping
                self._bases[id(slab)] = base
            low, high = base + start, base + end
            reach = low
            for array in arrays:
                at = array.__array_interface__["data"][0]
                if low <= at < high:
                    reach = max(reach, at + array.nbytes)
            size = -(-(reach - low) // mmap.PAGESIZE) * mmap.PAGESIZE
            key = (id(slab), start)
            held = self._extents.get(key)
            if size == 0 or (held is not None and held[1] >= size):
                return True
            cudart = torch.cuda.cudart()
            if held is not None:
                torch.cuda.synchronize(self.device)  # nothing may still read the old registration's pages
                cudart.cudaHostUnregister(held[0])
                del self._extents[key]
            # A refusal is this thread's last error, which no launch check reads: serving's host thread launches no
            # kernels.
            if cudart.cudaHostRegister(low, size, 0) != cudart.cudaError.success:
                return False
            self._extents[key] = (low, size)
            return True

    def unlock(self, slab: mmap.mmap) -> None:
        """Undoes every registration of `slab` (before it is unmapped), once the device is done with them."""
        with self._lock:
            keys = [key for key in self._extents if key[0] == id(slab)]
            if keys:
                torch.cuda.synchronize(self.device)
            for key in keys:
                torch.cuda.cudart().cudaHostUnregister(self._extents.pop(key)[0])
            self._bases.pop(id(slab), None)


def copies_done(stream: torch.cuda.Stream) -> Callable[[], None]:
    """A waiter (`runtime.serve_host.Lease.release`) that returns once the copies queued on `stream` so far are
    done: an event recorded now, waited for by sleeping."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event.synchronize
