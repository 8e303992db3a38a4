"""Masked reconstruction terms, as sums with their counts (the caller divides by the global count).

Shape legend: P covered positions (padded to a fixed capacity), V = 256 byte values, U units of one
media modality, F values per unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .term import Term


def masked_text_sum(logits: Tensor, targets: Tensor, weight: Tensor) -> Term:
    """Cross-entropy over the byte values at every covered position.

    logits [P, V]; targets [P] byte values; weight [P] 1 for a covered position, 0 for capacity padding.
    Answers (sum of the cross-entropies, number of covered positions).
    """
    losses = F.cross_entropy(logits.float(), targets, reduction="none")  # [P]
    return Term((losses * weight).sum(), weight.sum())


def normalised_targets(values: Tensor, eps: float = 1e-6) -> Tensor:
    """Each unit's values [U, F] normalised to mean 0 and variance 1 over its own F values (MAE's
    normalised-pixel target, He et al. 2022; per patch, per tube and per audio frame alike)."""
    x = values.float()
    mean = x.mean(dim=1, keepdim=True)
    variance = x.var(dim=1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(variance + eps)


def masked_units_sum(predictions: Tensor, values: Tensor, masked: Tensor) -> Term:
    """Mean squared error over the masked units' values.

    predictions [U, F] the head's output; values [U, F] the units as decoded; masked [U] bool.
    Answers (sum over masked units of each unit's mean squared error, number of masked units): every
    unit has F values, so their ratio is the mean over all masked values.
    """
    per_unit = (predictions.float() - normalised_targets(values)).pow(2).mean(dim=1)  # [U]
    weight = masked.float()
    return Term((per_unit * weight).sum(), weight.sum())
