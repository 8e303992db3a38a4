"""The learning-rate schedule and the optimizer.

Schedule: linear warmup from zero to the peak over `warmup_steps`, then a half cosine from the peak to
the floor over the remaining `steps - warmup_steps`, then the floor; step numbers count from one across
resumes, so a resumed run continues the same curve.

Optimizer: AdamW (Loshchilov & Hutter 2019) with betas (0.9, 0.98) and epsilon 1e-6, RoBERTa's choice
for transformer pretraining at large batch (the lower beta2 reacts faster to the loss spikes of early
training than 0.999); weight decay 0.01 on the matrices of the tower and heads only: embedding rows,
norms, biases and the learnable temperatures and biases of the contrastive groups are not decayed (a
decayed temperature is pulled toward 1, fighting the loss). The fused kernel on CUDA; on CPU the
for-each implementation, whose arithmetic is deterministic.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import Schedule

BETAS = (0.9, 0.98)
EPSILON = 1e-6
WEIGHT_DECAY = 0.01


def learning_rate(schedule: Schedule, step: int) -> float:
    """The learning rate applied at optimizer step `step` (counted from one)."""
    peak, floor = schedule.learning_rate, schedule.min_learning_rate
    warmup = schedule.warmup_steps
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    span = schedule.steps - warmup
    if span <= 0 or step >= schedule.steps:
        return floor
    progress = (step - warmup) / span
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decays(name: str, parameter: nn.Parameter) -> bool:
    """Matrices decay; embeddings, norms, biases and temperatures do not."""
    return parameter.ndim >= 2 and not name.startswith(("embed.", "temperatures."))


def build_optimizer(network: nn.Module, device: torch.device) -> torch.optim.AdamW:
    decayed: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, p in network.named_parameters():
        (decayed if decays(name, p) else plain).append(p)
    groups = [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": plain, "weight_decay": 0.0}]
    cuda = device.type == "cuda"
    return torch.optim.AdamW(
        groups, lr=0.0, betas=BETAS, eps=EPSILON, fused=cuda or None, foreach=None if cuda else True
    )
