"""Masked reconstruction terms, as sums with their counts (the caller divides by the global count).

Shape legend: P covered positions (padded to a fixed capacity), V = 256 byte values.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def masked_text_sum(logits: Tensor, targets: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Cross-entropy over the byte values at every covered position.

    logits [P, V]; targets [P] byte values; weight [P] 1 for a covered position, 0 for capacity padding.
    Answers (sum of the cross-entropies, number of covered positions).
    """
    losses = F.cross_entropy(logits.float(), targets, reduction="none")  # [P]
    return (losses * weight).sum(), weight.sum()
