"""One serving call's work as it moves from the host to the device and back: the checked call (`Job`), a batch
ready for the device (`Prepared`), the call's place in a pipeline of calls (`Run`), a launched batch landed
(`landed`), and `encode`'s answer assembled from its batches' readouts (`embeddings`).

Shape legend: N items of a call, n members of a batch, T token vectors of a batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .arena import Arena, as_scalar
from .data.windows import CallItems
from .enums import Scalar

__all__ = ["INVALID_I8", "VERB_NAMES", "Job", "Prepared", "Run", "embeddings", "landed", "media_alloc"]

INVALID_I8 = -128
"""The value of every entry of an invalid `Scalar.I8` row: outside the [-127, 127] that real rows take."""

VERB_NAMES = {"encode": "encode", "tokens": "tokens", "choose": "text_choose"}
"""A job's verb as the caller called it, for messages."""


@dataclass
class Job(CallItems):
    """A checked call: what to pack (`data.windows.CallItems`) and what to read out."""

    width: int = 0  # encode: the Matryoshka width
    errors: str = "raise"  # what a broken media item does (`serve_args.ERRORS`)
    cut: int = 0  # text_choose: items whose head was cut before packing


@dataclass
class Prepared:
    """One batch on the host, ready for the device."""

    members: np.ndarray  # [n] the call's items, in packing order
    tensors: dict[str, Tensor]
    picks: Tensor  # the rows the readout takes, page-locked on CUDA (so its copy waits on nothing): encode, each
    # member's segment slot [n]; tokens, the flat positions of every member's vectors [T]; choose, each MASK's [n]
    counts: np.ndarray  # tokens: [n] vectors per member
    truncated: int  # members cut to fit a row
    failed: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (item, reason): pictures the
    # device and the host both refused (`jpeg="device"`), answered invalid
    owners: list[Tensor] = dataclasses.field(default_factory=list)  # the tensors whose memory the media arrays
    # of `tensors` are (`media_alloc`), held until the batch's device work is done
    release: Callable[[Callable[[], None] | None], None] | None = None  # where `tensors` view a host process's
    # output area (`runtime.serve_host.Lease.release`): called once nothing reads them, or with a waiter that
    # returns once nothing does (the copies to the GPU)


@dataclass
class Run:
    """One call in a pipeline of calls (`serve_pipeline.Pipeline.runs`): its batches' readouts as they land."""

    job: Job
    points: list[int]  # where its progress reports
    answers: list[tuple[Prepared, Any]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    truncated: int = 0  # items cut to fit a row (the call's own cut first)
    done: int = 0  # items handed to the device or skipped
    at: int = 0  # the next report point
    complete: bool = False  # every batch launched


def landed(launched: tuple[Prepared, Tensor, Any]) -> tuple[Prepared, Tensor]:
    """A launched batch's (prepared, readout) once its device work is done (`Pipeline._device`: the readout's host
    tensor and the CUDA event after which it holds the answer); its inputs' memory goes back to the host
    allocator's cache then, for the batches after it."""
    prepared, host, event = launched
    if event is not None:
        event.synchronize()
    prepared.tensors, prepared.owners = {}, []
    return prepared, host


def media_alloc(owners: list[Tensor], pin: bool) -> Callable[[tuple[int, ...], type[np.generic]], np.ndarray]:
    """`data.batch.prepare`'s allocator of a batch's media arrays: numpy views of host tensors, page-locked on
    CUDA (`owners` keeps them). The units are written there once, straight from the decoders' slabs: a fresh
    numpy array of a batch's 37 MB of pixels paid the kernel's first-touch faults, then `host_tensors` copied it
    again into page-locked memory; PyTorch's page-locked blocks come back from its cache already mapped, and
    `pin_memory` of memory already page-locked is the tensor itself. Freed only once the batch's device work
    is done (`landed`): a copy from such a view records no event of its own on the block."""

    def alloc(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        kind = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        tensor = torch.empty(shape, dtype=kind, pin_memory=pin)
        owners.append(tensor)
        return tensor.numpy()

    return alloc


def embeddings(job: Job, answers: list[tuple[Prepared, Any]], scalar: Scalar, arena: Arena | None) -> Any:
    """What `encode` answers for `job` from its batches' readouts: [N, width] in `scalar`, the rows of items that
    could not be embedded NaN (-128 under `Scalar.I8`), never a vector that looks real; with `valid` [N] where
    `errors` is "mask"."""
    n = len(job.modalities)
    # Written with numpy, whose copies run on the calling thread: torch's CPU index_put_ fans out to its
    # intra-op threads, which the decoders and the host stage keep busy, and took 2.7 ms a batch on the
    # H200's host (torch.profiler of an 8,192-text call: 265 ms of its 911).
    out = np.zeros((n, job.width), dtype=np.float32)
    valid = np.zeros(n, dtype=bool)
    for prepared, answer in answers:
        out[prepared.members] = answer.numpy()
        valid[prepared.members] = True
        valid[[item for item, _ in prepared.failed]] = False
    rows, present = torch.from_numpy(out), torch.from_numpy(valid)
    answer = arena.land(rows, present, scalar) if arena is not None else as_scalar(rows, scalar)
    if not valid.all():
        answer[~present] = INVALID_I8 if scalar == Scalar.I8 else math.nan
    return (answer, present.clone()) if job.errors == "mask" else answer
