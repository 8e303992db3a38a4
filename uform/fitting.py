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
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from .config import TrainerStepStats
from .console import Console, clock
from .held_out import HeldOut
from .interrupts import Interrupts
from .notices import Notices
from .replica.stored_run import read_data_state
from .rotation import Rotation
from .run_config import EvalConfig, RunConfig, read_run_config
from .run_dir import RunDir, read_metrics
from .run_place import RunPlace
from .runtime.executor import Executor
from .runtime.loading import LoaderProcess, by_path
from .runtime.mesh import Mesh
from .sources import Loader, StepInput, open_source
from .tensorboard import TensorBoard
from .tensorboard import available as tensorboard_available
from .trainer import Trainer

__all__ = ["FitStep", "FitSummary", "fit", "steps_in_flight"]

IN_FLIGHT = 2
"""Steps submitted and not yet finished, at least: the next step's records are read, decoded and packed while the
device runs the one before (`Trainer.deferred`); a save, an evaluation and a stop wait for all of them. A trainer
of several preparer processes keeps one more in flight than it has of them (`steps_in_flight`), so that every one
has a step."""


def steps_in_flight(trainer: Trainer) -> int:
    """How many steps `fit` keeps submitted and unfinished on `trainer`: `IN_FLIGHT`, or one more than its
    preparer processes (each prepares a step while the device runs another)."""
    return max(IN_FLIGHT, trainer.host_processes + 1)


STOP_CHECK_EVERY = 10
"""On a mesh, steps between two checks of whether any process caught a signal (each check drains the steps in
flight and exchanges a flag, so every process stops at the same step)."""


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
    """The last checkpoint this call wrote, the run's latest (None where it took no step)."""
    output: str
    """The run's folder."""
    interrupted: int | None = None
    """The signal that stopped this call at a step boundary (`signal.SIGTERM`, ...), or None; its checkpoint is
    `checkpoint`, and `resume="latest"` continues from it exactly."""
    seconds: float = 0.0
    """This call's wall time, building the trainer excluded."""
    checkpoints: tuple[str, ...] = ()
    """The checkpoints the run's folder holds after this call, oldest first (what `[checkpoint]` kept)."""
    best: tuple[str, int, float] | None = None
    """`[checkpoint] best`'s name, the step that scored best by it and the score, over the whole run."""
    best_checkpoint: str | None = None
    """The checkpoint of the best-scoring step that has one, or None."""
    warned: dict[str, int] = dataclasses.field(default_factory=dict)
    """The warnings by kind (`warned/media`, `warned/capacity`, ...) over the whole run (a resumed run's counts add
    to those its folder's metrics hold), each kind shown once per call, every occurrence counted."""
    eval: dict[str, float] | None = None
    """The last evaluation's figures by name (`uform.held_out`), None where the run holds no records out."""

    def report(self) -> str:
        """The run's closing block, for a person: where it stopped, what it saw, what it kept."""
        if self.interrupted is not None:
            state = f"interrupted by {signal.Signals(self.interrupted).name} at step {self.step} of {self.steps}"
        else:
            state = "done" if self.step >= self.steps else f"stopped at step {self.step} of {self.steps}"
        rate = f", {self.items / self.seconds:.1f} items/s" if self.seconds > 0 and self.items else ""
        rows = [("steps", f"{self.taken} this call ({self.step - self.taken + 1}-{self.step})" if self.taken else "0")]
        rows.append(("items", f"{self.items}{rate}"))
        rows.append(("wall time", clock(self.seconds)))
        if self.stats is not None:
            rows.append(("last loss", f"{self.stats.loss:.4f} at learning rate {self.stats.learning_rate:.2e}"))
        if self.eval:
            rows.append(("last eval", _headline(self.eval)))
        if self.best is not None:
            name, step, value = self.best
            rows.append(("best", f"{name} = {value:.4f} at step {step}"))
        if self.warned:
            rows.append(
                ("warnings", ", ".join(f"{k.removeprefix('warned/')} {v}" for k, v in sorted(self.warned.items())))
            )
        folder = os.path.join(self.output, "checkpoints")
        names = []
        for path in self.checkpoints:
            tags = [t for t, p in (("latest", self.checkpoint), ("best", self.best_checkpoint)) if p == path]
            names.append(os.path.basename(path) + (f" ({', '.join(tags)})" if tags else ""))
        rows.append(("checkpoints", f"{folder}: {', '.join(names)}" if names else "none"))
        if self.step < self.steps and self.checkpoint is not None:
            rows.append(
                ("resume", f"--resume latest (uform.fit(..., resume='latest')) continues from step {self.step}")
            )
        width = max(len(k) for k, _ in rows)
        return "\n".join([f"uform: run {state}; {self.output}", *(f"  {k:<{width}}  {v}" for k, v in rows)])


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
    log_every: int | None = None,
    evaluate: Callable[[int, Trainer], Mapping[str, Any] | None] | None = None,
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
    (`uform.held_out`). `progress(FitStep)` is called after every step. `log` gets a progress bar where it
    is a terminal, else one line every `log_every` steps (default `[log] every`), and the run's closing block
    (`FitSummary.report`); None is silent. `evaluate(step, trainer)`, called after each step, answers results by
    name (`{"eval/text->image/recall@10": 0.41}`) or None: they go to `metrics.jsonl` (and TensorBoard), and
    `[checkpoint] best` reads them. `[checkpoint]` says when to save and what to keep (`uform.rotation`).

    SIGINT or SIGTERM while it trains lets the step in flight finish, saves at that step and returns, the summary's
    `interrupted` naming the signal; a second signal stops at once (`uform.interrupts`). Everything is checked
    before anything is written or trained.
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
    if log_every is None:
        log_every = run.log.every
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every: expected a positive int, got {log_every!r}")
    if loader_process is not None and not isinstance(loader_process, bool):
        raise TypeError(f"loader_process: expected None or a bool, got {type(loader_process).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected None or a callable, got {type(progress).__name__}")
    if evaluate is not None and not callable(evaluate):
        raise TypeError(f"evaluate: expected None or a callable, got {type(evaluate).__name__}")
    if run.log.tensorboard and not tensorboard_available():
        raise ValueError(
            "log.tensorboard: true, but the tensorboard package is missing (pip install 'uform[tensorboard]')"
        )
    if devices is not None and not isinstance(devices, Executor):
        raise TypeError(f"devices: expected an Executor, got {type(devices).__name__}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected None or a Mesh, got {type(mesh).__name__}")
    if mesh is not None and devices is not None and devices is not mesh.executor:
        raise ValueError("devices: a run over a mesh trains on the mesh's executor; leave devices out")
    if resume is not None and not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume: expected None, a checkpoint's path or 'latest', got {type(resume).__name__}")
    spec, named, held_spec = _data(run, data, fields, held_out)
    if run.checkpoint.best is not None and evaluate is None and held_spec is None:
        raise ValueError(
            f"checkpoint.best: names {run.checkpoint.best!r}, but this run evaluates nothing ([data] held_out, evaluate=)"
        )
    source = open_source(spec, fields=named)
    held = None if held_spec is None else HeldOut.read(held_spec, named, run.trainer, run.eval)

    place = RunPlace(mesh)
    log = log if place.lead else None
    notices = Notices()  # the call's own: checkpoints passed over on the way to the latest
    if resume is None:
        place.agree(lambda: _check_new(output))  # a clash is refused now; the folder is made once the trainer stands
        checkpoint, state = None, None
    else:
        checkpoint, state = place.agree(lambda: _resumed(output, resume, notices))

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
                run,
                folder,
                place,
                trainer,
                loader,
                checkpoint is not None,
                stop_after,
                progress,
                log,
                log_every,
                notices,
                evaluate,
                held,
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


def _resumed(output: str | os.PathLike, resume: str | os.PathLike, notices: Notices) -> tuple[str, dict[str, Any]]:
    """The checkpoint `resume` names in the run's folder `output`, and the data position it stores."""
    folder = RunDir.open(output)
    checkpoint = folder.latest(notices) if os.fspath(resume) == "latest" else os.fspath(resume)
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
    notices: Notices,
    evaluate: Callable[[int, Trainer], Mapping[str, Any] | None] | None = None,
    held: HeldOut | None = None,
) -> FitSummary:
    """The steps of one call: each taken, logged (metrics.jsonl, TensorBoard, the console), saved on the
    `[checkpoint]` policy; a signal stops it at the next step boundary with a save there."""
    begun = time.perf_counter()
    steps = run.trainer.schedule.steps
    first = loader.step
    last = min(steps, first - 1 + stop_after) if stop_after is not None else steps
    resumed_at = first - 1 if resumed else None
    taken = items = 0
    stats: TrainerStepStats | None = None
    checkpoint: str | None = None
    saved_at = -1
    held_results: dict[str, float] | None = None
    every = run.eval.every

    def due(step: int) -> bool:
        """Whether the held-out records are scored after `step` (`[eval] every`, and each call's last step)."""
        return held is not None and ((every > 0 and step % every == 0) or step == last)

    lead = place.lead  # the lead alone writes the folder: metrics, TensorBoard, deletions, the console
    board = _board(run, folder, resumed_at) if lead else None
    deferred = trainer.deferred(trainer.executor)
    depth = steps_in_flight(trainer)
    in_flight: deque[tuple[StepInput, TrainerStepStats, Future]] = deque()
    writer = folder.metrics(resumed_at=resumed_at) if lead else None
    try:
        with (
            writer if writer is not None else contextlib.nullcontext() as metrics,
            Console(log, steps=steps, first=first, last=last, every=log_every) as console,
            Interrupts() as interrupts,
        ):
            earlier = read_metrics(folder.metrics_path) if resumed and lead else []
            rotation = Rotation(folder, run.checkpoint, [r for r in earlier if r["kind"] == "eval"])
            # Counts run over the whole run: a resume adds to what its last step's record holds.
            stepped = [r for r in earlier if r["kind"] == "step"]
            base = {k: int(v) for k, v in (stepped[-1] if stepped else {}).items() if k.startswith("warned/")}

            def warned() -> dict[str, int]:
                counts: dict[str, int] = dict(base)
                own = loader.notices.counts() if isinstance(loader, Loader) else {}  # a loader process warns there
                for source in (trainer.notices.counts(), own, notices.counts()):
                    for kind, count in source.items():
                        key = "warned/" + kind.replace(" ", "_").replace("-", "_")
                        counts[key] = counts.get(key, 0) + count
                return counts

            def on_eval(step: int, results: Mapping[str, Any]) -> bool:
                """The evaluation's way in (issue 14 item 1), between steps with none in flight: its record
                logged, its `best` score noted; answers (the lead's verdict, on every process) whether the step
                scored a new best, which the loop then saves."""
                if metrics is not None:
                    metrics.eval(step, results)
                if board is not None:
                    board.scalars(step, results)
                return place.agree(lambda: rotation.evaluated(step, results))

            def save(step: int) -> str:
                path = folder.save(trainer, step, data_state=place.data_state(loader.state()))
                removed = rotation.saved(step) if lead else []
                gone = f"; removed {', '.join(os.path.basename(p) for p in removed)}" if removed else ""
                console.note(f"saved {path}{gone}")
                return path

            def boundary(step: int) -> bool:
                """Whether the loop must stand still after `step` (nothing read past it): its save, its
                evaluation, a mesh's signal check, or the call's end."""
                check = place.mesh is not None and step % STOP_CHECK_EVERY == 0
                return step >= last or rotation.due(step) or evaluate is not None or due(step) or check

            stopped_by: int | None = None  # the signal the loop stops for (on a mesh: any process's)
            announced = False
            finished = time.perf_counter()
            while True:
                if loader.step <= last and stopped_by is None and not (in_flight and boundary(in_flight[-1][0].step)):
                    step_input = loader.next_step()  # read and submitted while the device runs the one before
                    step_stats = TrainerStepStats()
                    step_input.config.stats = step_stats
                    in_flight.append((step_input, step_stats, deferred.step(*step_input)))
                    if len(in_flight) < depth and loader.step <= last and not boundary(step_input.step):
                        continue
                if not in_flight:
                    break
                step_input, stats, future = in_flight.popleft()
                future.result()
                now = time.perf_counter()
                seconds, finished = now - finished, now  # between two completions: the step's share of the wall
                count, step = stats.items, step_input.step  # the world's items
                counts = warned()
                if metrics is not None:
                    metrics.step(stats, items=count, seconds=seconds, counts=counts)
                if board is not None:
                    record = {k: v for k, v in dataclasses.asdict(stats).items() if k != "step"}  # the x axis already
                    record["items_per_second"] = count / seconds if seconds > 0 else math.nan
                    board.scalars(step, record, prefix="train/")
                    board.scalars(step, counts)
                taken, items = taken + 1, items + count
                console.step(step, stats, items=count, seconds=seconds)
                if progress is not None:
                    progress(FitStep(step, steps, stats, list(step_input.records), count, seconds))
                if not in_flight:  # a boundary: the trainer's weights are this step's
                    results = None if evaluate is None else dict(evaluate(step, trainer) or {}) or None
                    if held is not None and due(step):  # every process evaluates; the lead writes
                        held_results = held.evaluate(trainer)
                        results = {**held_results, **(results or {})}
                        console.note(f"eval {step}/{steps}  {_headline(held_results)}")
                    best = results is not None and on_eval(step, results)
                    if rotation.due(step) or best:
                        checkpoint, saved_at = save(step), step
                if place.mesh is None:
                    stopped_by = interrupts.signal
                elif not in_flight and boundary(step) and stopped_by is None:  # every process stops at one step
                    stopped_by = place.first_set(interrupts.signal)
                if stopped_by is not None and not announced:
                    announced = True
                    why = signal.Signals(stopped_by).name
                    upto = in_flight[-1][0].step if in_flight else step  # the steps in flight finish
                    console.note(f"uform: {why}: stopping after step {upto}, saving there (again: stop now)")
            if taken and saved_at != loader.step - 1:
                checkpoint = save(loader.step - 1)
            kept = tuple(path for _, path in folder.saved()) if lead else ()
            best_step = rotation.best()
            summary = FitSummary(
                step=loader.step - 1,
                steps=steps,
                taken=taken,
                items=items,
                stats=stats,
                checkpoint=checkpoint,
                output=folder.path,
                interrupted=stopped_by,
                seconds=time.perf_counter() - begun,
                checkpoints=kept,
                best=None if best_step is None or run.checkpoint.best is None else (run.checkpoint.best, *best_step),
                best_checkpoint=rotation.best_checkpoint() if lead else None,
                warned=warned(),
                eval=held_results,
            )
            console.close()  # the bar ends first: the block is printed under it, not through it
            console.note(summary.report())
            return summary
    finally:
        if board is not None:
            board.close()


def _board(run: RunConfig, folder: RunDir, resumed_at: int | None) -> TensorBoard | None:
    wanted = run.log.tensorboard
    if wanted is False or (wanted is None and not tensorboard_available()):
        return None
    return TensorBoard(folder.path, resumed_at=resumed_at)


def _headline(results: Mapping[str, float]) -> str:
    """The figures a console line shows: recall@10 and MRR at the full width, choices' accuracy, the losses."""
    shown = [
        (name.removeprefix("eval/"), value)
        for name, value in results.items()
        if ("@" not in name.split("/")[1] and name.endswith(("/recall@10", "/mrr")))
        or name.startswith(("eval/loss/", "eval/choices/accuracy"))
    ]
    return "  ".join(f"{name} {value:.4f}" for name, value in shown)
