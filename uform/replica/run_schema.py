"""The trainer checkpoint's schema: the one place that names its keys. The metadata (`FORMAT_KEY` ... `RNG_KEY`,
and the optional `DATA_KEY`), the tensors (`weights.<name>` of the network's state, `moments.<kind>.<name>` of
AdamW's state per parameter, all three kinds or none), what a save writes (`run_tensors`, `run_metadata`,
`data_slot`), what a resume or a load reads back (`stored_weights`, `restore_moments`, `stored_data`), and which
fields of a stored run a resume may set anew (`RESUMABLE`, `over_stored`, `same_run`). The file itself, written and
read with its digest, is `checkpoint`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import torch

from ..config import TrainerInitVramConfig, to_dict, to_json
from .checkpoint import CheckpointError, no_constants

__all__ = [
    "CONFIG_KEY",
    "COUNTER_KEYS",
    "DATA_FORMAT",
    "DATA_KEY",
    "FORMAT",
    "FORMAT_KEY",
    "MAX_DATA_BYTES",
    "MOMENTS",
    "MOMENT_KINDS",
    "RESUMABLE",
    "RNG_DRAWS",
    "RNG_KEY",
    "STEP_KEY",
    "WEIGHTS",
    "data_slot",
    "over_stored",
    "restore_moments",
    "run_metadata",
    "run_tensors",
    "same_run",
    "stored_data",
    "stored_weights",
]

FORMAT = "uform.trainer.1"
"""The `uform.format` of a trainer checkpoint."""

RNG_DRAWS = "pcg64 keyed by (seed, step, stream)"
"""The `draws` of a checkpoint's `uform.rng`: how this library keys every random draw of a run."""

FORMAT_KEY = "uform.format"
CONFIG_KEY = "uform.config"
"""The resolved run, as `config.to_json` writes it."""
STEP_KEY = "uform.step"
"""Optimizer steps applied."""
DROPPED_KEY = "uform.dropped"
"""Segments dropped since the last step that read its stats."""
SKIPPED_KEY = "uform.skipped"
"""Media items skipped since the last step that read its stats."""
NONFINITE_KEY = "uform.nonfinite"
"""Steps skipped whole as non-finite."""
RNG_KEY = "uform.rng"
"""A label: `{"draws": RNG_DRAWS, "seed": <the run's seed>}`."""
COUNTER_KEYS = (STEP_KEY, DROPPED_KEY, SKIPPED_KEY, NONFINITE_KEY)
"""The counters, in `StoredRun`'s order: non-negative decimal integers, zero where absent."""
DATA_KEY = "uform.data"
"""Optional (issue 13): where the run's data stood at the save, so a resume reads the very record next. JSON:
`{"format": DATA_FORMAT, "state": <the loader's state>}`; absent in a checkpoint saved without one (every file
written before the slot existed), and ignored by a reader that does not look for it."""
DATA_FORMAT = "uform.data.1"
"""The version of `DATA_KEY`'s layout (the state inside carries the loader's own version too)."""
MAX_DATA_BYTES = 1_000_000
"""The most UTF-8 bytes `DATA_KEY` may hold (a loader's state is a few numbers per device), written or read."""

WEIGHTS = "weights."
"""The prefix of each tensor of the network's state dict."""
MOMENTS = "moments."
"""The prefix of AdamW's state: `moments.<kind>.<parameter>` for each kind of `MOMENT_KINDS`."""
MOMENT_KINDS = ("step", "exp_avg", "exp_avg_sq")
"""AdamW's state per parameter: its step count (a float32 scalar) and its two moments (the parameter's shape)."""

RESUMABLE = frozenset({"progress_steps", "schedule"})
"""The fields of a stored run that a resume may set anew (`same_run` compares every other)."""
NOT_STORED = frozenset({"resume", "mesh", "progress", "progress_steps"})
"""Fields a checkpoint does not keep: a resume takes the caller's."""


def run_tensors(network: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What a save writes of a run's tensors: the network's state and each parameter's AdamW state."""
    tensors: dict[str, torch.Tensor] = {f"{WEIGHTS}{k}": v.detach() for k, v in network.state_dict().items()}
    for name, p in network.named_parameters():
        state = optimizer.state.get(p)
        if state:
            tensors[f"{MOMENTS}step.{name}"] = torch.as_tensor(state["step"]).float().reshape(())
            tensors[f"{MOMENTS}exp_avg.{name}"] = state["exp_avg"]
            tensors[f"{MOMENTS}exp_avg_sq.{name}"] = state["exp_avg_sq"]
    return tensors


def run_metadata(
    config: TrainerInitVramConfig, step: int, dropped: int, skipped: int, nonfinite: int, data: str | None = None
) -> dict[str, str]:
    """What a save writes beside the tensors: the format, the resolved run, its counters, and `data` (the
    `DATA_KEY` text of `data_slot`) where given."""
    extra = {} if data is None else {DATA_KEY: data}
    return {
        **extra,
        FORMAT_KEY: FORMAT,
        CONFIG_KEY: to_json(config),
        STEP_KEY: str(step),
        DROPPED_KEY: str(dropped),
        SKIPPED_KEY: str(skipped),
        NONFINITE_KEY: str(nonfinite),
        RNG_KEY: json.dumps({"draws": RNG_DRAWS, "seed": config.seed}),
    }


def data_slot(state: Any) -> str:
    """The `DATA_KEY` text holding `state` (a JSON-able dict: a data loader's position); `ValueError` / `TypeError`
    naming `data_state` for one that is not JSON or is larger than `MAX_DATA_BYTES`."""
    if not isinstance(state, dict):
        raise TypeError(f"data_state: expected a JSON-able dict, got {type(state).__name__}")
    try:
        text = json.dumps({"format": DATA_FORMAT, "state": state}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"data_state: must be plain JSON (dicts, lists, strings, finite numbers): {error}") from None
    if len(text.encode()) > MAX_DATA_BYTES:
        raise ValueError(f"data_state: {len(text.encode())} bytes as JSON, more than MAX_DATA_BYTES={MAX_DATA_BYTES}")
    return text


def stored_data(metadata: Mapping[str, str], shown: str) -> dict[str, Any] | None:
    """The data state a checkpoint's metadata holds (`DATA_KEY`), or None where it holds none; its size is
    bounded before it is parsed, and anything but `data_slot`'s layout is a `CheckpointError`."""
    text = metadata.get(DATA_KEY)
    if text is None:
        return None
    if len(text) > MAX_DATA_BYTES or len(text.encode()) > MAX_DATA_BYTES:
        raise CheckpointError(f"{shown}: {DATA_KEY} is larger than {MAX_DATA_BYTES} bytes")
    try:
        slot = json.loads(text, parse_constant=no_constants)
    except ValueError as error:
        raise CheckpointError(f"{shown}: {DATA_KEY} is not JSON ({error})") from None
    if not isinstance(slot, dict) or set(slot) != {"format", "state"} or not isinstance(slot["state"], dict):
        raise CheckpointError(f'{shown}: {DATA_KEY} must be {{"format": ..., "state": {{...}}}}')
    if slot["format"] != DATA_FORMAT:
        raise CheckpointError(f"{shown}: {DATA_KEY} has format {slot['format']!r}; this reader knows {DATA_FORMAT!r}")
    return slot["state"]


def stored_weights(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The network's state dict among a checkpoint's tensors (what a resume and `uform.load` build from)."""
    return {k.removeprefix(WEIGHTS): v for k, v in tensors.items() if k.startswith(WEIGHTS)}


def restore_moments(
    network: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], fused: bool
) -> None:
    """A resume's AdamW state from a checkpoint's tensors, on the parameters' device (the step counts too
    where the optimizer is `fused`, as CUDA's kernel reads them; on the CPU otherwise)."""
    for name, p in network.named_parameters():
        if f"{MOMENTS}exp_avg.{name}" in tensors:
            step = tensors[f"{MOMENTS}step.{name}"]
            optimizer.state[p] = {
                "step": step.to(p.device if fused else "cpu", torch.float32),
                "exp_avg": tensors[f"{MOMENTS}exp_avg.{name}"].clone(),
                "exp_avg_sq": tensors[f"{MOMENTS}exp_avg_sq.{name}"].clone(),
            }


def over_stored(given: TrainerInitVramConfig, stored: TrainerInitVramConfig) -> TrainerInitVramConfig:
    """The stored run's config with every field the caller set (left non-default) laid over it; `same_run`
    then refuses whatever of that contradicts the stored run."""
    default = TrainerInitVramConfig()
    changes = {
        f.name: getattr(given, f.name)
        for f in dataclasses.fields(TrainerInitVramConfig)
        if f.name in NOT_STORED or getattr(given, f.name) != getattr(default, f.name)
    }
    return dataclasses.replace(stored, **changes)


def same_run(config: TrainerInitVramConfig, stored: TrainerInitVramConfig) -> None:
    """A resume continues the stored run: every field but those of `RESUMABLE` must agree."""

    def compare(mine: Any, theirs: Any, name: str) -> None:
        if isinstance(mine, dict) and isinstance(theirs, dict):
            for key in sorted(set(mine) | set(theirs)):
                if not name and key in RESUMABLE:
                    continue
                compare(mine.get(key), theirs.get(key), f"{name}.{key}" if name else key)
        elif mine != theirs:
            raise ValueError(
                f"{name}: the checkpoint's run has {theirs!r}, this config {mine!r}; "
                "a resume must keep the run's geometry, objective and seed"
            )

    compare(to_dict(config), to_dict(stored), "")
