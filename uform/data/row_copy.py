"""Copying a step's media units into one array, spread over a few threads when there are many of them.

Shape legend: U units of one modality in the step, F values per unit; each part is one item's [n, F] units.

A step's units arrive as one array per item (views of the decoders' shared memory) and are stacked into the
step's [U, F] array, tens of megabytes a step (128 images of 256 units x 1,024 bytes: 34 MB; a serving batch of
192: 50 MB). One thread copies ~5.4 GB/s on the H200 machine's host, so that copy alone took 6-9 ms of a step's
packing there; four threads copy 16-18 GB/s (`bench/copy_rate.py`; BENCHMARKS.md, "Issue 12, ninth day").
numpy releases the interpreter lock while it copies, so the threads run side by side. The bytes written are the
same however the copy is cut.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["SPREAD_BYTES", "copy_rows"]

SPREAD_BYTES = 8 << 20
"""Below this many bytes a copy stays on the caller's thread: handing work to a thread costs tens of microseconds,
about what one core copies of a few hundred kilobytes."""

_MAX_THREADS = 4  # the most measured in a step on the H200 host (16 cores, shared with 16 decoders): 3x one thread
_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    # A forked child inherits the pool object but none of its threads; it makes its own on first use.
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def _threads() -> int:
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_threads(), thread_name_prefix="uform-row-copy")
        return _pool


def _copy_run(out: np.ndarray, parts: Sequence[np.ndarray | None], sizes: Sequence[int], first: int) -> None:
    """Parts one after another from row `first` of `out`; a None part's rows are skipped, left as they are."""
    present = [part for part in parts if part is not None]
    if len(present) == len(parts):
        np.concatenate(present, out=out[first : first + sum(sizes)], casting="unsafe")
        return
    at = first
    for part, n in zip(parts, sizes, strict=True):
        if part is not None:
            out[at : at + n] = part
        at += n


def copy_rows(
    out: np.ndarray, parts: Sequence[np.ndarray | None], sizes: Sequence[int], *, spread_bytes: int = SPREAD_BYTES
) -> None:
    """Writes `parts` one after another into the leading rows of `out` ([U, F]): part i is `sizes[i]` rows, or None
    for rows left unwritten (units a GPU decoder fills). Copies of `spread_bytes` or more are cut at part
    boundaries into runs of about equal bytes, one a thread, on up to four threads; the result is the same."""
    if len(parts) != len(sizes):
        raise ValueError(f"copy_rows: {len(parts)} parts but {len(sizes)} sizes; give one size a part")
    if not parts:
        return
    row_bytes = out.itemsize * int(np.prod(out.shape[1:], dtype=np.int64))
    total = sum(sizes)
    if total > len(out):
        raise ValueError(f"copy_rows: the parts hold {total} rows but `out` has {len(out)}")
    for i, (part, n) in enumerate(zip(parts, sizes, strict=True)):
        if part is not None and len(part) != n:
            raise ValueError(f"copy_rows: part {i} has {len(part)} rows but its size is {n}")
    written = sum(n for part, n in zip(parts, sizes, strict=True) if part is not None) * row_bytes
    runs = min(_threads(), len(parts))
    if written < spread_bytes or runs < 2:
        _copy_run(out, parts, sizes, 0)
        return
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    # Cut where the running total of rows crosses each 1/runs of the whole, at part boundaries.
    cuts = np.searchsorted(starts, [total * k // runs for k in range(1, runs)], side="left")
    bounds = [0, *sorted({int(c) for c in cuts if 0 < c < len(parts)}), len(parts)]
    pool = _executor()
    jobs = [
        pool.submit(_copy_run, out, parts[a:b], sizes[a:b], int(starts[a]))
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]
    concurrent.futures.wait(jobs)  # every run finishes before the first error (if any) is raised
    for job in jobs:
        job.result()
