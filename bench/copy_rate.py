"""How fast this host copies a step's worth of bytes, by source, destination and thread count (issue 12).

The host stage copies tens of megabytes a step: a step's media units out of the decoders' shared memory into one
array (`data.row_copy`), then into page-locked memory for the GPU. This measures `--mib` MiB copied

  private -> private        numpy `copyto` between two arrays of this process, both touched before
  private -> fresh          into a new `np.empty` each time (the kernel's first-touch faults included)
  slab -> private           from a shared-memory file under /dev/shm that a forked child wrote (as decoders do)
  slab -> page-locked       into memory from `torch.empty(pin_memory=True)` (CUDA only; else plain memory)
  slab -> page-locked, N threads   the same cut into N runs, one a thread (numpy drops the interpreter lock)
  torch copy_               `Tensor.copy_` of the whole (torch's own intra-op threads)

each `--repeats` times, and prints GB/s (median, best, worst). Writes bench-copy-rate.json under $OUT (or the
current folder). Usage:
  python bench/copy_rate.py [--mib 48] [--repeats 8]
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import write_json  # sibling scripts, not a package


def rates(copy: Callable[[], None], size: int, repeats: int) -> dict[str, float]:
    """GB/s of `copy` over `repeats` runs: median, best, worst."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        copy()
        seconds.append(time.perf_counter() - started)
    return {
        "median": size / statistics.median(seconds) / 1e9,
        "best": size / min(seconds) / 1e9,
        "worst": size / max(seconds) / 1e9,
    }


def slab_written_by_a_child(size: int) -> np.ndarray:
    """`size` bytes of a /dev/shm file (unlinked at once) that a forked child filled, mapped here."""
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    child = os.fork()
    if child == 0:
        np.frombuffer(mmap.mmap(fd, size), np.uint8)[:] = 7
        os._exit(0)
    os.waitpid(child, 0)
    os.close(fd)  # the mapping keeps the file
    return np.frombuffer(mapping, np.uint8)


def threaded(destination: np.ndarray, source: np.ndarray, threads: int) -> Callable[[], None]:
    def copy() -> None:
        cut = len(source) // threads
        runs = [
            threading.Thread(
                target=np.copyto, args=(destination[i * cut : (i + 1) * cut], source[i * cut : (i + 1) * cut])
            )
            for i in range(threads)
        ]
        for run in runs:
            run.start()
        for run in runs:
            run.join()

    return copy


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=48, help="MiB a copy (a serving batch of 192 images: ~48)")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    import torch

    size = args.mib << 20
    pinned = torch.cuda.is_available()
    slab = slab_written_by_a_child(size)
    private = np.full(size, 7, np.uint8)
    destination = np.zeros(size, np.uint8)
    locked_tensor = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned)
    locked = locked_tensor.numpy()
    cases: dict[str, Callable[[], None]] = {
        "private -> private": lambda: np.copyto(destination, private),
        "private -> fresh": lambda: np.copyto(np.empty(size, np.uint8), private),
        "slab -> private": lambda: np.copyto(destination, slab),
        "slab -> page-locked" if pinned else "slab -> private (no CUDA)": lambda: np.copyto(locked, slab),
        **{
            f"slab -> {'page-locked' if pinned else 'private'}, {n} threads": threaded(locked, slab, n)
            for n in (2, 4, 8)
        },
        "torch copy_ (its intra-op threads)": lambda: locked_tensor.copy_(torch.from_numpy(slab)),
    }
    result: dict[str, Any] = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "mib": args.mib}
    print(f"{args.mib} MiB a copy, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads (GB/s)")
    for name, copy in cases.items():
        result[name] = rates(copy, size, args.repeats)
        r = result[name]
        print(f"  {name:38s} median {r['median']:6.2f}  best {r['best']:6.2f}  worst {r['worst']:6.2f}", flush=True)
    print(write_json("bench-copy-rate.json", result))
    return result


if __name__ == "__main__":
    main()
