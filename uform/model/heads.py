"""Heads over the tower's final-norm states.

Shape legend: R rows, C columns, S segment slots, D hidden, P covered (masked) positions, G temperature
groups.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import vocab


class PooledHead(nn.Module):
    """Per-segment mean pooling along the segment axis, then a linear projection: [R, C, D] -> [S, D].

    Every position of a segment (prefix and content) weighs the same; padding belongs to no slot.
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.projection = nn.Linear(hidden, hidden, bias=False)

    def forward(self, states: Tensor, segments: Tensor, counts: Tensor) -> Tensor:
        """states [R, C, D]; segments [R, C] slot ids with padding mapped to S; counts [S] positions per slot."""
        slots = counts.shape[0]
        flat = states.reshape(-1, states.shape[-1]).float()  # [R*C, D]
        sums = torch.zeros(slots + 1, flat.shape[1], device=flat.device, dtype=flat.dtype)
        sums = sums.index_add(0, segments.reshape(-1), flat)[:slots]  # [S, D]
        mean = sums / counts.clamp_min(1).unsqueeze(1).to(sums.dtype)
        return self.projection(mean.to(states.dtype))  # [S, D]


class MaskedTextHead(nn.Module):
    """Logits over the 256 byte values at chosen positions: [P, D] -> [P, 256]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(hidden, vocab.BYTES)

    def forward(self, states: Tensor) -> Tensor:
        return self.classifier(states)


class TokenHead(nn.Module):
    """Late interaction's token vectors: a linear map to `width`, L2-normalised per position:
    [..., D] -> [..., W] (ColBERT's per-token projection, Khattab and Zaharia 2020)."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.projection = nn.Linear(hidden, width, bias=False)

    def forward(self, states: Tensor) -> Tensor:
        return F.normalize(self.projection(states).float(), dim=-1)


class Temperatures(nn.Module):
    """Learnable inverse temperature (as its log) and logit bias, one pair per group: [G] each."""

    def __init__(self, groups: int, inverse_temperature: float, bias: float) -> None:
        super().__init__()
        self.log_inverse_temperature = nn.Parameter(torch.full((groups,), math.log(inverse_temperature)))
        self.bias = nn.Parameter(torch.full((groups,), float(bias)))
