"""One device's step, prepared on the host: packed rows, corruption, targets and pair matrices.

Shape legend: N items, R rows, C columns, S segment slots, P covered-position capacity.

Every array has a shape fixed by the run's capacities (never by the step's content), so the compiled
step sees the same shapes every time. Every draw comes from a generator keyed by (seed, step, stream).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import vocab
from ..config import TrainerInitVramConfig
from ..enums import LateInteractionSide, Modality, Objective
from ..relations import pair_targets
from .corrupt import corrupt_text
from .pack import Layout, Rows, fill_text, plan

PACK_STREAM = 1
CORRUPT_STREAM = 2


def keyed_rng(seed: int, step: int, stream: int) -> np.random.Generator:
    """The generator of one (seed, step, stream): the same key gives the same draws on any machine."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, stream])))


def covered_capacity(config: TrainerInitVramConfig) -> int:
    """P: every text segment covers round(p * n) <= p * n + 1/2 positions, so this always suffices."""
    b = config.batch
    if config.objective == Objective.Contrastive:
        return 1
    positions = b.max_rows_per_device * b.max_columns_per_row
    return min(positions, math.ceil(config.masking.token_mask_probability * positions) + b.max_segments_per_device)


@dataclass
class Batch:
    """Host arrays of one device's step, fixed shapes."""

    tokens: np.ndarray  # [R, C] int64, corrupted where the objective masks
    positions: np.ndarray  # [R, C, 3] int64
    segments: np.ndarray  # [R, C] int64 slot ids, padding = S
    counts: np.ndarray  # [S] int64 positions per slot
    target_index: np.ndarray  # [P] int64 flat (row * C + column) covered positions
    targets: np.ndarray  # [P] int64 original bytes there
    target_weight: np.ndarray  # [P] float32, 1 covered / 0 capacity padding
    slot_valid: np.ndarray  # [S] bool
    slot_group: np.ndarray  # [S] int64
    z: np.ndarray  # [S, S] float32 +1 / -1 / 0
    w: np.ndarray  # [S, S] float32
    layout: Layout = field(repr=False)
    positives: int = 1
    """A power of two at least the most positives any slot's row holds (the ranked form's static bound)."""
    truncated: int = 0
    dropped: int = 0

    TENSORS = (
        "tokens",
        "positions",
        "segments",
        "counts",
        "target_index",
        "targets",
        "target_weight",
        "slot_valid",
        "slot_group",
        "z",
        "w",
    )

    def host_tensors(self, pin: bool) -> dict[str, torch.Tensor]:
        """The arrays as host tensors, page-locked when `pin` (so the copy to a GPU runs asynchronously)."""
        out = {}
        for name in self.TENSORS:
            t = torch.from_numpy(np.ascontiguousarray(getattr(self, name)))
            out[name] = t.pin_memory() if pin else t
        return out


def prepare(
    config: TrainerInitVramConfig,
    modalities: list[Modality],
    contents: Sequence[bytes | memoryview],
    *,
    bags: np.ndarray | None,
    groups: np.ndarray | None,
    sides: list[LateInteractionSide] | None,
    relations: object,
    step: int,
) -> Batch:
    """Packs, corrupts and pairs one step's items for one device. Inputs were checked by the caller."""
    b = config.batch
    R, C, S = b.max_rows_per_device, b.max_columns_per_row, b.max_segments_per_device
    n = len(contents)
    late = config.late_interaction.weight > 0
    prefixes = [
        vocab.prefix(m, (sides[i] if sides is not None else LateInteractionSide.None_) if late else None)
        for i, m in enumerate(modalities)
    ]
    lengths = np.array([len(p) + len(c) for p, c in zip(prefixes, contents, strict=True)], dtype=np.int64)
    layout = plan(
        lengths,
        bags if bags is not None else np.arange(n),
        rows=R,
        columns=C,
        segments=S,
        max_bags=b.max_bags_per_device,
        rng=keyed_rng(config.seed, step, PACK_STREAM),
    )
    rows = Rows.empty(R, C)
    spans: list[tuple[int, int, int]] = []
    for i in np.flatnonzero(layout.placed).tolist():
        fill_text(rows, layout, i, prefixes[i], contents[i])
        p = len(prefixes[i])
        spans.append((int(layout.row[i]), int(layout.column[i]) + p, int(layout.length[i]) - p))

    capacity = covered_capacity(config)
    target_index = np.zeros(capacity, dtype=np.int64)
    targets = np.zeros(capacity, dtype=np.int64)
    target_weight = np.zeros(capacity, dtype=np.float32)
    tokens = rows.tokens
    if config.objective != Objective.Contrastive:
        tokens, covered = corrupt_text(rows.tokens, spans, config.masking, keyed_rng(config.seed, step, CORRUPT_STREAM))
        where = np.flatnonzero(covered.reshape(-1))
        target_index[: len(where)] = where
        targets[: len(where)] = rows.tokens.reshape(-1)[where]
        target_weight[: len(where)] = 1.0

    segments = np.where(rows.segments < 0, S, rows.segments)
    counts = np.bincount(segments.reshape(-1), minlength=S + 1)[:S].astype(np.int64)
    placed = np.flatnonzero(layout.placed)
    slots = layout.slot[placed]
    slot_valid = np.zeros(S, dtype=bool)
    slot_valid[slots] = True
    slot_group = np.zeros(S, dtype=np.int64)
    if groups is not None:
        slot_group[slots] = groups[placed]
    z = np.zeros((S, S), dtype=np.float32)
    w = np.zeros((S, S), dtype=np.float32)
    if config.objective != Objective.Masked:
        c = config.contrastive
        z_items, w_items = pair_targets(relations, n, c.negatives, c.ambient_repulsion_weight)  # type: ignore[arg-type]
        z[np.ix_(slots, slots)] = z_items[np.ix_(placed, placed)]
        w[np.ix_(slots, slots)] = w_items[np.ix_(placed, placed)]
    most = int((z > 0).sum(axis=1).max()) if S else 0
    return Batch(
        positives=1 << max(0, most - 1).bit_length(),
        tokens=tokens,
        positions=rows.positions,
        segments=segments,
        counts=counts,
        target_index=target_index,
        targets=targets,
        target_weight=target_weight,
        slot_valid=slot_valid,
        slot_group=slot_group,
        z=z,
        w=w,
        layout=layout,
        truncated=int(layout.truncated.sum()),
        dropped=layout.dropped,
    )
