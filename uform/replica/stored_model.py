"""An exported model folder (`uform export`): weights only, checked as a trainer checkpoint is, before anything is
built from it; and `read_served`, what `uform.load` reads from either.

The folder, in the layout the Hugging Face hub expects:

    OUT/model.safetensors   the network's state dict under its own names (no optimizer moments), and metadata
    OUT/config.json         the resolved run (`config.to_dict`), for people and tools that read configs
    OUT/README.md           the model card (`uform.model_card`); not covered by the digest, as a hub edits cards
    OUT/model.onnx          optional (`uform export --onnx`)

`model.safetensors` is written by the checkpoint writer (`checkpoint.write_checkpoint`), so its digest covers every
tensor and every metadata key: `format` ("pt", the hub's label for torch tensors), `uform.format`
(`MODEL_FORMAT`), `uform.config` (the resolved run, `config.to_json`), `uform.step`, and `uform.files` (the
SHA-256 of each companion file the loader trusts: `config.json`, and `model.onnx` where written). So a changed
weight, a changed config (in the file or in `config.json`), a cut file or a swapped ONNX graph is refused.

A reader trusts nothing the header says because the digest matches (anyone can recompute it): the header is
checked first (`read_layout`), the stored config resolved by the library's own rules, the network it would build
checked against the tensors held (`stored_run.check_weights`, on the meta device), then the data is read and its
digest verified, the weights checked finite, and only then the companion files hashed (each a regular file of
bounded size).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config import TrainerInitVramConfig, from_dict, resolve, to_json
from .checkpoint import CheckpointError, ProgressCallback, read_checkpoint, read_layout, write_checkpoint
from .run_schema import CONFIG_KEY, FORMAT_KEY, STEP_KEY, stored_weights
from .stored_run import check_finite, check_weights, read_run_tensors, read_stored_run

__all__ = [
    "CONFIG_FILE",
    "FILES_KEY",
    "MODEL_FILE",
    "MODEL_FORMAT",
    "ONNX_FILE",
    "Served",
    "file_digest",
    "read_model",
    "read_served",
    "write_model",
]

MODEL_FORMAT = "uform.model.1"
"""The `uform.format` of an exported model's `model.safetensors`."""
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
ONNX_FILE = "model.onnx"
FILES_KEY = "uform.files"
"""Metadata: JSON `{file name: hex SHA-256}` of the companion files the digest vouches for."""
HUB_FORMAT_KEY = "format"
"""The hub's own metadata key (`transformers` reads it): "pt" for torch tensors."""
MAX_COMPANION_BYTES = 1 << 34
"""The largest companion file hashed (16 GiB: an ONNX graph holds the weights again)."""

_HEX = re.compile(r"[0-9a-f]{64}")
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")


@dataclass(frozen=True)
class Served:
    """What a load builds from: a resolved run, its step, and its network's state dict (digest verified)."""

    config: TrainerInitVramConfig
    step: int
    weights: dict[str, torch.Tensor]


def file_digest(path: str, shown: str) -> str:
    """The hex SHA-256 of the regular file at `path`, read in blocks; `CheckpointError` naming `shown` for a
    missing file, a non-regular file or one past `MAX_COMPANION_BYTES`."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise CheckpointError(f"{shown}: cannot be read ({error.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{shown}: not a regular file")
    if info.st_size > MAX_COMPANION_BYTES:
        raise CheckpointError(f"{shown}: {info.st_size} bytes, more than the {MAX_COMPANION_BYTES} a model file may")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_model(
    folder: str, config: TrainerInitVramConfig, step: int, weights: Mapping[str, torch.Tensor], companions: list[str]
) -> None:
    """Writes `folder/model.safetensors` holding `weights` (a network's state dict), the resolved `config`, `step`
    and the SHA-256 of each file of `companions` (names in `folder`, already written: `config.json` first)."""
    files = {name: file_digest(os.path.join(folder, name), name) for name in companions}
    metadata = {
        HUB_FORMAT_KEY: "pt",
        FORMAT_KEY: MODEL_FORMAT,
        CONFIG_KEY: to_json(config),
        STEP_KEY: str(step),
        FILES_KEY: json.dumps(files, sort_keys=True),
    }
    write_checkpoint(os.path.join(folder, MODEL_FILE), dict(weights), metadata)


def read_model(
    path: str | os.PathLike, progress: ProgressCallback | None = None, progress_steps: int = 10
) -> tuple[Served, dict[str, str]]:
    """The exported model at `path` (its folder, or its `model.safetensors`), every check of the module docstring
    passed; answers it and the companion files' digests by name. `CheckpointError` naming the file otherwise."""
    folder, target = _paths(os.fspath(path))
    shown = os.fsdecode(target)
    metadata, layout = read_layout(target)
    if metadata.get(FORMAT_KEY) != MODEL_FORMAT:
        raise CheckpointError(
            f"{shown}: not an exported uform model (its {FORMAT_KEY} is {metadata.get(FORMAT_KEY)!r}, "
            f"expected {MODEL_FORMAT!r})"
        )
    try:
        config = resolve(from_dict(json.loads(metadata[CONFIG_KEY])))
    except (KeyError, ValueError, TypeError, RecursionError) as error:
        raise CheckpointError(f"{shown}: its stored config is not a valid run ({error})") from None
    text = metadata.get(STEP_KEY, "0")
    if not _DECIMAL.fullmatch(text):
        raise CheckpointError(f"{shown}: {STEP_KEY} must be a non-negative decimal integer, got {text[:60]!r}")
    files = _files(metadata, shown)
    check_weights(config, layout, shown)
    tensors, read = read_checkpoint(target, progress, progress_steps, "cpu")
    if read != metadata:  # the digest covers every name, dtype and shape: equal metadata, equal layout
        raise CheckpointError(f"{shown}: the file changed between its header's checks and its reading")
    check_finite(tensors, shown)
    for name, digest in sorted(files.items()):
        if name == ONNX_FILE:
            continue  # the graph is hashed by the reader that runs it (`uform.onnx_encoder`), not by every load
        companion = os.path.join(folder, name)
        if not hmac.compare_digest(file_digest(companion, companion), digest):
            raise CheckpointError(
                f"{companion}: changed since the export (its SHA-256 is not the one {MODEL_FILE} vouches for); "
                "export the checkpoint again"
            )
    return Served(config, int(text), tensors), files


def read_served(path: str | bytes | os.PathLike, progress: ProgressCallback | None, progress_steps: int) -> Served:
    """What `uform.load` builds from: a trainer checkpoint (`stored_run`, its moments read for the digest and
    dropped), or an exported model (a folder, or its `model.safetensors`: `read_model`)."""
    target = os.fspath(path)
    if not os.path.isdir(target):
        metadata, _ = read_layout(target)
        if metadata.get(FORMAT_KEY) != MODEL_FORMAT:  # a trainer checkpoint (`FORMAT`), or refused as not one
            stored = read_stored_run(target)
            tensors = read_run_tensors(stored, progress, progress_steps, "cpu")
            return Served(stored.config, stored.step, stored_weights(tensors))
    if isinstance(target, bytes):
        target = os.fsdecode(target)
    return read_model(target, progress, progress_steps)[0]


def _paths(target: str | bytes) -> tuple[str, str]:
    """(the folder, its model.safetensors) of a folder or a model file's path."""
    target = os.fsdecode(target)
    if os.path.isdir(target):
        model = os.path.join(target, MODEL_FILE)
        if not os.path.exists(model):
            raise CheckpointError(f"{target}: a model folder holds {MODEL_FILE}; this one does not")
        return target, model
    return os.path.dirname(target) or ".", target


def _files(metadata: Mapping[str, str], shown: str) -> dict[str, str]:
    try:
        files = json.loads(metadata[FILES_KEY])
    except (KeyError, ValueError, RecursionError):
        raise CheckpointError(f"{shown}: {FILES_KEY} must be a JSON object of file names to SHA-256") from None
    if not isinstance(files, dict) or CONFIG_FILE not in files:
        raise CheckpointError(f"{shown}: {FILES_KEY} must name {CONFIG_FILE} and its SHA-256")
    for name, digest in files.items():
        if name not in (CONFIG_FILE, ONNX_FILE) or not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise CheckpointError(f"{shown}: {FILES_KEY} entry {name!r} is not a known file and its hex SHA-256")
    return files
