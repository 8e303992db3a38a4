"""A new run's starting weights taken from another run's checkpoint (`Trainer.init_vram(init_from=...)`).

`resume` continues the same run (its step, moments and schedule); `init_from` starts a new one: its own seed,
objective, heads and schedule, a fresh optimizer at step zero, and only the weights it can share taken from the
other run. The other run's checkpoint is checked whole by the reader a resume uses (`stored_run`: header, stored
config, every tensor against the network that config builds; then the digest over all its data) — never
`torch.load` — and must hold a tower of the same depth and hidden. Then every weight whose name, dtype and shape
match the new network is copied bitwise: the tower always, the embeddings (text and each media input) where their
shapes match, the heads where they exist on both sides and match; the temperatures never, since a new run starts
them at the values its own config states. What was taken and what was left fresh is a `StartingWeights` the
loop logs (`StartingWeights.summary`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import TrainerInitVramConfig
from ..model.network import Network
from .checkpoint import DIGEST_KEY, CheckpointError
from .run_schema import WEIGHTS
from .stored_run import read_run_tensors, read_stored_run

__all__ = ["StartingWeights", "load_starting_weights", "plan_starting_weights"]

_NEVER_TAKEN = ("temperatures.", "late_temperatures.")
"""Prefixes a new run starts fresh whatever the other run holds: its config states their starting values."""


@dataclass(frozen=True)
class StartingWeights:
    """Which weights of another run's checkpoint a new run starts from (planned from the header alone)."""

    path: str
    """The other run's checkpoint, as given."""
    source_step: int
    """Optimizer steps the other run had taken when it saved."""
    digest: str
    """The other checkpoint's digest: the file read to copy the weights must be the one planned from."""
    taken: tuple[str, ...]
    """The new network's tensors copied from the other run, by state-dict name."""
    fresh: tuple[str, ...]
    """The new network's tensors left at this run's seeded initialisation (no match, or a temperature)."""
    left: tuple[str, ...]
    """The other run's weights this run has no place for (a head it does not train, a shape that differs)."""

    def summary(self) -> str:
        """One line for a run's log: where the weights came from and how many were taken."""
        fresh = f"; fresh: {', '.join(_groups(self.fresh))}" if self.fresh else ""
        left = f"; not taken: {', '.join(_groups(self.left))}" if self.left else ""
        return (
            f"init_from {os.fsdecode(self.path)} (step {self.source_step}): took {len(self.taken)} tensors "
            f"({', '.join(_groups(self.taken))}){fresh}{left}"
        )


def plan_starting_weights(path: str | os.PathLike, config: TrainerInitVramConfig) -> StartingWeights:
    """The weights the new run of resolved `config` takes from the checkpoint at `path`, from its header alone.

    Raises `CheckpointError` where the file is not a whole uform trainer checkpoint, and `ValueError` naming
    `init_from` where its tower's depth or hidden differs from the new run's.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"init_from: expected a path (str or os.PathLike), got {type(path).__name__}")
    stored = read_stored_run(path)
    shown = os.fsdecode(stored.path)
    other = stored.config
    if (other.depth, other.hidden) != (config.depth, config.hidden):
        raise ValueError(
            f"init_from: {shown} holds a tower of depth {other.depth} and hidden {other.hidden}; this run builds "
            f"depth {config.depth} and hidden {config.hidden}, and only a tower of the same depth and hidden can "
            "start it"
        )
    with torch.device("meta"):
        expected = {k: (v.dtype, tuple(v.shape)) for k, v in Network(config).state_dict().items()}
        held = {k: (v.dtype, tuple(v.shape)) for k, v in Network(other).state_dict().items()}
    taken = tuple(
        name for name, layout in expected.items() if held.get(name) == layout and not name.startswith(_NEVER_TAKEN)
    )
    tower = [name for name in expected if name.startswith("tower.") and name not in taken]
    if tower:  # same depth and hidden build the same tower; a mismatch here is a file this library did not write
        raise CheckpointError(f"{shown}: its tower weights {tower[:3]} do not match the new run's tower")
    chosen = set(taken)
    return StartingWeights(
        path=stored.path if isinstance(stored.path, str) else os.fsdecode(stored.path),
        source_step=stored.step,
        digest=stored.metadata[DIGEST_KEY],
        taken=taken,
        fresh=tuple(name for name in expected if name not in chosen),
        left=tuple(name for name in held if name not in chosen),
    )


@torch.no_grad()
def load_starting_weights(plan: StartingWeights, network: Network, device: torch.device) -> None:
    """Copies the planned weights into `network` (on `device`), bitwise, after reading the whole file and
    verifying its digest; raises `CheckpointError` where the file changed since it was planned."""
    stored = read_stored_run(plan.path)
    if stored.metadata[DIGEST_KEY] != plan.digest:
        raise CheckpointError(f"{plan.path}: the file changed between planning init_from and reading it")
    tensors = read_run_tensors(stored, None, 10, device)
    state = network.state_dict()
    for name in plan.taken:
        state[name].copy_(tensors[WEIGHTS + name])


def _groups(names: tuple[str, ...]) -> list[str]:
    """The top-level modules the names belong to, in order (`tower`, `embed`, `media.image`, ...)."""
    out: list[str] = []
    for name in names:
        parts = name.split(".")
        group = ".".join(parts[:2]) if parts[0] in ("media", "reconstruct") else parts[0]
        if group not in out:
            out.append(group)
    return out
