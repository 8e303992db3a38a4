"""The media modalities' way into the tower and back out: unit embeddings, mask embeddings and heads.

Shape legend: U units of one modality in a step (patches, tubes or frames; a dynamic size), F values
per unit (p²·channels for a patch, tube_frames·p²·channels for a tube, chunk_samples for an audio
frame), D hidden.

A media unit enters the tower at its position as the modality marker's embedding (a learned modality
bias) plus its unit embedding; a masked unit's unit embedding is replaced by the modality's learned mask
embedding (MAE's and VideoMAE's mask tokens, here kept in place inside the packed rows, BEiT-style,
because the rows are shared with text). Each modality has one reconstruction head reading the
final-norm states at its units and predicting the unit's values normalised per unit (MAE's
normalised-pixel target).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

IMAGE, VIDEO, AUDIO = "image", "video", "audio"


def stride_factors(total: int, largest: int = 5) -> list[int]:
    """Splits a frame of `total` samples into convolution strides whose product is `total`.

    Prime factors are merged greedily up to `largest` (wav2vec 2.0's encoder strides 5, 2, 2, 2, 2, 2, 2
    make its 320-sample frame); a prime above `largest` stays a stride of its own.
    """
    factors: list[int] = []
    n, p = total, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1 if p == 2 else 2
        if p * p > n and n > 1:
            factors.append(n)
            break
    merged: list[int] = []
    for f in sorted(factors, reverse=True):
        if merged and merged[-1] * f <= largest:
            merged[-1] *= f
        else:
            merged.append(f)
    return merged or [1]


class AudioFrontend(nn.Module):
    """Raw frames [U, chunk_samples] -> [U, D]: a strided 1-D convolution stack whose total stride is the
    frame (wav2vec 2.0's feature encoder, Baevski et al. 2020), a group norm after the first layer as in
    its base model, GELU between layers, then a linear map to the hidden width.

    The base model's norm normalises each channel over its own samples, which needs more than two of them
    (one sample normalises to zero, erasing the frame; two to a sign). Where the first stride leaves fewer
    (a `chunk_samples` with a large prime factor, e.g. 397), one group spans every channel instead (the
    layer norm of wav2vec 2.0's large model); the parameters are the same either way."""

    def __init__(self, chunk_samples: int, hidden: int, channels: int = 256) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        inputs = 1
        for i, stride in enumerate(stride_factors(chunk_samples)):
            layers.append(nn.Conv1d(inputs, channels, kernel_size=stride, stride=stride, bias=False))
            if i == 0:
                layers.append(nn.GroupNorm(channels if chunk_samples // stride > 2 else 1, channels))
            layers.append(nn.GELU())
            inputs = channels
        self.convolutions = nn.Sequential(*layers)
        self.projection = nn.Linear(channels, hidden)

    def forward(self, frames: Tensor) -> Tensor:
        x = self.convolutions(frames.unsqueeze(1))  # [U, channels, 1]
        return self.projection(x.squeeze(-1))  # [U, D]


class MediaInput(nn.Module):
    """One modality's unit embedding and mask embedding: units [U, F] -> [U, D]."""

    def __init__(self, kind: str, features: int, hidden: int, chunk_samples: int = 0) -> None:
        super().__init__()
        self.kind = kind
        self.embedding: nn.Module = (
            AudioFrontend(chunk_samples, hidden) if kind == AUDIO else nn.Linear(features, hidden)
        )
        self.mask = nn.Parameter(torch.zeros(hidden))

    def forward(self, values: Tensor, masked: Tensor) -> Tensor:
        """values [U, F] (uint8 pixels or float samples); masked [U] bool -> [U, D]."""
        x = values.float() / 127.5 - 1.0 if values.dtype == torch.uint8 else values.float()
        embedded = self.embedding(x.to(self.mask.dtype))  # [U, D]
        return torch.where(masked.unsqueeze(1), self.mask.to(embedded.dtype), embedded)
