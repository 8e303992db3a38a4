"""Document-masked bidirectional attention: a position attends only within its own segment.

Shape legend: R rows, C columns, H heads, K head width.

Two paths compute the same function (tests/test_attention.py holds them to each other, outputs and
gradients):

- `flex`: FlexAttention (Dong et al. 2024, `torch.nn.attention.flex_attention`) with a block mask built
  from the segment ids, so the kernel skips every (query block, key block) tile whose segments cannot
  meet. This is the CUDA path, under `torch.compile`.
- `dense`: scaled dot-product attention with an explicit [R, 1, C, C] boolean mask; the CPU reference.

Padding positions carry the segment id NO_SEGMENT and attend to the padding of their own row, so no
query row is ever fully masked (no NaN) and padding never reaches a segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.blocks import BLOCK, block_tables

try:  # FlexAttention ships with torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = Any  # type: ignore[misc,assignment]
    flex_attention = None  # type: ignore[assignment]


@dataclass
class DocumentMask:
    """Which keys each query may see, in the form its attention path reads."""

    kind: str
    """"flex" or "dense"."""
    block: Any = None
    """The FlexAttention BlockMask (flex)."""
    dense: Tensor | None = None
    """[R, 1, C, C] bool (dense)."""


def document_mask(segments: Tensor, kind: str, tables: dict[str, Tensor] | None = None) -> DocumentMask:
    """The mask of segment ids [R, C] for the `kind` attention path.

    For "flex", `tables` are `block_tables` already on the device (made on the host, off the critical
    path); without them they are computed here.
    """
    if kind == "dense":
        same = segments[:, None, :, None] == segments[:, None, None, :]  # [R, 1, C, C]
        return DocumentMask(kind, dense=same)
    if kind != "flex":
        raise ValueError(f"attention: unknown path {kind!r}; expected 'flex' or 'dense'")
    if tables is None:
        tables = {k: torch.from_numpy(v).to(segments.device) for k, v in block_tables(segments.cpu().numpy()).items()}

    def same_segment(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return segments[b, q] == segments[b, k]

    block = BlockMask.from_kv_blocks(
        tables["kv_num_blocks"],
        tables["kv_indices"],
        tables["full_kv_num_blocks"],
        tables["full_kv_indices"],
        BLOCK_SIZE=BLOCK,
        mask_mod=same_segment,
        seq_lengths=(segments.shape[1], segments.shape[1]),
    )
    return DocumentMask(kind, block=block)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    """q, k, v [R, H, C, K] -> [R, H, C, K]."""
    if mask.kind == "flex":
        return flex_attention(q, k, v, block_mask=mask.block)  # type: ignore[misc, return-value]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)


def compiled_flex_available(device: torch.device) -> bool:
    return flex_attention is not None and device.type == "cuda"
