"""Input embeddings: token ids to vectors, and the axial rotary position code shared by every block.

Shape legend: R rows, C columns, D hidden, H heads, K head width (64), F = K / 2 rotary frequencies.

Positions are axial triples (time, row, column) restarting in every segment (see `data/pack.py`). The
rotary frequencies are split into three sections, one per axis, as in Qwen2-VL's multimodal RoPE (Wang et
al. 2024): a text or audio position carries the same index on all three axes, which makes the code the
plain 1-D RoPE of Su et al. (2021) for them, while image patches rotate by (row, column) and video tubes
by (time, row, column). Relative offsets inside a segment are what attention sees; segments never see
each other (the document mask), so restarting positions per segment loses nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import vocab


class TokenEmbedding(nn.Module):
    """Byte and special ids [R, C] to vectors [R, C, D]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab.VOCAB, hidden)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.table(tokens)


class AxialRotary(nn.Module):
    """Answers (cos, sin) [R, C, 1, F] for positions [R, C, 3]; `rotate` applies them to [R, C, H, K]."""

    inverse_frequency: Tensor
    axis: Tensor

    def __init__(self, head_width: int, base: float = 10000.0) -> None:
        super().__init__()
        frequencies = head_width // 2
        inverse = base ** (-torch.arange(frequencies, dtype=torch.float64) * 2 / head_width)
        # Sections (time, row, column) in the ratio 1 : 1.5 : 1.5, the highest frequencies to time.
        time = frequencies // 4
        row = (frequencies - time) // 2
        axis = torch.cat([torch.zeros(time), torch.ones(row), torch.full((frequencies - time - row,), 2.0)]).long()
        self.register_buffer("inverse_frequency", inverse.float(), persistent=False)
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        chosen = positions[..., self.axis].float()  # [R, C, F]
        angles = chosen * self.inverse_frequency  # [R, C, F]
        return angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)  # [R, C, 1, F]

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotates the (first half, second half) pairs of x [R, C, H, K] (any layout whose code broadcasts)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
