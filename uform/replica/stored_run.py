"""A trainer checkpoint checked against the run it claims to hold, before anything is built from it.

A resume and `serve.load` both build a network from the config a checkpoint stores. The digest (a plain SHA-256,
which anyone who edits a file can recompute) says a file is intact, not that it is ours, so a forged header is
refused on its own terms, from the header alone, before any data is read or anything allocated:

- the stored config must be a valid run (`config.resolve`, the library's own rules, naming the field);
- every count and label beside it has a type and a range: `uform.step`, `uform.dropped`, `uform.skipped` and `uform.nonfinite` are
  non-negative decimal integers below 2^63 (zero where absent); `uform.rng` names the draws this library makes and the config's seed;
- the network that config would build must be exactly the tensors the file holds: each weight its name, dtype
  and shape, each parameter's Adam moments (step, exp_avg, exp_avg_sq) all three or none, nothing else. The
  shapes come from the network itself, built on torch's "meta" device (no memory), and the loops of that build
  that a size drives are bounded by the file first: no more blocks than the file holds weights for, and the
  audio frontend's factoring of `chunk_samples` only where the file holds that many weight elements.

Since the file's tensors span exactly its data (`checkpoint.read_checkpoint`), a file that passes allocates at
most its own length when read, and the network built from its config is the size of the tensors it holds. The
data is then read and its digest verified before anything is built (`read_run_tensors`); the moments' step
counters are checked then (finite, whole, between zero and the run's step), and every weight must be finite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..config import TrainerInitVramConfig, from_dict, resolve
from ..model.network import Network
from .checkpoint import CheckpointError, Layout, ProgressCallback, read_checkpoint, read_layout
from .run_schema import (
    CONFIG_KEY,
    COUNTER_KEYS,
    FORMAT,
    FORMAT_KEY,
    MOMENT_KINDS,
    MOMENTS,
    RNG_DRAWS,
    RNG_KEY,
    WEIGHTS,
    over_stored,
    same_run,
    stored_data,
)

__all__ = [
    "StoredRun",
    "check_finite",
    "check_weights",
    "read_data_state",
    "read_run_tensors",
    "read_stored_run",
    "resolve_run",
]

_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")


@dataclass(frozen=True)
class StoredRun:
    """A trainer checkpoint whose header passed every check: what its metadata says, parsed."""

    path: str | bytes
    """The checkpoint's path, as given."""
    metadata: dict[str, str]
    """Its metadata, digest included."""
    config: TrainerInitVramConfig
    """The run it stores, resolved."""
    step: int
    """Optimizer steps the run had taken."""
    dropped: int
    """Segments dropped since the last step that read its stats."""
    skipped: int
    """Media items skipped since the last step that read its stats."""
    nonfinite: int
    """Steps skipped whole because their loss or gradients were not finite (numbered, but no update applied)."""
    data: dict[str, Any] | None = None
    """Where the run's data stood at the save (`run_schema.DATA_KEY`, a loader's state), None where not stored."""


def read_stored_run(path: str | bytes | os.PathLike) -> StoredRun:
    """The trainer checkpoint at `path`, from its header alone, every field checked (see the module docstring).

    Raises `CheckpointError` naming the file and the rule broken; reads no data and allocates nothing sized by
    the file beyond its header.
    """
    target = os.fspath(path)
    shown = os.fsdecode(target)
    metadata, layout = read_layout(target)
    found = metadata.get(FORMAT_KEY)
    if found != FORMAT:
        raise CheckpointError(
            f"{shown}: not a uform trainer checkpoint (its {FORMAT_KEY} is {found!r}, expected {FORMAT!r})"
        )
    try:
        config = resolve(from_dict(json.loads(metadata[CONFIG_KEY])))
    except (KeyError, ValueError, TypeError, RecursionError) as error:
        raise CheckpointError(f"{shown}: its stored config is not a valid run ({error})") from None
    counts = [_counter(metadata, key, shown) for key in COUNTER_KEYS]
    _check_rng(metadata, config, shown)
    _check_layout(config, layout, shown)
    step, dropped, skipped, nonfinite = counts
    data = stored_data(metadata, shown)
    return StoredRun(target, metadata, config, step, dropped, skipped, nonfinite, data)


def read_data_state(path: str | bytes | os.PathLike) -> dict[str, Any] | None:
    """The data state a trainer checkpoint stores (`Trainer.save(..., data_state=...)`), or None where it stores
    none; the header is checked whole first (`read_stored_run`), so a foreign file is a `CheckpointError`."""
    return read_stored_run(path).data


def resolve_run(config: TrainerInitVramConfig) -> tuple[TrainerInitVramConfig, StoredRun | None]:
    """The resolved run of an init config (the stored run's, with what the caller set, on a resume alone),
    checked against the checkpoint it resumes, whose header is checked whole (`read_stored_run`); answers it
    and the stored run."""
    stored = None
    if config.resume is not None:
        stored = read_stored_run(config.resume)
        if config.depth == 0 and config.hidden == 0:  # resume alone: the stored run's config,
            config = over_stored(config, stored.config)  # and what was set
    resolved = resolve(config)
    if stored is not None:
        same_run(resolved, stored.config)
    return resolved, stored


def read_run_tensors(
    run: StoredRun,
    progress: ProgressCallback | None,
    progress_steps: int,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """The tensors of a checked run, on `device`, their digest verified (`checkpoint.read_checkpoint`), and the
    file the same one whose header `read_stored_run` checked."""
    tensors, metadata = read_checkpoint(run.path, progress, progress_steps, device)
    shown = os.fsdecode(run.path)
    if metadata != run.metadata:  # the digest covers every name, dtype and shape: equal metadata, equal layout
        raise CheckpointError(f"{shown}: the file changed between its header's checks and its reading")
    ceiling = torch.tensor(float(run.step), dtype=torch.float32).item()  # the step as a save stores it
    for name, value in tensors.items():
        if name.startswith(f"{MOMENTS}step."):
            count = value.item()
            if not (math.isfinite(count) and count == int(count) and 0 <= count <= ceiling):
                raise CheckpointError(
                    f"{shown}: {name} is {count}; an Adam step count is a whole number in [0, uform.step={run.step}]"
                )
    check_finite({k.removeprefix(WEIGHTS): v for k, v in tensors.items() if k.startswith(WEIGHTS)}, shown)
    return tensors


def _counter(metadata: dict[str, str], key: str, shown: str) -> int:
    text = metadata.get(key)
    if text is None:
        return 0  # a file that never stepped may leave its counters out (the serving fixtures and benches do)
    if not _DECIMAL.fullmatch(text) or int(text) >= 2**63:
        raise CheckpointError(f"{shown}: {key} must be a non-negative decimal integer below 2^63, got {_short(text)}")
    return int(text)


def _check_rng(metadata: dict[str, str], config: TrainerInitVramConfig, shown: str) -> None:
    text = metadata.get(RNG_KEY)
    if text is None:
        return  # a label, not read: absent is fine, present it must say what this library draws
    expected = {"draws": RNG_DRAWS, "seed": config.seed}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = text
    if value != expected:
        raise CheckpointError(f"{shown}: {RNG_KEY} must be {json.dumps(expected)}, got {_short(text)}")


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:60]) + "..."


def _mismatch(shown: str, detail: str) -> CheckpointError:
    return CheckpointError(f"{shown}: its tensors do not match its config ({detail})")


def _meta_network(config: TrainerInitVramConfig, shown: str, depth: int | None = None) -> Network:
    """The network `config` builds (at `depth` blocks where given), on the meta device: shapes, no memory."""
    try:
        with torch.device("meta"):
            return Network(config if depth is None else dataclasses.replace(config, depth=depth))
    except (RuntimeError, TypeError, ValueError, OverflowError) as error:
        # A size past what torch can index (hidden 2^62: "Storage size calculation overflowed"): no such file.
        raise _mismatch(shown, f"its network cannot be built: {str(error).splitlines()[0]}") from None


def _shapes(network: Network) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every state tensor of `network`, (dtype, shape) by name."""
    return {k: (v.dtype, tuple(v.shape)) for k, v in network.state_dict().items()}


def _check_layout(config: TrainerInitVramConfig, layout: Layout, shown: str) -> None:
    weights = {k.removeprefix(WEIGHTS): v for k, v in layout.items() if k.startswith(WEIGHTS)}
    network = check_weights(config, weights, shown)
    parameters = {k: (p.dtype, tuple(p.shape)) for k, p in network.named_parameters()}
    moments: dict[str, set[str]] = {}
    for name, (dtype, shape) in layout.items():
        if name.startswith(WEIGHTS):
            continue
        kind, _, parameter = name.removeprefix(MOMENTS).partition(".")
        if not name.startswith(MOMENTS) or kind not in MOMENT_KINDS or parameter not in parameters:
            raise _mismatch(shown, f"unexpected tensor {name!r}")
        want = (torch.float32, ()) if kind == "step" else parameters[parameter]
        if (dtype, shape) != want:
            raise _mismatch(shown, f"{name!r} is {dtype} {list(shape)}, the run needs {want[0]} {list(want[1])}")
        moments.setdefault(parameter, set()).add(kind)
    for parameter, kinds in sorted(moments.items()):
        if len(kinds) != len(MOMENT_KINDS):
            raise _mismatch(
                shown, f"parameter {parameter!r} has moments {sorted(kinds)}, not all of {list(MOMENT_KINDS)}"
            )


def check_weights(config: TrainerInitVramConfig, weights: Layout, shown: str) -> Network:
    """Checks that the network `config` builds holds exactly the tensors `weights` lays out (name -> dtype,
    shape, the state dict's names), every loop of the meta build bounded by the file first (the module
    docstring); answers that network, on the meta device. `CheckpointError` naming `shown` otherwise."""
    held_elements = sum(math.prod(shape) for _, shape in weights.values())

    # The meta build allocates nothing, but two of its loops run as long as a size says: bound those by the file
    # first. The audio reconstruction head is [chunk_samples, hidden], so a genuine file holds at least
    # chunk_samples weight elements (and the frontend's factoring of it stays short),
    chunk = config.batch.audio.chunk_samples
    if chunk > held_elements:
        raise _mismatch(shown, f"batch.audio.chunk_samples {chunk} exceeds the {held_elements} weight elements held")
    # and the depth's loop builds no more blocks than the file holds weights for (the one-block network's
    # tensors plus those each further block adds).
    one, two = len(_shapes(_meta_network(config, shown, 1))), len(_shapes(_meta_network(config, shown, 2)))
    need = one + (config.depth - 1) * (two - one)
    if config.depth > 2 and need > len(weights):  # (at depth 1 or 2 the names below say more)
        raise _mismatch(shown, f"depth {config.depth} makes {need} weights, the file holds {len(weights)}")

    network = _meta_network(config, shown)
    expected = _shapes(network)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise _mismatch(shown, f"missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    for name, (dtype, shape) in weights.items():
        if (dtype, shape) != expected[name]:
            want_dtype, want_shape = expected[name]
            raise _mismatch(
                shown, f"weight {name!r} is {dtype} {list(shape)}, the config needs {want_dtype} {list(want_shape)}"
            )
    return network


def check_finite(weights: dict[str, torch.Tensor], shown: str) -> None:
    """Refuses weights holding NaN or infinite values (`CheckpointError` naming `shown` and the first few)."""
    # A trainer refuses to save non-finite weights; a file that holds them anyway (forged, or written before that
    # rule) would serve NaN vectors that look like an answer, and resume a run that can never recover.
    broken = [
        name for name, value in weights.items() if value.is_floating_point() and not bool(torch.isfinite(value).all())
    ]
    if broken:
        raise CheckpointError(f"{shown}: the weights {broken[:4]} hold NaN or infinite values; not a usable run")
