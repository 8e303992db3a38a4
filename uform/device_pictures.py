"""Serving's GPU decode of JPEGs: a packed batch's deferred pictures decoded on the device into its image units.

Shape legend: U units of the batch's image modality (patches), F values per unit (p² · C), h units the host
filled (other images' and the inert padding), G pictures of one size, H x W pixels, p patch side, C channels.

The host plans (`media.jpeg_plan.plain_size`, from the headers) and packs as ever, but leaves the rows of a
deferred picture's patches unwritten (`Units.source`); `decode_all` decodes a window's pictures on the device
(nvJPEG through torchvision's `decode_jpeg`, batched, as DALI and torchvision's GPU decoding do it) on serving's
decoding thread, ahead of packing; `split` takes the deferred rows out of what crosses to the device, and `fill`
lays each batch's pictures' patches there exactly as `media.grid.tile` lays the host's:
zero-padded on the right and bottom to whole patches, each [p, p, C], an opaque alpha for RGBA. The decoder
may differ from libjpeg-turbo by a few levels (its IDCT and chroma upsampling: measured on the H200 at most 7,
mean 0.2, of 255), so the option is the caller's (`uform.load(..., jpeg="device")`), never a default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .media.grid import grid_of, positions
from .media.image import image_units
from .media.jpeg_plan import plain_size
from .media.limits import MediaError, MediaLimits
from .media.units import Units

Decoder = Callable[[list[Tensor]], list[Tensor]]
"""JPEG bytes (uint8 host tensors) -> [3, H, W] uint8 RGB pictures on the device, in order."""


@dataclass
class Deferred:
    """One batch's deferred pictures and where their patches go, made on the host (`split`)."""

    rows: Tensor  # [h] int64 rows of the values that the host's values fill (page-locked on CUDA)
    total: int  # U
    features: int  # F
    sources: list[bytes]  # each picture's JPEG bytes
    grids: list[tuple[int, int]]  # each picture's patch grid (rows, columns), from its header
    starts: list[int]  # each picture's first row of the values
    members: list[int]  # each picture's item, as the caller numbers them


def device_units(data: bytes, *, patch_side: int, channels: int, max_units: int, limits: MediaLimits) -> Units | None:
    """The units of a JPEG the device decodes (a placeholder of the right shape, with its positions), or None
    when the host decoders must take it (`media.jpeg_plan.plain_size`)."""
    size = plain_size(data, patch_side=patch_side, channels=channels, max_units=max_units, limits=limits)
    if size is None:
        return None
    rows, columns = grid_of(*size, patch_side)
    return Units(
        values=_placeholder(rows * columns, patch_side * patch_side * channels),
        positions=positions(1, rows, columns),
        grid=(1, rows, columns),
        truncated=False,
        source=data,
    )


@functools.lru_cache(maxsize=256)
def _placeholder(units: int, features: int) -> np.ndarray:
    """[units, F] uint8 zeros that take no memory (a broadcast view), shared by the pictures of one grid."""
    return np.broadcast_to(np.zeros((1, features), dtype=np.uint8), (units, features))


def split(values: np.ndarray, parts: Sequence[tuple[int, Units]], pin: bool) -> tuple[np.ndarray, Deferred | None]:
    """The rows of one batch's image values the host filled, and the batch's deferred pictures (None when it has
    none: then `values` itself). `parts` are (item, units) of the batch's images in packing order, as
    `data.batch.prepare` stacked them into `values` [U, F]."""
    total, features = values.shape
    host = np.ones(total, dtype=bool)
    sources: list[bytes] = []
    grids: list[tuple[int, int]] = []
    members: list[int] = []
    starts: list[int] = []
    at = 0
    for item, units in parts:
        n = len(units)
        if units.source is not None:
            host[at : at + n] = False
            sources.append(units.source)
            grids.append((units.grid[1], units.grid[2]))
            members.append(item)
            starts.append(at)
        at += n
    if not sources:
        return values, None
    rows_kept = np.flatnonzero(host)
    deferred = Deferred(
        rows=_pinned(torch.from_numpy(rows_kept), pin),
        total=total,
        features=features,
        sources=sources,
        grids=grids,
        starts=starts,
        members=members,
    )
    return values[rows_kept], deferred


def fill(
    deferred: Deferred,
    host_values: Tensor,
    device: torch.device,
    pictures: Sequence[Tensor | None],
    *,
    patch_side: int,
    channels: int,
    max_units: int,
    limits: MediaLimits,
) -> tuple[Tensor, list[tuple[int, str]]]:
    """The batch's image values [U, F] uint8 on `device`: the host's rows (`host_values` [h, F]) and every
    deferred picture (`pictures`, as `decode_all` answered them, in the order of `deferred.sources`) tiled in
    place. A picture the decoder refused (None) or decoded to another size than its header's is decoded by the
    host path instead (`media.image.image_units`); one that path refuses too is answered in the failures,
    (item, reason), its rows left zero for the caller to mark invalid."""
    p = patch_side
    values = torch.zeros((deferred.total, deferred.features), dtype=torch.uint8, device=device)  # [U, F]
    values.index_copy_(0, deferred.rows.to(device, non_blocking=True), host_values.to(device, non_blocking=True))
    failures: list[tuple[int, str]] = []
    by_size: dict[tuple[int, ...], list[int]] = {}  # the pictures decoded as their headers promised, by size
    ready: dict[int, Tensor] = {}
    for j, picture in enumerate(pictures):
        if picture is not None and _fits(picture, deferred.grids[j], p):
            by_size.setdefault(tuple(picture.shape), []).append(j)
            ready[j] = picture
        else:  # the host path's units, or its reason
            reason = _host_fill(values, deferred, j, p, channels, max_units, limits)
            if reason is not None:
                failures.append((deferred.members[j], reason))
    pin = values.device.type == "cuda"
    for js in by_size.values():
        rows, columns = deferred.grids[js[0]]
        per = rows * columns
        destination = np.concatenate([np.arange(deferred.starts[j], deferred.starts[j] + per) for j in js])
        stack = torch.stack([ready[j] for j in js]).permute(0, 2, 3, 1)  # [G, H, W, 3]
        if channels == 4:
            opaque = torch.full((*stack.shape[:3], 1), 255, dtype=torch.uint8, device=device)
            stack = torch.cat([stack, opaque], dim=3)  # [G, H, W, 4]
        g, height, width, c = stack.shape
        padded = F.pad(stack, (0, 0, 0, columns * p - width, 0, rows * p - height))  # [G, rows·p, columns·p, C]
        patches = padded.reshape(g, rows, p, columns, p, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, p * p * c)
        index = _pinned(torch.from_numpy(destination), pin).to(device, non_blocking=True)  # [G · per]
        values.index_copy_(0, index, patches)
    return values, failures


def nvjpeg(device: torch.device) -> Decoder:
    """torchvision's batched GPU decoder (nvJPEG) on `device`, RGB out; ImportError naming what to install."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as error:
        raise ImportError(
            'jpeg="device" decodes JPEGs with torchvision\'s GPU decoder (nvJPEG): pip install torchvision, the '
            "build that matches your torch"
        ) from error

    side = torch.cuda.Stream(device)

    def decode(sources: list[Tensor]) -> list[Tensor]:
        # torchvision allocates the pictures on the current stream but writes them on a stream of its own, which
        # waits for nothing: a block just freed by the batch before, whose forward still reads it on the current
        # stream, would be written under that forward (seen on the H200 as an index out of bounds in the next
        # compiled forward). So the pictures come from a stream of ours, the current stream waits for it, and
        # each picture's memory is held until the current stream has read it.
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(side):
            pictures = list(decode_jpeg(sources, device=device, mode=ImageReadMode.RGB))
        current.wait_stream(side)
        for picture in pictures:
            picture.record_stream(current)
        return pictures

    return decode


def decode_all(sources: Sequence[bytes], decode: Decoder) -> list[Tensor | None]:
    """Every JPEG of `sources` decoded by `decode` in one batched call (serving's decoding thread makes it for a
    window of the call, ahead of packing); where that call fails (one bad picture fails it whole), each alone,
    so the bad ones are found: None for each the decoder refuses."""
    if not sources:
        return []
    tensors = [torch.frombuffer(bytearray(source), dtype=torch.uint8) for source in sources]
    try:
        together = decode(tensors)
        if len(together) == len(tensors):
            return list(together)
    except RuntimeError:
        pass
    pictures: list[Tensor | None] = []
    for tensor in tensors:
        try:
            (picture,) = decode([tensor])
        except RuntimeError:
            picture = None
        pictures.append(picture)
    return pictures


def _fits(picture: Tensor, grid: tuple[int, int], p: int) -> bool:
    """Whether a decoded picture is [3, H, W] with the patch grid its header promised."""
    if picture.ndim != 3 or picture.shape[0] != 3:
        return False
    height, width = picture.shape[1:]
    return grid_of(width, height, p) == grid


def _host_fill(
    values: Tensor, deferred: Deferred, j: int, p: int, channels: int, max_units: int, limits: MediaLimits
) -> str | None:
    """Picture `j` through the host path into its rows; its reason when that path refuses it."""
    source = deferred.sources[j]
    try:
        units = image_units(source, patch_side=p, channels=channels, max_units=max_units, limits=limits)
    except MediaError as error:
        return error.reason
    rows, columns = deferred.grids[j]
    if units.grid != (1, rows, columns):
        return f"the GPU decoder and the host decoder disagree on the picture's size ({units.grid[1:]} patches)"
    start = deferred.starts[j]
    values[start : start + rows * columns] = torch.from_numpy(units.values).to(values.device)
    return None


def _pinned(tensor: Tensor, pin: bool) -> Tensor:
    return tensor.pin_memory() if pin else tensor
