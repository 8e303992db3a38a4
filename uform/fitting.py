"""`uform.fit`: a whole training run from a run file: its data read, its steps taken, its folder written.

    summary = uform.fit("examples/text_pairs.toml", "runs/pairs")          # the schedule's steps, then a save
    summary = uform.fit(config, "runs/pairs", resume="latest", stop_after=100)  # 100 more, save, return

The loop is the library's own verbs and nothing more: `open_source` and a `Loader` (`uform.sources`) fill each
step, `Trainer.step` takes it, a `MetricsWriter` logs it, `Trainer.save` writes the checkpoint with the loader's
state beside the weights (the checkpoint's `uform.data`), so a resume continues with the very record the
interrupted run would have read next. With held-out records (`[data] held_out`) a `uform.held_out.HeldOut`, read
once before the first step, scores the trainer's current weights every `eval.every` steps and after the last step
of the call, each evaluation a record of `metrics.jsonl` (`MetricsWriter.eval`), the last on `FitSummary.eval`
(no step is read ahead past one to be evaluated, so the evaluation sees that step's weights; over a mesh every
process evaluates alike and the lead writes).
`uform train` (`uform/cli.py`) is this call behind argv. (The module is not `uform/fit.py`: importing a
submodule binds its name on the package, which would hide the lazily exported function `uform.fit`.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from .config import TrainerStepStats
from .held_out import HeldOut
from .replica.stored_run import read_data_state
from .run_config import EvalConfig, RunConfig, read_run_config
from .run_dir import RunDir
from .run_place import RunPlace
from .runtime.executor import Executor
from .runtime.loading import LoaderProcess, by_path
from .runtime.mesh import Mesh
from .sources import Loader, StepInput, open_source
from .trainer import Trainer

__all__ = ["FitStep", "FitSummary", "fit", "steps_in_flight"]

LOG_EVERY = 10
"""Steps between two console lines (the last step of a call always has one)."""
IN_FLIGHT = 2
"""Steps submitted and not yet finished, at least: the next step's records are read, decoded and packed while the
device runs the one before (`Trainer.deferred`); a save waits for all of them. A trainer of several preparer
processes keeps one more in flight than it has of them (`steps_in_flight`), so that every one has a step."""


def steps_in_flight(trainer: Trainer) -> int:
    """How many steps `fit` keeps submitted and unfinished on `trainer`: `IN_FLIGHT`, or one more than its
    preparer processes (each prepares a step while the device runs another)."""
    return max(IN_FLIGHT, trainer.host_processes + 1)


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
    """The ids of the records this process's devices trained on, one per item, in item order (share order)."""
    items: int
    """Items it trained on, the whole world's."""
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
    mesh: Mesh | None = None,
    loader_process: bool | None = None,
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
    one, else the CPU); its devices read one share of each global step each (`uform.sources.Loader`). `mesh`
    makes this process one of a run's (`Mesh.from_env()` under torchrun, or `Mesh.bootstrap`): every process
    calls `fit` alike, reads only its own devices' shares, and the lead (rank 0's process) alone writes the
    folder, the metrics and the console lines (`uform.run_place.RunPlace`); `devices` is then the mesh's.
    `loader_process` reads the data in a process of its own (`uform.runtime.loading.LoaderProcess`: the same
    steps, none of this process's interpreter time); None chooses it where the devices are GPUs and the data
    is named by path.
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
    if loader_process is not None and not isinstance(loader_process, bool):
        raise TypeError(f"loader_process: expected None or a bool, got {type(loader_process).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected None or a callable, got {type(progress).__name__}")
    if devices is not None and not isinstance(devices, Executor):
        raise TypeError(f"devices: expected an Executor, got {type(devices).__name__}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected None or a Mesh, got {type(mesh).__name__}")
    if mesh is not None and devices is not None and devices is not mesh.executor:
        raise ValueError("devices: a run over a mesh trains on the mesh's executor; leave devices out")
    if resume is not None and not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume: expected None, a checkpoint's path or 'latest', got {type(resume).__name__}")
    spec, named, held_spec = _data(run, data, fields, held_out)
    source = open_source(spec, fields=named)
    held = None if held_spec is None else HeldOut.read(held_spec, named, run.trainer, run.eval)

    place = RunPlace(mesh)
    log = log if place.lead else None
    if resume is None:
        place.agree(lambda: _check_new(output))  # a clash is refused now; the folder is made once the trainer stands
        checkpoint, state = None, None
    else:
        checkpoint, state = place.agree(lambda: _resumed(output, resume))

    owned = devices is None and mesh is None
    executor = mesh.executor if mesh is not None else _default_executor() if devices is None else devices
    trainer_config = run.trainer if mesh is None else dataclasses.replace(run.trainer, mesh=mesh)
    trainer_config = trainer_config if checkpoint is None else dataclasses.replace(trainer_config, resume=checkpoint)
    shares = place.loader_shares(len(executor.devices))
    if loader_process is None:
        loader_process = by_path(spec) and any(torch.device(d).type == "cuda" for d in executor.devices)
    elif loader_process and not by_path(spec):
        raise ValueError("loader_process: a loader process reads data named by path, glob or URL, not this source")
    loader: Loader | LoaderProcess | None = None
    try:
        if loader_process:
            loader = LoaderProcess(spec, named, run.trainer, state=state, **shares)
        else:
            loader = Loader(source, run.trainer, state=state, **shares)
        trainer = Trainer.init_vram(executor, trainer_config, init_from=None if checkpoint else run.init_from)
        try:
            if checkpoint is None:
                place.agree(lambda: RunDir.create(output, run).path)
            folder = RunDir.open(output)
            return _loop(
                run, folder, place, trainer, loader, checkpoint is not None, stop_after, progress, log, log_every, held
            )
        finally:
            if held is not None:
                held.close()
            trainer.close()
    finally:
        if isinstance(loader, LoaderProcess):
            loader.close()
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


def _resumed(output: str | os.PathLike, resume: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """The checkpoint `resume` names in the run's folder `output`, and the data position it stores."""
    folder = RunDir.open(output)
    checkpoint = folder.latest() if os.fspath(resume) == "latest" else os.fspath(resume)
    if checkpoint is None:
        raise FileNotFoundError(f"resume: {folder.path} holds no whole checkpoint to resume from")
    state = read_data_state(checkpoint)
    if state is None:
        raise ValueError(f"resume: {checkpoint} stores no data position (it was not saved by fit)")
    return checkpoint, state


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
    place: RunPlace,
    trainer: Trainer,
    loader: Loader | LoaderProcess,
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

    def due(step: int) -> bool:  # an evaluation after this step
        return held is not None and ((every > 0 and step % every == 0) or step == last)

    deferred = trainer.deferred(trainer.executor)
    depth = steps_in_flight(trainer)
    in_flight: deque[tuple[StepInput, TrainerStepStats, Future]] = deque()
    writer = folder.metrics(resumed_at=loader.step - 1 if resumed else None) if place.lead else None
    with writer if writer is not None else contextlib.nullcontext() as metrics:
        finished = time.perf_counter()
        while loader.step <= last or in_flight:
            # Read and submit the next step while the device runs the ones before, but none past a step to be
            # evaluated: the evaluation is queued behind it and must see its weights, not a later step's.
            if loader.step <= last and not any(due(queued.step) for queued, _, _ in in_flight):
                step_input = loader.next_step()
                step_stats = TrainerStepStats()
                step_input.config.stats = step_stats
                in_flight.append((step_input, step_stats, deferred.step(*step_input)))
                if len(in_flight) < depth and loader.step <= last and not due(step_input.step):
                    continue
            step_input, stats, future = in_flight.popleft()
            future.result()
            now = time.perf_counter()
            seconds, finished = now - finished, now  # between two completions: the step's share of the wall
            count = stats.items  # the world's
            if metrics is not None:
                metrics.step(stats, items=count, seconds=seconds)
            taken, items = taken + 1, items + count
            if progress is not None:
                progress(FitStep(step_input.step, steps, stats, list(step_input.records), count, seconds))
            if log is not None and (step_input.step % log_every == 0 or step_input.step == last):
                rate = f"{count / seconds:.1f}" if seconds > 0 else "-"
                log.write(f"step {step_input.step}/{steps}  loss {stats.loss:.4f}  items/s {rate}\n")
                log.flush()
            if held is not None and due(step_input.step):  # every process evaluates; the lead writes
                results = held.evaluate(trainer)
                if metrics is not None:
                    metrics.eval(step_input.step, results)
                if log is not None:
                    log.write(f"eval {step_input.step}/{steps}  {_headline(results)}\n")
                    log.flush()
        if taken:
            checkpoint = folder.save(trainer, loader.step - 1, data_state=place.data_state(loader.state()))
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
