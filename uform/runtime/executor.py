"""Executors: where a trainer's replicas live.

`Executor.for_vram([i])` names CUDA device i, in this process; `Executor.for_vram([0, 1, ...])` names
several, each driven by a worker process of its own that is a rank of the run's world (`uform.runtime.workers`).
An executor only names its devices and owns those processes: what they run is sent to them by the layers
above (`uform.runtime.mesh`, `uform.trainer`), which this module never imports.
`Executor.cpu()` is the development executor the tests and CI use (UForm 4's trainer API trains on GPUs
only, docs/design.md §1; the CPU path computes the same function in fp32 with the dense reference attention).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import torch

from .workers import Workers


class Executor:
    """The devices a trainer runs on, one replica per device."""

    def __init__(
        self, devices: Sequence[torch.device], *, _token: object = None, _workers: bool = False, _threads: int = 0
    ) -> None:
        if _token is not _PRIVATE:
            raise TypeError("Executor: make one with Executor.cpu() or Executor.for_vram([...])")
        self.devices = tuple(devices)
        self._pool: Workers | None = None
        self.joined = False
        """Whether this executor's workers belong to a world now (one mesh at a time; `uform.runtime.mesh` sets it)."""
        if _workers:
            self._pool = Workers(self.devices, _threads)
            weakref.finalize(self, self._pool.close)

    @classmethod
    def cpu(cls, workers: int = 0, *, threads: int = 1) -> Executor:
        """An executor of the CPU. `workers=0` (the default): one device, driven in this process. `workers=N`:
        N CPU "devices", each a worker process of `threads` threads and a rank of a world, the path an executor
        of several GPUs takes (routing by bag, the world's collectives on gloo, merged stats), so multi-device
        code can be tested on a laptop."""
        for name, value in (("workers", workers), ("threads", threads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if workers < 0:
            raise ValueError(f"workers: must be 0 (this process) or a count of worker processes, got {workers}")
        if threads < 1:
            raise ValueError(f"threads: each worker needs at least one thread, got {threads}")
        if workers == 0:
            return cls([torch.device("cpu")], _token=_PRIVATE)
        return cls([torch.device("cpu")] * workers, _token=_PRIVATE, _workers=True, _threads=threads)

    @classmethod
    def for_vram(cls, devices: Sequence[int]) -> Executor:
        """An executor of the CUDA devices named by index."""
        if isinstance(devices, (int, str)) or not isinstance(devices, Sequence):
            raise TypeError("devices: expected a sequence of CUDA device indices, such as [0]")
        if len(devices) == 0:
            raise ValueError("devices: name at least one CUDA device")
        if any(isinstance(d, bool) or not isinstance(d, int) for d in devices):
            raise TypeError("devices: every device index must be an int")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices: each device may appear once, got {list(devices)}")
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for d in devices:
            if not 0 <= d < available:
                raise ValueError(f"devices: CUDA device {d} does not exist; this machine has {available}")
        threads = max(1, (os.cpu_count() or 1) // len(devices))  # the host's cores shared by the workers
        return cls(
            [torch.device("cuda", d) for d in devices], _token=_PRIVATE, _workers=len(devices) > 1, _threads=threads
        )

    def has_workers(self) -> bool:
        """Whether this executor drives its devices through worker processes (several devices)."""
        return self._pool is not None

    @property
    def workers(self) -> Workers:
        """The worker processes of an executor of several devices (started on first use); the mesh joins them
        to its world and the trainer sends them its steps. Refused for an executor of one device."""
        if self._pool is None:
            raise ValueError(f"executor: {self} drives its device in this process; it has no worker processes")
        return self._pool

    def close(self) -> None:
        """Stops the worker processes of an executor of several devices (a no-op otherwise)."""
        if self._pool is not None:
            self._pool.close()

    @property
    def device(self) -> torch.device:
        """The first device (the only one of an executor that runs in this process)."""
        return self.devices[0]

    def __repr__(self) -> str:
        return f"Executor({', '.join(str(d) for d in self.devices)})"


_PRIVATE = object()
