"""A run's memory: what one device's training step holds at its batch capacities, estimated from the resolved
config before anything is allocated, and checked against what the device has (`Trainer.init_vram`).

Shape legend: R rows (`batch.max_rows_per_device`), C columns (`batch.max_columns_per_row`), D hidden,
L depth, F values per media unit, W late interaction's token width.

The estimate sums, in bytes:

- parameters (float32; autocast keeps no other copy, so there are no master weights), their AdamW moments
  (two float32 per parameter) and their gradients (one);
- activations: what autograd saves for backward at full capacity, R x C x D x (a per block x L + b for the
  heads), plus, on the CPU's dense attention path, the R x C x C float mask scaled dot-product attention
  saves in every block, and the late-interaction term's token vectors, argmax and MaxSim chunks;
- media buffers: R x C units at most (a unit takes a position), each of F values, as uint8 on the host and
  the device, float32 in the unit embedding's input, the normalised target and the reconstruction.

The constants are measured, not derived from first principles (the next section says how); the estimate is
meant to catch a geometry that cannot fit (the reference geometry's on a CPU machine: about 60 GiB), not to size a
tight margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import TrainerInitVramConfig
from ..data.batch import media_features
from ..losses.late import chunk_elements
from ..model.network import Network
from ..notices import MemoryWarning, Notices

# ---- measured constants: bytes per (position x hidden) ---------------------------------------------
# CPU (float32, eager, dense attention): counted with `torch.autograd.graph.saved_tensors_hooks` over one
# Joint step (distinct storages, parameters excluded) at depths 1, 2 and 4, hidden 128 and 256, 8 to 16 rows
# of 64 to 1024 columns: 84 bytes a block (21 float32 values a position and hidden unit: the norms' inputs and
# outputs, q k v and the rotated q k, the attention output and its transpose, the MLP's 4D up-projection and
# its tanh-GELU), 16 a run for the heads, and 4 bytes per row per C x C (the float mask SDPA makes of the
# boolean document mask) a block. Backward adds a block's widest gradients (about 8 float32 per position and
# hidden unit) and the mask's gradient-side copy. tests/test_memory.py holds the count and a process's peak
# resident memory to this within the factors it states.
CPU_BLOCK_BYTES = 84.0
CPU_HEAD_BYTES = 16.0
CPU_MASK_BYTES = 4.0
CPU_BACKWARD_BYTES = 32.0
CPU_BACKWARD_MASK_BYTES = 8.0
# CUDA (bf16 autocast, compiled, FlexAttention: no C x C term): peak allocated over a step beyond the weights
# and moments, measured on an H200 (torch 2.11) at the reference geometry and with rows, columns and depth
# halved and hidden doubled, linear in each: 42.3 bytes a block and 10.9 for the heads, gradients included
# (4.6 of them at the reference geometry), the transients of backward included. Measured with the float32
# residual stream; the bf16 one (2026-12-02) peaked 1.56 GiB lower at the reference geometry (14.38 against
# 15.94 GiB, bench/step.py), so these now overstate a step by about that much until re-measured.
CUDA_BLOCK_BYTES = 42.5
CUDA_HEAD_BYTES = 6.5
# Late interaction: each device's MaxSim holds a few chunks at once (`losses.late.chunk_elements`); at the
# reference geometry with weight 0.5 the step peaked 1.25 GB above the same run without it (H200).
LATE_CHUNKS = 2
MEDIA_UNIT_BYTES = 14
"""Bytes per media value at capacity: uint8 on the host and the device, four float32 copies on the way in
and out (the embedding's input, the normalised target, the reconstruction, its gradient)."""

_NOTICES = Notices()
"""This process's memory warnings: shown once (again when an estimate overshoots twice as far), counted."""

GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """What one device's training step holds at the run's capacities, in bytes, by part."""

    parameters: int
    """The network's weights (float32)."""
    moments: int
    """AdamW's two moments per weight (float32)."""
    gradients: int
    """One gradient per weight (float32)."""
    activations: int
    """What backward keeps and needs at full batch capacity (the late-interaction term's included)."""
    media: int
    """The media units' buffers at full capacity (zero in a text-only run)."""

    @property
    def total(self) -> int:
        """Every part, summed."""
        return self.parameters + self.moments + self.gradients + self.activations + self.media

    def describe(self) -> str:
        """The total and its parts in GiB, for a message."""
        parts = ", ".join(
            f"{name.replace('moments', 'AdamW moments')} {getattr(self, name) / GIB:.2f}"
            for name in ("parameters", "moments", "gradients", "activations", "media")
        )
        return f"about {self.total / GIB:.1f} GiB ({parts})"


def parameter_count(config: TrainerInitVramConfig) -> int:
    """The weights of the run's network, counted on the meta device (shapes only, nothing allocated)."""
    with torch.device("meta"):
        network = Network(config)
    return sum(p.numel() for p in network.parameters())


def estimate_memory(config: TrainerInitVramConfig, device_type: str) -> MemoryEstimate:
    """The memory one device's step of the resolved run `config` holds on a device of `device_type`
    ("cuda" or "cpu": precision and attention path differ), at full batch capacity."""
    b = config.batch
    positions = b.max_rows_per_device * b.max_columns_per_row  # R x C
    weights = parameter_count(config)
    cuda = device_type == "cuda"
    block, heads = (CUDA_BLOCK_BYTES, CUDA_HEAD_BYTES) if cuda else (CPU_BLOCK_BYTES, CPU_HEAD_BYTES)
    activations = positions * config.hidden * (block * config.depth + heads)
    if not cuda:  # the dense path: a [R, 1, C, C] mask per block, and backward's widest gradients
        square = positions * b.max_columns_per_row  # R x C x C
        activations += square * (CPU_MASK_BYTES * config.depth + 1 + CPU_BACKWARD_MASK_BYTES)
        activations += positions * config.hidden * CPU_BACKWARD_BYTES
    li = config.late_interaction
    if li.weight > 0:
        tokens = li.max_query_tokens_per_device + li.max_document_tokens_per_device
        activations += tokens * li.width * 4 * 4  # projected, normalised, and their gradients, float32
        activations += li.max_query_tokens_per_device * li.max_documents_per_device * 8  # argmax, int64
        activations += LATE_CHUNKS * chunk_elements(torch.device(device_type)) * 4
    features = media_features(config)
    media = positions * max(features.values(), default=0) * MEDIA_UNIT_BYTES
    return MemoryEstimate(
        parameters=4 * weights,
        moments=8 * weights,
        gradients=4 * weights,
        activations=math.ceil(activations),
        media=media,
    )


def available_memory(device: torch.device) -> int | None:
    """Bytes the device can still give: a CUDA device's free memory (`torch.cuda.mem_get_info`), the CPU's
    MemAvailable from /proc/meminfo; None where that cannot be read (no /proc, as on macOS)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def shrink_advice(config: TrainerInitVramConfig, estimate: MemoryEstimate) -> str:
    """Which fields to shrink, the largest part's first."""
    b = config.batch
    capacity = (
        f"batch.max_rows_per_device ({b.max_rows_per_device}) or batch.max_columns_per_row ({b.max_columns_per_row})"
    )
    if config.late_interaction.weight > 0:
        capacity += " (or late_interaction's token capacities)"
    parts = [
        (estimate.activations, capacity),
        (
            estimate.parameters + estimate.moments + estimate.gradients,
            f"depth ({config.depth}) or hidden ({config.hidden})",
        ),
    ]
    if estimate.media:
        parts.append(
            (estimate.media, "the media's unit size (batch.image / batch.video patch_side, batch.audio.chunk_samples)")
        )
    parts.sort(key=lambda part: -part[0])
    return "shrink " + ", then ".join(advice for _, advice in parts)


def check_memory(
    config: TrainerInitVramConfig,
    device: torch.device,
    *,
    available: int | None = None,
    notices: Notices | None = None,
) -> MemoryEstimate:
    """Estimates the resolved run's step on `device` and compares it with what the device has (`available`,
    default `available_memory(device)`). Over it, raises `ValueError` on CUDA (the run would fail in its first
    step) and warns once with a `MemoryWarning` on the CPU (where the kernel's out-of-memory killer would
    end the process without a word, but swap or a pessimistic estimate may let it through). Answers the
    estimate; allocates nothing."""
    estimate = estimate_memory(config, device.type)
    have = available_memory(device) if available is None else available
    if have is None or estimate.total <= have:
        return estimate
    b = config.batch
    message = (
        f"memory: this run's step needs {estimate.describe()} on {device} at depth {config.depth}, hidden "
        f"{config.hidden} and batch {b.max_rows_per_device} x {b.max_columns_per_row}, but the device has "
        f"{have / GIB:.1f} GiB available; {shrink_advice(config, estimate)}"
    )
    if device.type == "cuda":
        raise ValueError(message)
    (_NOTICES if notices is None else notices).warn(
        "memory",
        message + " (on the CPU this is a warning: the process may be killed by the out-of-memory killer)",
        MemoryWarning,
        level=estimate.total / max(have, 1),
        stacklevel=3,
    )
    return estimate
