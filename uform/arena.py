"""Arenas: host memory that embeddings land in, in the scalar type a caller asks for.

`Scalar.I8` follows UForm's earlier search-engine format: an L2-normalised vector times 127, rounded
and clamped to [-127, 127]; its dot products divided by 127^2 approximate the cosine similarity.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .enums import Scalar

_DTYPES = {Scalar.F32: torch.float32, Scalar.F16: torch.float16, Scalar.BF16: torch.bfloat16, Scalar.I8: torch.int8}


def as_scalar(embeddings: Tensor, scalar: Scalar) -> Tensor:
    """Float embeddings [N, D] converted to `scalar` on the host."""
    embeddings = embeddings.detach().float().cpu()
    if scalar == Scalar.I8:
        return (embeddings * 127).round().clamp(-127, 127).to(torch.int8)
    return embeddings.to(_DTYPES[scalar])


class Arena:
    """Where a step (or an encode call) lands its embeddings; reused across calls.

    After a call `embeddings` holds [items, width] in `scalar` and `present` marks the rows that hold an
    embedding. A step's rows of items that were dropped are zero; a served call's rows of items it could not
    embed (`errors="mask"`) are NaN, or -128 under `Scalar.I8`, so that no such row passes for a real one.
    """

    def __init__(self) -> None:
        self.embeddings: Tensor | None = None
        self.present: Tensor | None = None
        self.scalar: Scalar = Scalar.F32

    def land(self, embeddings: Tensor, present: Tensor, scalar: Scalar) -> Tensor:
        self.embeddings = as_scalar(embeddings, scalar)
        self.present = present.detach().cpu().bool()
        self.scalar = scalar
        return self.embeddings

    def __repr__(self) -> str:
        shape = None if self.embeddings is None else tuple(self.embeddings.shape)
        return f"Arena(shape={shape}, scalar={self.scalar})"
