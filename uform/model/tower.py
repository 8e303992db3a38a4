"""The transformer tower: pre-norm blocks of document-masked bidirectional attention and an MLP.

Shape legend: R rows, C columns, D hidden, H heads (D / 64), K head width (64).
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import HEAD_DIM
from .attention import DocumentMask, attend
from .embed import AxialRotary


class Block(nn.Module):
    """x + attention(norm(x)), then x + MLP(norm(x)); no biases, RMSNorm, GELU MLP of width 4D."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads = hidden // HEAD_DIM
        self.attention_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        rows, columns, hidden = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(rows, columns, 3, self.heads, HEAD_DIM)
        q, k, v = qkv.unbind(2)  # each [R, C, H, K]
        # Rotated in the token-major layout the projection wrote, and handed to attention as [R, H, C, K]
        # views: the rotation and its backward then read and write whole rows of qkv (and its gradient)
        # instead of transposing them (H200 profile, reference geometry: the rotation's backward and the
        # re-stacking of the head-major gradients cost 5.4 ms of a 50 ms step).
        q, k = AxialRotary.rotate(q, cos, sin), AxialRotary.rotate(k, cos, sin)
        a = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)  # [R, H, C, K]
        a = a.transpose(1, 2).reshape(rows, columns, hidden)  # [R, C, D]
        x = x + self.out(a)
        return x + self.down(F.gelu(self.up(self.mlp_norm(x)), approximate="tanh"))


class Tower(nn.Module):
    """Embedded inputs [R, C, D] and their rotary code (cos, sin [R, C, 1, K/2]) -> final-norm states.

    The rotary code is an input rather than computed inside so that a compiled step can receive it
    materialised once per step (computed eagerly from the positions) instead of re-deriving the sines
    and cosines inside every block's fused kernel.
    """

    def __init__(self, depth: int, hidden: int) -> None:
        super().__init__()
        self.rotary = AxialRotary(HEAD_DIM)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.norm(x)

    def residual_scale(self) -> float:
        """GPT-2's scaled init of the projections that write into the residual stream: 1 / sqrt(2 depth)."""
        return 1.0 / math.sqrt(2 * len(self.blocks))
