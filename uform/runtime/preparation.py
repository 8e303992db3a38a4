"""Where one replica's prepare stage runs (its `replica.Stage`): on the replica's own threads, decoding in this
process's pool (`decoders.DecodePool`), or in preparer processes of its own (`preparers.Preparers`).

The replica layer knows neither: a trainer of one device, or a device's worker, makes its replica with
`Preparation.factory(...)`, and the replica calls `prepare` and `decode` on its host threads. Where the stage runs
changes no result: the batches are bitwise the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..config import TrainerInitVramConfig
from ..data.batch import Batch, media_features
from ..media.decode import MediaPolicy
from ..media.units import Units
from ..replica.checked_step import CheckedStep
from .decoders import DecodePool
from .executor import Executor
from .preparers import PrepareJob, Preparers, decode_media, prepare_step

__all__ = ["Preparation", "default_host_processes"]


class Preparation:
    """A replica's prepare stage: `host_processes` processes of its own (started on the first step), or none (this
    process's threads, decoding in a pool started on the first media item)."""

    def __init__(
        self, config: TrainerInitVramConfig, media: MediaPolicy, tiles: int, pin: bool, host_processes: int
    ) -> None:
        self.config = config
        self.media = media
        """The media policy every step's items are decoded under."""
        self.tiles = tiles
        """The side of the block tables each step carries (the flex attention path's), 0 for none (the dense path)."""
        self.pin = pin
        """Whether host tensors are page-locked (CUDA)."""
        self.host_processes = host_processes
        self._lock = threading.Lock()
        self._decoders: DecodePool | None = None
        self._preparers: Preparers | None = None

    @classmethod
    def factory(
        cls, media: MediaPolicy, device: torch.device, host_processes: int
    ) -> Callable[[TrainerInitVramConfig, int], Preparation]:
        """The `replica.StageFactory` of a replica on `device`."""
        return lambda config, tiles: cls(config, media, tiles, device.type == "cuda", host_processes)

    def prepare(self, checked: CheckedStep, step: int) -> tuple[Batch, dict[str, torch.Tensor], list[tuple[int, str]]]:
        """Step `step`'s prepare stage (`preparers.prepare_step`: decode, pack, corrupt and pair, block tables), here
        or in a preparer process: its batch, its host tensors and the (index, reason) of the media that failed."""
        job = _job(checked)
        if self.host_processes:
            with self._lock:
                if self._preparers is None:
                    self._preparers = Preparers(self.host_processes, self.config, self.media, self.tiles, self.pin)
            return self._preparers.prepare(job, step)
        answer = prepare_step(self.config, self.media, self.tiles, self.decode_pool, job, step)
        batch = answer.batch
        host = batch.host_tensors(self.pin, tables=answer.tables)
        return batch, host, answer.failed

    def decode(self, checked: CheckedStep) -> tuple[dict[int, Units], list[tuple[int, str]]]:
        """The step's media items decoded in this process's pool (the prepare stage's first half)."""
        return decode_media(self.config, self.media, self.decode_pool, _job(checked))

    def decode_pool(self) -> DecodePool:
        """This process's decoder pool (the in-process prepare stage's), started on first need."""
        with self._lock:
            if self._decoders is None:
                self._decoders = DecodePool(self.media.workers, self.media.limits.timeout_seconds)
            return self._decoders

    @property
    def decoders(self) -> DecodePool | None:
        """This process's decoder pool, where one started."""
        return self._decoders

    @property
    def preparers(self) -> Preparers | None:
        """The preparer processes, where they started."""
        return self._preparers

    @property
    def decode_workers(self) -> int:
        """Decoding processes working for this stage now (0 before the first media item)."""
        if self._preparers is not None:
            return self._preparers.decoders * self.host_processes
        return self._decoders.workers if self._decoders is not None else 0

    def close(self) -> None:
        """Ends the preparer processes and the decoder pool (whichever started)."""
        if self._preparers is not None:
            self._preparers.close()
        if self._decoders is not None:
            self._decoders.close()


def _job(checked: CheckedStep) -> PrepareJob:
    """What the prepare stage reads of a checked step (the arena and the stats stay with the caller)."""
    return PrepareJob(
        modalities=checked.modalities,
        contents=checked.contents,
        bags=checked.bags,
        groups=checked.groups,
        sides=checked.sides,
        choices=checked.choices,
        relations=checked.relations,
    )


def default_host_processes(executor: Executor, config: TrainerInitVramConfig) -> int:
    """Preparer processes of a trainer that does not say (`Trainer.init_vram`): on CUDA two for a run with a media
    modality and one for text alone; none on the CPU.

    On CUDA the device thread needs the interpreter lock to launch kernels and the in-process prepare stage's
    Python holds it. Measured on the H200 machine (`python bench/data_wait.py --executor cuda
    --host-processes N --in-flight F`, 128 JPEGs beside 128 texts at the reference geometry, fed instantly
    58.5 ms/step), 2026-12-01: one process, two steps in flight, 77.2 ms/step (24% waiting for data); two
    processes, three in flight, 63.1 ms/step (7%); four, five in flight, 65.7. A text step's prepare stage is
    shorter than the device step in one process, and a second one made it slower (`python bench/step.py
    --skip-bert --host-processes N`, the reference Joint text step: one 51.5 / 56.2 ms, two 61.1 / 70.2 ms, in
    two calls; none 78.2 ms). So two, with a loop that keeps `host_processes + 1` steps in flight (`uform.fit`
    does), where media is decoded, else one. On the CPU the device stage's kernels run without the lock and a
    process would only cost its start."""
    if executor.device.type != "cuda":
        return 0
    return 2 if media_features(config) else 1
