"""A world's agreement on its run: every process of a world builds the same run from the same step, or none
does. `compare_runs` is called by each replica of a world as it is built (`Replica.build`): one all-gather of a
digest of the resolved run and the step it starts from, and the runs themselves only when the digests differ,
to name the first field that does.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from ..runtime.world import MeshError, World

__all__ = ["compare_runs", "first_difference"]


def compare_runs(world: World, text: str | None, step: int) -> None:
    """Every process of a world calls this in init_vram with its resolved run as JSON (None: this process
    could not build one) and the step it starts from; raises on every process when they differ."""
    digest = np.zeros(2, dtype=np.int64)
    if text is not None:
        digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], dtype=np.int64)
    mine = torch.tensor([int(text is not None), *digest.tolist(), step], dtype=torch.int64, device=world.device)
    try:
        every = world.all_gather(mine[None]).cpu().tolist()  # [W, 4]
        world.check()  # an NCCL world aborted while this process waited: `every` is not the others' rows
        texts: list[Any] = [None] * world.size
        if all(row[0] for row in every) and any(row[1:3] != every[0][1:3] for row in every):
            torch.distributed.all_gather_object(texts, text, group=world.group)
            world.check()
    except Exception as error:
        raise MeshError(f"mesh: the processes of the run could not compare their runs ({error})") from error
    if text is None:
        return
    failed = [rank for rank, row in enumerate(every) if not row[0]]
    if failed:
        raise MeshError(
            f"mesh: processes {failed} could not build the run (their init_vram raised; see their errors); "
            "every process of a run builds it, or none does"
        )
    for rank, row in enumerate(every):
        if row[1:3] != every[0][1:3]:
            field, ours, theirs = first_difference(json.loads(texts[0]), json.loads(texts[rank]))
            raise ValueError(
                f"config: process {rank} builds another run than process 0: its {field} is {theirs!r}, "
                f"process 0's {ours!r}; every process of a run calls init_vram with the same geometry, "
                "objective, seed and schedule"
            )
    for rank, row in enumerate(every):
        if row[3] != every[0][3]:
            raise ValueError(
                f"resume: process {rank} starts at step {row[3]}, process 0 at step {every[0][3]}; every "
                "process of a run resumes the same checkpoint"
            )


def first_difference(ours: Any, theirs: Any, name: str = "") -> tuple[str, Any, Any]:
    """The first field (dotted) where two config records differ, with both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                return first_difference(ours.get(key), theirs.get(key), f"{name}.{key}" if name else key)
    return name or "config", ours, theirs
