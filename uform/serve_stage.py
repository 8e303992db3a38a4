"""The host stage of a serving model's calls: a call's windows of items decoded, sorted by length and packed into
batches ready for the device (`serve_call.Prepared`), in this process (`data.windows.call_batches` over the
decoder pool, or the GPU's nvJPEG for the JPEGs it takes) or, for a call with media, in host processes of its own
(`runtime.serve_host`). `HostStage` owns what outlives a call: the decoder pool, the host processes, and the
decoded units a model keeps by their bytes (`Model.keep_decoded`).

Shape legend: n members of a batch.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import device_pictures
from .config import BatchShape
from .data.windows import Packed, Packing, call_batches, pack_batch
from .enums import Modality
from .media.decode import MediaPolicy, decode_items
from .media.limits import MediaError
from .media.units import Units
from .page_locks import PageLocks
from .runtime.decoders import DecodePool
from .runtime.serve_host import Lease, ServeHost
from .serve_call import Job, Prepared, media_alloc

__all__ = ["HostStage", "StageSetting", "planned_on_device"]


@dataclass(frozen=True)
class StageSetting:
    """How a model's host stage runs one call, as the model's attributes stand when the call starts."""

    shape: Packing  # how the call packs (`data.windows.Packing`)
    batch: BatchShape  # the run's batch config: its media slices, as the items decode
    media: MediaPolicy
    device: torch.device
    host_processes: int  # 0: in this process
    keep_decoded: bool  # keep every media item's units (or why it failed) by its bytes
    jpeg_decoder: device_pictures.Decoder | None  # the GPU's JPEG decoder (`load(jpeg="device")`), or None

    @property
    def max_units(self) -> int:
        """Units an item spans at most: a row beside its prefix."""
        return self.shape.columns - self.shape.prefix

    @property
    def picture(self) -> dict[str, Any]:
        """What a picture decodes to (the run's image slice, a row's room, the limits), as `device_pictures`
        takes it both when it plans a JPEG and when it falls back to the host path."""
        image = self.batch.image
        return {
            "patch_side": image.patch_side,
            "channels": image.channels,
            "max_units": self.max_units,
            "limits": self.media.limits,
        }


class HostStage:
    """A serving model's host stage and what it keeps between calls; one call at a time (the model's lock)."""

    def __init__(self) -> None:
        self.decoders: DecodePool | None = None
        """The media decoder pool of this process, started by the first media item decoded here."""
        self.serve_host: ServeHost | None = None
        """The host processes, started by the first call that runs there."""
        self.decoded: dict[tuple[Modality, bytes], Units | str] = {}
        """Kept units (or why decoding failed) by (modality, bytes), where the model keeps them."""
        self.locks: PageLocks | None = None
        """The host processes' output areas page-locked in place (CUDA), started with the host processes."""
        self.leases: collections.deque[Lease] = collections.deque()
        """The leases of the batches handed on and not known released, oldest first (`release_leases`)."""

    def release_leases(self) -> None:
        """Releases every batch handed on: called once the calls that read them are over (their batches launched
        hold their own release, which counts first), so a batch a failed call dropped unlaunched never holds its
        area, wherever the failure's traceback keeps it alive."""
        while self.leases:
            self.leases.popleft().release()

    def close(self) -> None:
        """Stops the decoders and the host processes; the next call starts them again."""
        if self.decoders is not None:
            self.decoders.close()
            self.decoders = None
        if self.serve_host is not None:
            self.serve_host.close()
            self.serve_host = None

    def batches(self, job: Job, setting: StageSetting, stop: threading.Event) -> Generator[tuple[str, Any], None, None]:
        """The call's messages (`data.windows.call_batches`: "batch" with a `Prepared`, "skipped" with the
        (item, reason) pairs of a window's broken items), in this process or, for a call with media, in the host
        processes (a text call's packing is short beside its forward, and ran 2% faster here: BENCHMARKS.md,
        "Issue 12, seventeenth day")."""
        remote = setting.host_processes and not setting.keep_decoded and setting.jpeg_decoder is None
        if remote and any(m != Modality.Text for m in job.modalities):
            return self._remote(job, setting, stop)

        def decode(window: range) -> tuple[dict[int, Units], list[tuple[int, str]], dict[int, Any]]:
            return self.decode(job, setting, window)

        def pack(members: list[int], rows: int, units: dict[int, Units], pictures: dict[int, Any]) -> Prepared:
            return self.prepare(job, setting, members, rows, units, pictures)

        return call_batches(setting.shape, job, decode, pack, stop)

    def _remote(self, job: Job, setting: StageSetting, stop: threading.Event) -> Generator[tuple[str, Any], None, None]:
        """The call in the host processes (`runtime.serve_host`): each batch's arrays read where they lie, in its
        host process's output area, which is leased until the batch's forward (CPU) or its copies to the GPU
        (CUDA, from the area page-locked in place: `page_locks`) are done (`Prepared.release`). Where the driver
        refuses to lock an area, that batch is copied into page-locked memory and its area released at once."""
        cuda = setting.device.type == "cuda"
        host = self.serve_host
        if host is None or host.count != setting.host_processes or host.policy is not setting.media:
            if host is not None:
                host.close()
            locks = self.locks = PageLocks(setting.device) if cuda else None
            unmapping = None if locks is None else locks.unlock
            host = self.serve_host = ServeHost(setting.media, setting.host_processes, unmapping)
        for kind, value in host.batches(setting.shape, job, stop):
            if kind != "batch":
                yield kind, value
                continue
            packed: Packed
            lease: Lease
            packed, lease = value  # views of the host process's area until the lease is released
            arrays = [*packed.batch.arrays().values(), *packed.tables.values()]
            in_place = not cuda or (
                self.locks is not None and self.locks.lock(lease.slab, lease.start, lease.end, arrays)
            )
            picks = torch.from_numpy(packed.picks)
            prepared = Prepared(
                members=np.array(packed.members, copy=True),
                # Page-locked memory is its own `pin_memory`: the area's views stay views.
                tensors=packed.batch.host_tensors(cuda, copy=not in_place, tables=packed.tables or None),
                picks=picks.pin_memory() if cuda else picks.clone(),  # either way a copy of its own
                counts=np.array(packed.counts, copy=True),
                truncated=packed.truncated,
            )
            del packed, value, arrays
            if in_place:
                prepared.release = lease.release
                while self.leases and self.leases[0].released.done():
                    self.leases.popleft()
                self.leases.append(lease)
            else:
                lease.release()
            del lease
            yield kind, prepared

    def decode(
        self, job: Job, setting: StageSetting, window: range
    ) -> tuple[dict[int, Units], list[tuple[int, str]], dict[int, Tensor | None]]:
        """A window's media: the units of each item that decoded (a placeholder for a JPEG the device decodes),
        (item, reason) of each that did not, and the pictures the device decoded (None: refused), by item."""
        items = [i for i in window if job.modalities[i] != Modality.Text]
        pictures: dict[int, Tensor | None] = {}
        if not items:
            return {}, [], pictures
        keys = {i: (job.modalities[i], bytes(job.contents[i])) for i in items} if setting.keep_decoded else {}
        kept = {i: self.decoded[k] for i, k in keys.items() if k in self.decoded}
        fresh = [i for i in items if i not in kept]
        units: dict[int, Units] = {i: u for i, u in kept.items() if not isinstance(u, str)}
        if setting.jpeg_decoder is not None:  # JPEGs the device decodes: planned from their headers here
            planned = planned_on_device(job, fresh, setting)
            units.update(planned)
            fresh = [i for i in fresh if i not in planned]
            # Decoded here, on the decoding thread, while the window before is packed and the device runs it.
            sources = [plan.source for plan in planned.values() if plan.source is not None]
            pictures = dict(zip(planned, device_pictures.decode_all(sources, setting.jpeg_decoder), strict=True))
        failed = [(i, u) for i, u in kept.items() if isinstance(u, str)]
        if fresh:
            if self.decoders is None:
                self.decoders = DecodePool(setting.media.workers, setting.media.limits.timeout_seconds)
            new_units, new_failed = decode_items(  # unkeyed: serving draws no masks
                self.decoders,
                setting.media,
                setting.batch,
                job.modalities,
                job.contents,
                fresh,
                setting.max_units,
                False,
            )
            if setting.keep_decoded:  # kept for the evaluator's life: off the decoders' slabs, which they would hold
                new_units = {i: u.owned() for i, u in new_units.items()}
                self.decoded.update({keys[i]: u for i, u in new_units.items()})
                self.decoded.update({keys[i]: why for i, why in new_failed})
            units.update(new_units)
            failed.extend(new_failed)
        return units, sorted(failed), pictures

    def prepare(
        self,
        job: Job,
        setting: StageSetting,
        members: list[int],
        rows: int,
        units: dict[int, Units],
        pictures: dict[int, Tensor | None],
    ) -> Prepared:
        """One batch packed (`data.windows.pack_batch`) into host tensors, page-locked on CUDA, where the JPEGs the
        device decodes are tiled into place."""
        cuda = setting.device.type == "cuda"
        owners: list[Tensor] = []
        packed = pack_batch(setting.shape, job, members, rows, units, media_alloc(owners, cuda))
        batch = packed.batch
        deferred = None
        if setting.jpeg_decoder is not None and "image" in batch.media:
            parts = [(i, units[i]) for i in members if job.modalities[i] == Modality.Image]
            values = batch.media["image"]["values"]
            batch.media["image"]["values"], deferred = device_pictures.split(values, parts, cuda)
        tensors = batch.host_tensors(cuda, tables=packed.tables or None)
        failed: list[tuple[int, str]] = []
        if deferred is not None:  # tiled on the device, in the stream's order, after the batch before
            decoded = [pictures[i] for i in deferred.members]
            tensors["image.values"], failed = device_pictures.fill(
                deferred, tensors["image.values"], setting.device, decoded, **setting.picture
            )
            if failed and job.errors == "raise":
                item, reason = min(failed)
                raise MediaError(reason, item=item)
        picks = torch.from_numpy(packed.picks)
        return Prepared(
            members=packed.members,
            tensors=tensors,
            picks=picks.pin_memory() if cuda else picks,
            counts=packed.counts,
            truncated=packed.truncated,
            failed=failed,
            owners=owners,
        )


def planned_on_device(job: Job, items: list[int], setting: StageSetting) -> dict[int, Units]:
    """The planned units of each of `items` that the GPU decodes (`device_pictures.device_units`), by item."""
    shape = setting.picture
    out = {}
    for i in items:
        if job.modalities[i] == Modality.Image:
            planned = device_pictures.device_units(bytes(job.contents[i]), **shape)
            if planned is not None:
                out[i] = planned
    return out
