"""One device's prepared step as the network reads it: `DeviceBatch`, and `to_device`, the one copy of a
batch's host tensors to the device that training and serving both make (`to_host`, the way back).

Shape legend: R rows, C columns, S segment slots, P covered-position capacity, U units of one media
modality, F values per unit, K/2 rotary frequencies; late interaction's Qt query token rows, Dt document
token rows, Dd document columns; Kc legal bytes per choice.

The host side is `data.batch.Batch.host_tensors`: every array of the batch as a host tensor, named as
`Batch.arrays` names them ("tokens", "image.values", "late.z", "choice.bytes"...), plus FlexAttention's
block tables as "block.<table>". `to_device` reads those names once; from there on the step sees typed
fields. Every field is a tensor (or a small dataclass / dict of tensors), so a compiled step traces it
like positional tensors, with no Python branch on tensor values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..data.batch import MEDIA_KINDS, Batch
from ..data.blocks import BLOCK, gathered_shape, uniform_length
from .attention import DocumentMask, document_mask

Rotary = Callable[[Tensor, torch.dtype], tuple[Tensor, Tensor]]
"""positions [R, C, 3] and a dtype -> the rotary code (cos, sin) [R, C, 1, K/2] (`Network.rotary`)."""


@dataclass
class MediaUnits:
    """One live media modality's units of the step (U varies by step: a dynamic size when compiled)."""

    values: Tensor  # [U, F] uint8 (image, video) or float32 (audio), as decoded
    index: Tensor  # [U] int64 flat positions (row * C + column) of the units
    masked: Tensor  # [U] bool, the units the masked objective reconstructs
    valid: Tensor  # [U] float32, 1 a real unit / 0 inert padding


@dataclass
class LateParts:
    """Late interaction's index arrays (where it is on; see `Batch.late`)."""

    query_index: Tensor  # [Qt] int64 flat positions of the query tokens
    query_slot: Tensor  # [Qt] int64 their slot, S for padding
    document_index: Tensor  # [Dt] int64 flat positions of the document tokens
    document_of: Tensor  # [Dt] int64 their document column, Dd for padding
    z: Tensor  # [S, Dd] float32 pair targets of (query slot, document column)
    w: Tensor  # [S, Dd] float32 their weights


@dataclass
class ChoiceParts:
    """The calibrated choices' arrays (where they are trained; see `Batch.choice`)."""

    index: Tensor  # [S] int64 flat position of each slot's appended MASK
    bytes: Tensor  # [S, Kc] int64 its legal bytes
    legal: Tensor  # [S, Kc] bool
    targets: Tensor  # [S, Kc] float32 target probabilities
    valid: Tensor  # [S] float32, 1 a slot that made a choice


@dataclass
class DeviceBatch:
    """Every tensor one device's step reads, on the device (`to_device`)."""

    tokens: Tensor  # [R, C] int64, corrupted where the objective masks
    positions: Tensor  # [R, C, 3] int64 axial positions
    segments: Tensor  # [R, C] int64 slot ids, padding = S
    counts: Tensor  # [S] int64 positions per slot
    target_index: Tensor  # [P] int64 flat covered positions
    targets: Tensor  # [P] int64 original bytes there
    target_weight: Tensor  # [P] float32, 1 covered / 0 capacity padding
    slot_valid: Tensor  # [S] bool
    slot_group: Tensor  # [S] int64 temperature group
    z: Tensor  # [S, S] float32 +1 / -1 / 0 pair targets
    w: Tensor  # [S, S] float32 pair weights
    mask: DocumentMask  # which keys each query sees, in the attention path's form
    cos: Tensor  # [R, C, 1, K/2] rotary code, in the step's compute dtype
    sin: Tensor  # [R, C, 1, K/2]
    media: dict[str, MediaUnits]  # per live media modality ("image", "video", "audio")
    late: LateParts | None = None
    choice: ChoiceParts | None = None


_PARTS = {"late": LateParts, "choice": ChoiceParts, **{kind: MediaUnits for kind in MEDIA_KINDS.values()}}
"""The part classes of the dotted host names, by prefix; "block." names FlexAttention's tables."""


def to_device(
    host: Mapping[str, Tensor],
    device: torch.device,
    rotary: Rotary,
    *,
    attention: str,
    dtype: torch.dtype,
    dynamic: bool,
    block: int = BLOCK,
    copy_stream: torch.cuda.Stream | None = None,
    uniform: bool = False,
    gathered: bool = False,
) -> DeviceBatch:
    """The step's host tensors (`Batch.host_tensors`, page-locked where the caller asked) on `device`.

    Every tensor is copied with `non_blocking` (asynchronous from page-locked memory), on `copy_stream` where
    one is given (the current stream waits for those copies before anything reads them); where `dynamic` (a
    compiled step) the media units' first axis U is marked dynamic, so the step compiles one graph for every
    unit count; the document mask is built for the `attention` path ("flex": from the block tables of tile
    side `block` when the host made them, `attention.flex_block`; where `uniform` and the flex path, a step whose rows
    are whole segments of one length takes the "uniform" kind instead, `data.blocks.uniform_length`); the rotary
    code is `rotary(positions, dtype)`. Where `gathered` (a forward without gradients: serving) and the flex path, a
    batch whose segments all hold one length L that is not a whole number of tiles of `block` (images of one size)
    takes the "gathered" kind instead (`data.blocks.gathered_shape`; it needs no tables). Raises ValueError on a
    name that is not a batch array's, or on tables of another tile side.
    """
    if copy_stream is None:
        tensors = {name: t.to(device, non_blocking=True) for name, t in host.items()}
    else:
        # On a stream of their own the copies cross while the work queued before them still computes (the copy
        # engine runs beside the kernels): 50 MB of an image-text step's units, ~1 ms on the H200, no longer
        # between two steps' kernels. The allocator learns that the current stream uses their memory.
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(copy_stream):
            tensors = {name: t.to(device, non_blocking=True) for name, t in host.items()}
        current.wait_stream(copy_stream)
        for t in tensors.values():
            t.record_stream(current)
    plain: dict[str, Tensor] = {}
    parts: dict[str, dict[str, Tensor]] = {}
    tables: dict[str, Tensor] = {}
    for name, t in tensors.items():
        prefix, dot, part = name.partition(".")
        if prefix == "block" and dot:
            tables[part] = t
        elif dot and prefix in _PARTS:
            parts.setdefault(prefix, {})[part] = t
        elif not dot and name in Batch.TENSORS:
            plain[name] = t
        else:
            raise ValueError(f"to_device: {name!r} is not a batch tensor's name (Batch.arrays, or block.<table>)")
    if dynamic:  # media unit counts vary by step: one dynamic-size graph instead of one per count
        for kind in MEDIA_KINDS.values():
            for t in parts.get(kind, {}).values():
                torch._dynamo.mark_dynamic(t, 0)
    # Read from the host's own segment ids (no device read; ~85 us for 64 x 1024): fixed-length chunks packed edge
    # to edge make a uniform layout, which attention runs dense with no mask (`model.attention`, kind "uniform").
    segments = host["segments"]
    length = 0
    if uniform and attention == "flex" and segments.device.type == "cpu":
        length = uniform_length(segments.numpy(), host["counts"].shape[0])
    equal = (0, 0)
    if gathered and not length and attention == "flex" and segments.device.type == "cpu":
        equal = gathered_shape(host["counts"].numpy(), block)
    mask = document_mask(plain["segments"], attention, tables or None, block, length, equal)
    if dynamic and mask.index is not None:  # segment counts vary by batch: one graph for every N (N = 1 apart)
        torch._dynamo.maybe_mark_dynamic(mask.index, 0)
    cos, sin = rotary(plain["positions"], dtype)
    late = parts.pop("late", None)
    choice = parts.pop("choice", None)
    return DeviceBatch(
        **plain,
        mask=mask,
        cos=cos,
        sin=sin,
        media={kind: MediaUnits(**arrays) for kind, arrays in parts.items()},
        late=None if late is None else LateParts(**late),
        choice=None if choice is None else ChoiceParts(**choice),
    )


def to_host(tensor: Tensor) -> Tensor:
    """An asynchronous copy of a device tensor into page-locked host memory, to be read once the stream has
    passed it (an event); on the CPU the tensor itself, detached."""
    if tensor.device.type == "cpu":
        return tensor.detach()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    return host
