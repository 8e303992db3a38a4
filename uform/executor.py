"""Executors: where a trainer's replicas live.

`Executor.for_vram([i])` names CUDA device i; `Executor.cpu()` is the development executor the tests
and CI use (the seed trains on GPUs only; the CPU path computes the same function in fp32 with the
dense reference attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Executor:
    """The devices a trainer runs on, one replica per device."""

    def __init__(self, devices: Sequence[torch.device], *, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("Executor: make one with Executor.cpu() or Executor.for_vram([...])")
        self.devices = tuple(devices)

    @classmethod
    def cpu(cls) -> Executor:
        return cls([torch.device("cpu")], _token=_PRIVATE)

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
        if len(devices) > 1:
            raise ValueError(
                "devices: an executor of several devices needs the mesh, which this release does not have yet; "
                "use one device per executor"
            )
        return cls([torch.device("cuda", d) for d in devices], _token=_PRIVATE)

    @property
    def device(self) -> torch.device:
        """The first (in this release, the only) device."""
        return self.devices[0]

    def __repr__(self) -> str:
        return f"Executor({', '.join(str(d) for d in self.devices)})"


_PRIVATE = object()
