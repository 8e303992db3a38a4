"""`uform.fit`: a whole training run from a run file: its data read, its steps taken, its folder written.

    summary = uform.fit("examples/text_pairs.toml", "runs/pairs")          # the schedule's steps, then a save
    summary = uform.fit(config, "runs/pairs", resume="latest", stop_after=100)  # 100 more, save, return

The loop is the library's own verbs and nothing more: `open_source` and a `Loader` (`uform.sources`) fill each
step, `Trainer.step` takes it, a `MetricsWriter` logs it, `Trainer.save` writes the checkpoint with the loader's
state beside the weights (the checkpoint's `uform.data`), so a resume continues with the very record the
interrupted run would have read next. With held-out records (`[data] held_out`) a `uform.held_out.HeldOut`, read
once before the first step, scores the trainer's current weights every `eval.every` steps and after the last step
of the call, each evaluation a record of `metrics.jsonl` (`MetricsWriter.eval`), the last on `FitSummary.eval`.
`uform train` (`uform/cli.py`) is this call behind argv. (The module is not `uform/fit.py`: importing a
submodule binds its name on the package, which would hide the lazily exported function `uform.fit`.)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from .config import TrainerStepStats
from .held_out import HeldOut
from .replica.stored_run import read_data_state
from .run_config import EvalConfig, RunConfig, read_run_config
from .run_dir import RunDir
from .runtime.executor import Executor
from .sources import Loader, open_source
from .trainer import Trainer

__all__ = ["FitStep", "FitSummary", "fit"]

LOG_EVERY = 10
"""Steps between two console lines (the last step of a call always has one)."""


@dataclass(frozen=True)
class FitStep:
    """What `fit`'s `progress` callback is handed after each step."""

    step: int
    """The step's number in the run's schedule (counted from one across resumes)."""
    steps: int
    """The schedule's length."""
    stats: TrainerStepStats
    """What the trainer reported for it."""
    records: list[str]
    """The ids of the records it trained on, one per item, in item order (every rank's, in share order)."""
    items: int
    """Items it trained on."""
    seconds: float
    """Its wall time, reading included."""


@dataclass(frozen=True)
class FitSummary:
    """What one `fit` call did."""

    step: int
    """The run's last step taken (its place in the schedule); 0 where none was ever taken."""
    steps: int
    """The schedule's length; `step == steps` means the run is done."""
    taken: int
    """Steps taken in this call."""
    items: int
    """Items trained on in this call."""
    stats: TrainerStepStats | None
    """The last step's stats (None where this call took none)."""
    checkpoint: str | None
    """The checkpoint this call wrote (None where it took no step)."""
    output: str
    """The run's folder."""
    eval: dict[str, float] | None = None
    """The last evaluation's figures by name (`uform.held_out`), None where the run holds no records out."""


def fit(
    config: RunConfig | str | os.PathLike,
    output: str | os.PathLike,
    *,
    overrides: Sequence[str] = (),
    resume: str | os.PathLike | None = None,
    stop_after: int | None = None,
    devices: Executor | None = None,
    data: Any = None,
    fields: Mapping[str, Any] | None = None,
    held_out: Any = None,
    progress: Callable[[FitStep], Any] | None = None,
    log: TextIO | None = sys.stderr,
    log_every: int = LOG_EVERY,
) -> FitSummary:
    """Trains the run `config` describes (a `RunConfig`, or the path of a run file with `--set`-style
    `overrides`) into the folder `output` (`RunDir`: `config.toml`, `metrics.jsonl`, `checkpoints/`).

    `resume` continues the run of `output` from a checkpoint path or "latest" (its newest whole checkpoint),
    weights, optimizer and data position alike; without it `output` must be new or empty. `stop_after` takes at
    most that many steps in this call, then saves and returns (a run split across a scheduler's jobs); the run
    ends at `config.trainer.schedule.steps`. `devices` is the executor (default: CUDA device 0 where there is
    one, else the CPU); its devices read one share of each global step each (`uform.sources.Loader`).
    `data` replaces `[data] train` (any re-iterable of records, a `datasets` dataset included, or paths) and
    `fields` `[data] fields`; `held_out` replaces `[data] held_out` (as `data`), scored as `[eval]` says
    (`uform.held_out`). `progress(FitStep)` is called after every step; `log` gets one line every
    `log_every` steps (None: silent). Everything is checked before anything is written or trained.
    """
    run = config if isinstance(config, RunConfig) else None
    if run is None:
        if not isinstance(config, (str, os.PathLike)):
            raise TypeError(f"config: expected a RunConfig or a run file's path, got {type(config).__name__}")
        run = read_run_config(config, overrides)
    elif overrides:
        raise ValueError("overrides: apply them to a run file's path (a RunConfig is already resolved)")
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1):
        raise ValueError(f"stop_after: expected None or a positive int, got {stop_after!r}")
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every: expected a positive int, got {log_every!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected None or a callable, got {type(progress).__name__}")
    if devices is not None and not isinstance(devices, Executor):
        raise TypeError(f"devices: expected an Executor, got {type(devices).__name__}")
    if resume is not None and not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume: expected None, a checkpoint's path or 'latest', got {type(resume).__name__}")
    spec, named, held_spec = _data(run, data, fields, held_out)
    source = open_source(spec, fields=named)
    held = None if held_spec is None else HeldOut.read(held_spec, named, run.trainer, run.eval)

    folder: RunDir | None = None
    if resume is None:
        _check_new(output)  # a clash is refused now; the folder is made once the trainer stands
        checkpoint, state = None, None
    else:
        folder = RunDir.open(output)
        checkpoint = folder.latest() if os.fspath(resume) == "latest" else os.fspath(resume)
        if checkpoint is None:
            raise FileNotFoundError(f"resume: {folder.path} holds no whole checkpoint to resume from")
        state = read_data_state(checkpoint)
        if state is None:
            raise ValueError(f"resume: {checkpoint} stores no data position (it was not saved by fit)")

    owned = devices is None
    executor = _default_executor() if devices is None else devices
    trainer_config = run.trainer if checkpoint is None else dataclasses.replace(run.trainer, resume=checkpoint)
    try:
        loader = Loader(source, run.trainer, devices=len(executor.devices), state=state)
        trainer = Trainer.init_vram(executor, trainer_config, init_from=None if checkpoint else run.init_from)
        try:
            folder = RunDir.create(output, run) if folder is None else folder
            return _loop(
                run, folder, trainer, loader, checkpoint is not None, stop_after, progress, log, log_every, held
            )
        finally:
            if held is not None:
                held.close()
            trainer.close()
    finally:
        if owned:
            executor.close()


def _data(
    run: RunConfig, data: Any, fields: Mapping[str, Any] | None, held_out: Any
) -> tuple[Any, Mapping[str, Any], Any]:
    spec = data if data is not None else (None if run.data is None else list(run.data.train))
    named = fields if fields is not None else (None if run.data is None else dict(run.data.fields))
    held = held_out if held_out is not None else (list(run.data.held_out) if run.data and run.data.held_out else None)
    if spec is None:
        raise ValueError("data.train: the run file names no training data, and fit was given none (data=)")
    if held is None and run.eval != EvalConfig():  # refused, not ignored: a run would seem evaluated and is not
        raise ValueError("eval: the run sets [eval], but holds no records out to evaluate on ([data] held_out)")
    if not named:
        raise ValueError('data.fields: map each record field to its role (fields = { txt = "text" })')
    return spec, named, held


def _check_new(output: str | os.PathLike) -> None:
    """`RunDir.create`'s refusals, before anything is built: a refused run writes nothing."""
    folder = os.fspath(output)
    if os.path.isdir(folder) and os.listdir(folder):
        raise FileExistsError(
            f"output: {os.fsdecode(folder)} already holds files; resume its run (--resume latest) or pick another"
        )
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise FileExistsError(f"output: {os.fsdecode(folder)} exists and is not a folder")


def _default_executor() -> Executor:
    return Executor.for_vram([0]) if torch.cuda.is_available() else Executor.cpu()


def _loop(
    run: RunConfig,
    folder: RunDir,
    trainer: Trainer,
    loader: Loader,
    resumed: bool,
    stop_after: int | None,
    progress: Callable[[FitStep], Any] | None,
    log: TextIO | None,
    log_every: int,
    held: HeldOut | None = None,
) -> FitSummary:
    steps = run.trainer.schedule.steps
    last = min(steps, loader.step - 1 + stop_after) if stop_after is not None else steps
    taken = items = 0
    stats: TrainerStepStats | None = None
    checkpoint = None
    results: dict[str, float] | None = None
    every = run.eval.every
    with folder.metrics(resumed_at=loader.step - 1 if resumed else None) as metrics:
        while loader.step <= last:
            started = time.perf_counter()
            step_input = loader.next_step()
            stats = TrainerStepStats()
            step_input.config.stats = stats
            trainer.step(*step_input)
            seconds = time.perf_counter() - started
            count = len(step_input.contents)
            metrics.step(stats, items=count, seconds=seconds)
            taken, items = taken + 1, items + count
            if progress is not None:
                progress(FitStep(step_input.step, steps, stats, list(step_input.records), count, seconds))
            if log is not None and (step_input.step % log_every == 0 or loader.step > last):
                rate = f"{count / seconds:.1f}" if seconds > 0 else "-"
                log.write(f"step {step_input.step}/{steps}  loss {stats.loss:.4f}  items/s {rate}\n")
                log.flush()
            if held is not None and ((every and step_input.step % every == 0) or loader.step > last):
                results = held.evaluate(trainer)
                metrics.eval(step_input.step, results)
                if log is not None:
                    log.write(f"eval {step_input.step}/{steps}  {_headline(results)}\n")
                    log.flush()
        if taken:
            checkpoint = folder.save(trainer, loader.step - 1, data_state=loader.state())
    if log is not None and checkpoint is not None:
        log.write(f"saved {checkpoint}\n")
    return FitSummary(loader.step - 1, steps, taken, items, stats, checkpoint, folder.path, results)


def _headline(results: Mapping[str, float]) -> str:
    """The figures a console line shows: recall@10 and MRR at the full width, choices' accuracy, the losses."""
    shown = [
        (name.removeprefix("eval/"), value)
        for name, value in results.items()
        if ("@" not in name.split("/")[1] and name.endswith(("/recall@10", "/mrr")))
        or name.startswith(("eval/loss/", "eval/choices/accuracy"))
    ]
    return "  ".join(f"{name} {value:.4f}" for name, value in shown)
