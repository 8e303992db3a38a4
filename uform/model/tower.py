"""The transformer tower: pre-norm blocks of document-masked bidirectional attention and an MLP.

Shape legend: R rows, C columns, D hidden, H heads (D / 64), K head width (64).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import HEAD_DIM
from .attention import DocumentMask, attend, gather_rows, scatter_rows
from .embed import AxialRotary
from .mlp import mlp
from .qk_rotation import rotate_qkv


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose float32 weight meets the input in the input's dtype: under autocast the residual stream
    is bfloat16, and a float32 weight beside a bfloat16 input leaves PyTorch's fused kernel for its composite (with a
    warning). The statistics are computed in float32 either way; a float32 input is normalised exactly as before."""

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class Block(nn.Module):
    """x + attention(norm(x)), then x + MLP(norm(x)); no biases, RMSNorm, GELU MLP of width 4D."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads = hidden // HEAD_DIM
        self.attention_norm = RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, eps=1e-6)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        self.fused_mlp = False
        """Whether a training step's MLP runs GELU in cuBLASLt's epilogues (`mlp.FusedMLP`): set by a CUDA replica
        that found cuBLASLt, before it compiles."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        rows, columns, hidden = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(rows, columns, 3, self.heads, HEAD_DIM)
        # Rotated in the token-major layout the projection wrote, and handed to attention as [R, H, C, K]
        # views: the rotation and its backward then read and write whole rows of qkv (and its gradient)
        # instead of transposing them (H200 profile, reference geometry: the rotation's backward and the
        # re-stacking of the head-major gradients cost 5.4 ms of a 50 ms step).
        # Scaled dot-product attention (uniform, gathered) takes rotated q and k from an op of their own, which
        # inductor hands over without copying them (`qk_rotation`); FlexAttention takes inductor's fused rotation.
        q, k, v = rotate_qkv(qkv, cos, sin, opaque=mask.kind in ("uniform", "gathered"))  # each [R, C, H, K]
        a = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)  # [R, H, C, K]
        a = a.transpose(1, 2).reshape(rows, columns, hidden)  # [R, C, D]
        x = x + self.out(a)
        return x + mlp(self.up, self.down, self.mlp_norm(x), self.fused_mlp)


class Tower(nn.Module):
    """Embedded inputs [R, C, D] and their rotary code (cos, sin [R, C, 1, K/2]) -> final-norm states.

    The residual stream is float32 (the weights' dtype), except in training mode under autocast, where it is the
    autocast dtype; the final-norm states come out in the stream's dtype.

    The rotary code is an input rather than computed inside so that a compiled step can receive it
    materialised once per step (computed eagerly from the positions) instead of re-deriving the sines
    and cosines inside every block's fused kernel.
    """

    def __init__(self, depth: int, hidden: int) -> None:
        super().__init__()
        self.rotary = AxialRotary(HEAD_DIM)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = RMSNorm(hidden, eps=1e-6)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        device = x.device.type
        if self.training and torch.is_autocast_enabled(device):
            # A training step carries the residual stream in the autocast dtype (bf16), as nanochat and
            # modded-nanogpt do: the projections round their inputs to it anyway, and a float32 stream made the
            # norms, the residual adds and their casts move twice the bytes (H200, BENCHMARKS.md "Issue 12,
            # sixth day": 3.6 ms of a 49.5 ms reference step). Evaluation and serving (eval mode) keep float32.
            x = x.to(torch.get_autocast_dtype(device))
        if mask.kind == "gathered":
            return self._gathered(x, cos, sin, mask)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.norm(x)

    def _gathered(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        """The "gathered" kind (`model.attention`; serving's images of one size): the N segments' positions
        gathered once into [N, L] rows, the blocks run over them as N sequences with no mask, the final-norm states
        scattered back into [R, C, D] (padding's zero). Every operation but attention acts on one position at a
        time, so this answers what gathering around each block's attention did, without a gather and a scatter in
        every block or the padding's share of the projections. H200 (BENCHMARKS.md, "Issue 12, twenty-second day"):
        the scatters alone were 65 of a serving stream's 1,251 ms of kernels when every block gathered."""
        assert mask.index is not None
        rows, columns, _ = x.shape
        index = mask.index  # [N, L]
        x, cos, sin = gather_rows(x, index), gather_rows(cos, index), gather_rows(sin, index)  # [N, L, ...]
        each = DocumentMask("gathered", length=mask.length)  # rows that are each one segment
        for block in self.blocks:
            x = block(x, cos, sin, each)
        return scatter_rows(self.norm(x), index, rows, columns)  # [R, C, D]

    def fuse_mlp(self, fused: bool) -> None:
        """Every block's `fused_mlp`: whether a training step's MLP runs GELU in cuBLASLt's epilogues."""
        for block in self.blocks:
            cast(Block, block).fused_mlp = fused

    def residual_scale(self) -> float:
        """GPT-2's scaled init of the projections that write into the residual stream: 1 / sqrt(2 depth)."""
        return 1.0 / math.sqrt(2 * len(self.blocks))
