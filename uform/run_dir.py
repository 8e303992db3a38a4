"""Where a run writes: one folder holding its resolved config, its metrics and its checkpoints.

    DIR/config.toml                              the resolved run file (`run_config.dump_run_config`)
    DIR/metrics.jsonl                            one JSON object a line: {"kind": "step", ...} or {"kind": "eval", ...}
    DIR/checkpoints/step-NNNNNNNN.safetensors    `Trainer.save`'s checkpoints, written whole and renamed into place

`latest(DIR)` is the newest checkpoint that is whole (header, stored run and digest checked by the reader a
resume uses), so that `--resume latest` names a file; a torn or foreign file on the way is passed over with a
`CheckpointWarning`, shown once and counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Mapping
from typing import IO, Any

from .config import TrainerStepStats
from .notices import CheckpointWarning, Notices
from .replica.checkpoint import CheckpointError
from .replica.stored_run import read_run_tensors, read_stored_run
from .run_config import RunConfig, dump_run_config, read_run_config
from .trainer import Trainer

__all__ = ["MetricsWriter", "RunDir", "latest", "read_metrics"]

CONFIG_NAME = "config.toml"
METRICS_NAME = "metrics.jsonl"
CHECKPOINTS_NAME = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"step-([0-9]{8,19})\.safetensors")
_TEMP_NAME = re.compile(r"\..+\.tmp-[0-9]{1,10}-[0-9a-f]{12}", re.DOTALL)  # `checkpoint.write_checkpoint`'s
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(TrainerStepStats))


class RunDir:
    """A run's output folder; make one with `RunDir.create` (a new run) or `RunDir.open` (one to resume)."""

    def __init__(self, path: str, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("RunDir: make one with RunDir.create(path, config) or RunDir.open(path)")
        self.path = path
        """The folder."""

    @classmethod
    def create(cls, path: str | os.PathLike, config: RunConfig) -> RunDir:
        """A new run's folder at `path` (made with its parents, or an empty folder that exists), holding
        `config.toml` and an empty `checkpoints/`. A folder that already holds files is refused (`FileExistsError`:
        resume that run, or pick another folder); a refused call creates nothing."""
        if not isinstance(config, RunConfig):
            raise TypeError(f"config: expected a RunConfig, got {type(config).__name__}")
        folder = os.fspath(path)
        if not isinstance(folder, str):
            raise TypeError(f"output: expected a str path, got {type(folder).__name__}")
        text = dump_run_config(config)  # first: a config with no file form refuses before anything is made
        existed = os.path.isdir(folder)
        if existed and os.listdir(folder):
            raise FileExistsError(
                f"output: {folder} already holds files; resume its run (--resume latest) or pick another folder"
            )
        if os.path.exists(folder) and not existed:
            raise FileExistsError(f"output: {folder} exists and is not a folder")
        try:
            os.makedirs(os.path.join(folder, CHECKPOINTS_NAME))
            _write_atomically(os.path.join(folder, CONFIG_NAME), text)
        except BaseException:
            for name in (os.path.join(folder, CONFIG_NAME), os.path.join(folder, CHECKPOINTS_NAME)):
                if os.path.isdir(name):
                    os.rmdir(name)
                elif os.path.exists(name):
                    os.unlink(name)
            if not existed and os.path.isdir(folder):
                os.rmdir(folder)
            raise
        return cls(folder, _PRIVATE)

    @classmethod
    def open(cls, path: str | os.PathLike) -> RunDir:
        """The folder of a run `create` made (it holds `config.toml`); `FileNotFoundError` otherwise."""
        folder = os.fspath(path)
        if not isinstance(folder, str):
            raise TypeError(f"output: expected a str path, got {type(folder).__name__}")
        if not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
            raise FileNotFoundError(f"output: {folder} holds no {CONFIG_NAME}; it is not a run's folder")
        return cls(folder, _PRIVATE)

    @property
    def config_path(self) -> str:
        """`DIR/config.toml`."""
        return os.path.join(self.path, CONFIG_NAME)

    @property
    def metrics_path(self) -> str:
        """`DIR/metrics.jsonl`."""
        return os.path.join(self.path, METRICS_NAME)

    @property
    def checkpoints(self) -> str:
        """`DIR/checkpoints`."""
        return os.path.join(self.path, CHECKPOINTS_NAME)

    def config(self) -> RunConfig:
        """The run file this folder holds, read and checked."""
        return read_run_config(self.config_path)

    def checkpoint_path(self, step: int) -> str:
        """`DIR/checkpoints/step-NNNNNNNN.safetensors` for the run's `step` (its place in the schedule)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        if not 0 <= step < 2**63:
            raise ValueError(f"step: must lie in [0, 2^63), got {step}")
        return os.path.join(self.checkpoints, f"step-{step:08d}.safetensors")

    def save(self, trainer: Trainer, step: int, *, data_state: dict[str, Any] | None = None) -> str:
        """Saves `trainer` as the checkpoint of `step` (`Trainer.save`: written whole, renamed into place), with
        `data_state` (the loader's position) beside it; answers its path."""
        path = self.checkpoint_path(step)
        trainer.save(path, data_state=data_state)
        return path

    def latest(self, notices: Notices | None = None) -> str | None:
        """The newest whole checkpoint of this run (see `latest`)."""
        return latest(self.path, notices)

    def metrics(self, *, resumed_at: int | None = None) -> MetricsWriter:
        """A writer appending to `metrics.jsonl`. `resumed_at` (the step a resumed run continues after) first
        drops the records of later steps, which the interrupted run logged past its last checkpoint."""
        if resumed_at is not None:
            if isinstance(resumed_at, bool) or not isinstance(resumed_at, int) or resumed_at < 0:
                raise ValueError(f"resumed_at: expected a non-negative int, got {resumed_at!r}")
            if os.path.exists(self.metrics_path):
                kept = [r for r in read_metrics(self.metrics_path) if int(r.get("step", 0)) <= resumed_at]
                _write_atomically(self.metrics_path, "".join(_line(r) for r in kept))
        return MetricsWriter(self.metrics_path)


def latest(path: str | os.PathLike, notices: Notices | None = None) -> str | None:
    """The newest whole checkpoint under `path/checkpoints` (by the step its name carries), or None where there
    is none; `path` is a run's folder (or its checkpoints folder itself).

    Each candidate is checked as a resume would check it, without building a network: its header and stored
    run (`stored_run.read_stored_run`), then its data against its digest (`read_run_tensors`). A file that fails
    (torn, corrupt, another program's) or that is not named as a checkpoint is passed over with a
    `CheckpointWarning` shown once (to `notices`, counted as "checkpoint"); the temp files of a save in flight
    are passed over silently.
    """
    folder = os.fspath(path)
    if os.path.isdir(os.path.join(folder, CHECKPOINTS_NAME)):
        folder = os.path.join(folder, CHECKPOINTS_NAME)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"resume: {os.fsdecode(folder)} is not a run's folder (it has no checkpoints)")
    notices = Notices() if notices is None else notices
    candidates: list[tuple[int, str]] = []
    for name in sorted(os.listdir(folder)):
        found = _CHECKPOINT_NAME.fullmatch(name)
        if found is not None:
            candidates.append((int(found.group(1)), name))
        elif not _TEMP_NAME.fullmatch(name):
            _pass_over(notices, folder, name, "not named as a checkpoint (step-NNNNNNNN.safetensors)")
    for _, name in sorted(candidates, reverse=True):
        target = os.path.join(folder, name)
        try:
            read_run_tensors(read_stored_run(target), None, 10, "cpu")
        except (CheckpointError, OSError) as error:
            _pass_over(notices, folder, name, str(error))
            continue
        return target
    return None


def _pass_over(notices: Notices, folder: str, name: str, why: str) -> None:
    notices.warn(
        "checkpoint",
        f"latest: passed over {os.path.join(os.fsdecode(folder), name)} ({why}); further files passed over are "
        "counted, not shown",
        CheckpointWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------------------------------
# metrics.jsonl


class MetricsWriter:
    """Appends a run's records to its `metrics.jsonl`, one JSON object a line, each flushed as written.

    A step record carries every `TrainerStepStats` field by its name, with `kind` "step", `wall_time` (seconds
    since the epoch) and `items_per_second`; an evaluation record `kind` "eval", the step it
    evaluated, its results and `wall_time`. A non-finite float is written as the string "nan", "inf" or "-inf" (JSON has no such
    number), which `read_metrics` reads back as a float.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        """The file appended to."""
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def step(self, stats: TrainerStepStats, *, items: int, seconds: float, wall_time: float | None = None) -> None:
        """Writes the record of one step: its `stats`, and `items` trained over `seconds` as items/s."""
        if not isinstance(stats, TrainerStepStats):
            raise TypeError(f"stats: expected a TrainerStepStats, got {type(stats).__name__}")
        if isinstance(items, bool) or not isinstance(items, int) or items < 0:
            raise ValueError(f"items: expected a non-negative int, got {items!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"seconds: expected a non-negative number, got {seconds!r}")
        record: dict[str, Any] = {"kind": "step"}
        record.update({name: getattr(stats, name) for name in _STEP_FIELDS})
        record["wall_time"] = time.time() if wall_time is None else float(wall_time)
        record["items_per_second"] = items / seconds if seconds > 0 else None
        self._write(record)

    def eval(self, step: int, results: Mapping[str, Any], *, wall_time: float | None = None) -> None:
        """Writes an evaluation's record: the `step` it evaluated and its `results` (numbers or strings by name)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected a non-negative int, got {step!r}")
        if not isinstance(results, Mapping):
            raise TypeError(f"results: expected a mapping of names to values, got {type(results).__name__}")
        record: dict[str, Any] = {"kind": "eval", "step": step}
        for name, value in results.items():
            if not isinstance(name, str) or name in ("kind", "step", "wall_time"):
                raise ValueError(f"results: {name!r} is not a result name (kind, step and wall_time are the record's)")
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise TypeError(f"results[{name!r}]: expected a number or a string, got {type(value).__name__}")
            record[name] = value
        record["wall_time"] = time.time() if wall_time is None else float(wall_time)
        self._write(record)

    def close(self) -> None:
        """Closes the file; later writes are refused."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"metrics: the writer of {self.path} was closed")
        self._file.write(_line(record))
        self._file.flush()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a `metrics.jsonl`, in order; a last line cut short (a run killed while writing it) is
    left out, any other line that is not a JSON object raises `ValueError` naming its line number."""
    shown = os.fsdecode(os.fspath(path))
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out: list[dict[str, Any]] = []
    for number, text in enumerate(lines[:-1], start=1):  # text after the last newline was never finished
        try:
            record = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{shown}:{number}: not a JSON object ({error})") from None
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
            raise ValueError(f"{shown}:{number}: not a metrics record (a JSON object with a 'kind')")
        out.append({k: _number(v) for k, v in record.items()})
    return out


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False) + "\n"


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _number(value: Any) -> Any:
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def _write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path` through a temp file in the same folder renamed into place."""
    folder = os.path.dirname(path) or "."
    fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


_PRIVATE = object()
