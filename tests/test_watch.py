"""Watching a run (issue 14, items 2-5): metrics a person can read (the console, metrics.jsonl, TensorBoard,
`uform plot`), warnings counted and shown once, checkpoints that rotate, signals that save, the closing block."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

import uform
from uform.cli import main
from uform.config import TrainerStepStats
from uform.fitting import FitStep
from uform.interrupts import Interrupts, exit_status
from uform.notices import CheckpointWarning, MediaWarning
from uform.replica.checkpoint import read_checkpoint
from uform.replica.stored_run import read_data_state
from uform.run_config import CheckpointConfig
from uform.run_dir import RunDir, latest, read_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PAIRS = str(EXAMPLES / "text_pairs.toml")
TINY = [
    "trainer.depth=1",
    "trainer.batch.max_rows_per_device=4",
    "trainer.batch.max_segments_per_device=8",
    "trainer.batch.max_columns_per_row=64",
    "log.tensorboard=false",
    "data.held_out=[]",  # the example's held-out pairs left out: these tests bring their own evaluate=
    "eval.every=0",
]


def tensors(path: str | Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(path, None, 10, "cpu")[0]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# --------------------------------------------------------------------------------------------------
# The console, metrics.jsonl, warnings


def test_off_a_terminal_the_console_is_a_few_plain_lines_per_hundred_steps(tmp_path: Path) -> None:
    out = io.StringIO()
    summary = uform.fit(PAIRS, tmp_path / "run", overrides=[*TINY, "trainer.schedule.steps=100"], log=out)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["25/100", "50/100", "75/100", "100/100"]  # [log] every = 25
    assert all(" loss " in line and " lr " in line and " items/s " in line and " eta " in line for line in progress)
    assert len(lines) <= 15  # the lines, one save, the closing block
    block = summary.report()
    assert text.endswith(block + "\n") and block.startswith(f"uform: run done; {tmp_path / 'run'}")
    for row in ("steps        100 this call (1-100)", "items", "wall time", "last loss", "step-00000100.safetensors"):
        assert row in block


def test_on_a_terminal_it_is_a_progress_bar_with_the_figures(tmp_path: Path) -> None:
    out = Terminal()
    uform.fit(PAIRS, tmp_path / "run", overrides=[*TINY, "trainer.schedule.steps=12"], log=out)
    text = out.getvalue()
    assert "\r" in text and "12/12" in text and "step/s" in text  # tqdm's count, rate and time left
    assert "loss " in text and "lr " in text and "items/s " in text
    assert "\nuform: run done;" in text  # the block under the bar, not through it


def test_log_every_comes_from_the_run_file_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    out = io.StringIO()
    uform.fit(PAIRS, tmp_path / "run", overrides=[*TINY, "trainer.schedule.steps=6", "log.every=2"], log=out)
    assert [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("step ")] == [
        "2/6",
        "4/6",
        "6/6",
    ]
    with pytest.raises(ValueError, match="log_every: expected a positive int"):
        uform.fit(PAIRS, tmp_path / "bad", overrides=TINY, log_every=0)
    assert not (tmp_path / "bad").exists()


def broken_image_records(folder: Path) -> Path:
    """The image example's records, a few naming a missing file and a few a file that is not an image."""
    shutil.copytree(EXAMPLES / "image_text" / "images", folder / "images")
    (folder / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 20)
    lines = (EXAMPLES / "image_text" / "captions.jsonl").read_text().splitlines()
    for i in range(4):
        lines.append(json.dumps({"id": f"gone-{i}", "image": "images/gone.png", "caption": "nothing there"}))
        lines.append(json.dumps({"id": f"broken-{i}", "image": "images/broken.png", "caption": "a broken picture"}))
    (folder / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "captions.jsonl"


def test_metrics_carry_the_stats_by_name_and_every_warning_counted_and_shown_once(tmp_path: Path) -> None:
    data = broken_image_records(tmp_path)
    overrides = [*TINY, "trainer.schedule.steps=8", f"data.train={json.dumps(str(data))}"]
    config = str(EXAMPLES / "image_text.toml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = uform.fit(config, tmp_path / "run", overrides=overrides, stop_after=4, log=None)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        summary = uform.fit(config, tmp_path / "run", overrides=overrides, resume="latest", log=None)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step"]
    fields = [f.name for f in dataclasses.fields(TrainerStepStats)]
    assert [r["step"] for r in records] == list(range(1, 9))
    for record in records:
        assert set(fields) <= set(record) and record["kind"] == "step"
        assert record["learning_rate"] > 0 and record["items_per_second"] > 0
    last = records[-1]
    assert last["warned/missing"] >= 4  # 32 records over 8 steps of 8 pairs: each epoch reads every record
    assert last["warned/media"] == sum(r["skipped"] for r in records) >= 4
    for name in ("warned/missing", "warned/media"):
        counts = [r.get(name, 0) for r in records]
        assert counts == sorted(counts) and counts[3] < counts[-1]  # counted over the run, the resume adding on
        assert first.warned[name] == counts[3] and summary.warned[name] == counts[-1]
    shown = [w for w in caught if issubclass(w.category, uform.UformWarning)]
    assert sum("missing file" in str(w.message) for w in shown) == 1  # shown once, however many
    assert sum(issubclass(w.category, MediaWarning) and "missing" not in str(w.message) for w in shown) == 1
    assert "warnings     media" in summary.report() and "missing" in summary.report()
    assert sum("missing file" in str(w.message) for w in again) == 1  # a new call shows it once more


# --------------------------------------------------------------------------------------------------
# TensorBoard and `uform plot`


def scores(step: int, trainer: Any) -> dict[str, float] | None:
    """A stand-in evaluation every 2 steps: recall@10 rises to step 4, falls after; mrr falls throughout."""
    if step % 2:
        return None
    recall = {2: 0.3, 4: 0.7, 6: 0.5, 8: 0.4, 10: 0.45}.get(step, 0.1)
    return {"eval/text->text/recall@10": recall, "eval/text->text/mrr": 1.0 / step}


def test_tensorboard_holds_the_step_and_eval_curves(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ["trainer.depth=1", "trainer.schedule.steps=4", "log.tensorboard=true"]
    uform.fit(PAIRS, tmp_path / "run", overrides=overrides, log=None, evaluate=scores)
    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/items_per_second", "eval/text->text/recall@10"} <= tags
    assert [e.step for e in board.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [(e.step, round(e.value, 4)) for e in board.Scalars("eval/text->text/recall@10")] == [(2, 0.3), (4, 0.7)]
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step"]
    assert [e.value for e in board.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)

    uform.fit(PAIRS, tmp_path / "off", overrides=[*TINY, "trainer.schedule.steps=1"], log=None)
    assert not (tmp_path / "off" / "tensorboard").exists()


def test_tensorboard_true_without_the_package_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr("uform.fitting.tensorboard_available", lambda: False)
    with pytest.raises(ValueError, match=r"log\.tensorboard: true, but the tensorboard package is missing"):
        uform.fit(PAIRS, tmp_path / "run", overrides=["log.tensorboard=true"], log=None)
    assert not (tmp_path / "run").exists()


def test_uform_plot_writes_a_png_that_decodes(tmp_path: Path, capsys: Any) -> None:
    run = tmp_path / "run"
    uform.fit(PAIRS, run, overrides=[*TINY, "trainer.schedule.steps=6"], log=None, evaluate=scores)
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "metrics.png")
    with Image.open(run / "metrics.png") as png:
        png.load()
        assert png.format == "PNG" and png.width > 600 and png.height > 400
        colors = png.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 50  # drawn curves, not a blank canvas
    (tmp_path / "plots").mkdir()
    assert main(["plot", str(run), "--output", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "metrics.png").stat().st_size > 0
    assert main(["plot", str(run), "--output", str(tmp_path / "curves.png")]) == 0
    Image.open(tmp_path / "curves.png").verify()
    assert main(["plot", str(tmp_path / "plots")]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Checkpoints that rotate


TRAINER = uform.TrainerInitVramConfig(
    depth=1,
    hidden=128,
    objective=uform.Objective.Masked,
    batch=uform.BatchShape(max_rows_per_device=2, max_segments_per_device=4, max_columns_per_row=32),
    schedule=uform.Schedule(steps=10),
)


def test_rotation_keeps_exactly_the_last_k_and_the_best(tmp_path: Path) -> None:
    from uform.config import resolve
    from uform.rotation import Rotation
    from uform.run_config import RunConfig

    folder = RunDir.create(tmp_path / "run", RunConfig(trainer=resolve(TRAINER)))
    rotation = Rotation(folder, CheckpointConfig(every=1, keep_last=2, best="eval/a->b/recall@1"))
    trainer = uform.Trainer.init_vram(uform.Executor.cpu(), TRAINER)
    kept = []
    try:
        # step: its score (None: not evaluated); the best is step 2 until step 5 beats it
        for step, score in [(1, 0.2), (2, 0.6), (3, None), (4, 0.5), (5, 0.9), (6, None), (7, 0.1)]:
            if score is not None:
                assert rotation.evaluated(step, {"eval/a->b/recall@1": score}) == (step in (1, 2, 5))
            folder.save(trainer, step)
            removed = rotation.saved(step)
            kept.append(names(tmp_path / "run"))
            assert all(not os.path.exists(p) for p in removed)
    finally:
        trainer.close()
    s = "step-{:08d}.safetensors".format
    assert kept == [
        [s(1)],
        [s(1), s(2)],
        [s(2), s(3)],
        [s(2), s(3), s(4)],  # the last two and the best (2)
        [s(4), s(5)],  # 5 is the best and one of the last two
        [s(5), s(6)],
        [s(5), s(6), s(7)],
    ]
    assert rotation.best() == (5, 0.9) and rotation.best_checkpoint() == str(tmp_path / "run" / "checkpoints" / s(5))
    with pytest.raises(ValueError, match=r"checkpoint\.best: 'eval/a->b/recall@1' is not among .*\(eval/b->a/mrr\)"):
        rotation.evaluated(8, {"eval/b->a/mrr": 0.5})
    assert not rotation.evaluated(8, {"eval/a->b/recall@1": float("nan")})
    everything = Rotation(folder, CheckpointConfig(every=3))
    assert [everything.due(k) for k in range(1, 7)] == [False, False, True, False, False, True]
    assert everything.saved(7) == [] and len(names(tmp_path / "run")) == 3  # keep_last 0: every one kept


def test_fit_saves_every_n_keeps_the_best_across_a_resume_and_saves_a_new_best_off_the_grid(tmp_path: Path) -> None:
    run = tmp_path / "run"
    policy = ["checkpoint.every=3", "checkpoint.keep_last=1", "checkpoint.best=eval/text->text/recall@10"]
    overrides = [*TINY, "trainer.schedule.steps=10", *policy]
    first = uform.fit(PAIRS, run, overrides=overrides, stop_after=5, log=None, evaluate=scores)
    # saves: 2 (a first best), 3 (every), 4 (a new best), 5 (the call's end); kept: the last and the best
    assert names(run) == ["step-00000004.safetensors", "step-00000005.safetensors"]
    assert first.best == ("eval/text->text/recall@10", 4, 0.7) and first.best_checkpoint == first.checkpoints[0]
    rest = uform.fit(PAIRS, run, overrides=overrides, resume="latest", log=None, evaluate=scores)
    assert (rest.step, rest.taken) == (10, 5)
    assert names(run) == ["step-00000004.safetensors", "step-00000010.safetensors"]  # step 4's best read back
    assert rest.best == ("eval/text->text/recall@10", 4, 0.7)
    block = rest.report()
    assert "best         eval/text->text/recall@10 = 0.7000 at step 4" in block
    assert "step-00000004.safetensors (best), step-00000010.safetensors (latest)" in block
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6, 8, 10]
    with pytest.raises(ValueError, match=r"checkpoint\.best: names .* but this run evaluates nothing"):
        uform.fit(PAIRS, tmp_path / "none", overrides=[*TINY, *policy], log=None)
    assert not (tmp_path / "none").exists()


KILLED_SAVE = """
import os, sys, time
import uform
from uform.config import resolve
from uform.rotation import Rotation
from uform.run_config import CheckpointConfig, RunConfig
from uform.run_dir import RunDir
from uform.replica import checkpoint

config = uform.TrainerInitVramConfig(
    depth=1, hidden=128, objective=uform.Objective.Masked,
    batch=uform.BatchShape(max_rows_per_device=2, max_segments_per_device=4, max_columns_per_row=32),
    schedule=uform.Schedule(steps=10),
)
folder = RunDir.create(sys.argv[1], RunConfig(trainer=resolve(config)))
rotation = Rotation(folder, CheckpointConfig(every=1, keep_last=1))
trainer = uform.Trainer.init_vram(uform.Executor.cpu(), config)
for step in (1, 2):
    folder.save(trainer, step)
    rotation.saved(step)
replace = os.replace
def stalled(source, target):  # the third save's file is written whole, and the process dies before its rename
    print("renaming", flush=True)
    time.sleep(600)
checkpoint.os.replace = stalled
folder.save(trainer, 3)
"""


def test_a_save_killed_by_sigkill_leaves_the_last_whole_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(run)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "renaming\n"
        child.kill()
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    files = sorted(p.name for p in (run / "checkpoints").iterdir())  # step 1 rotated away, step 3 a temp file
    assert len(files) == 2 and files[1] == "step-00000002.safetensors"
    assert files[0].startswith(".step-00000003.safetensors.tmp-")
    assert latest(run) == str(run / "checkpoints" / "step-00000002.safetensors")  # the temp file passed silently
    (run / "checkpoints" / "step-00000009.safetensors").write_bytes(b"torn")  # a foreign or torn file
    with pytest.warns(CheckpointWarning, match=r"passed over .*step-00000009\.safetensors"):
        assert latest(run) == str(run / "checkpoints" / "step-00000002.safetensors")


# --------------------------------------------------------------------------------------------------
# Signals


def raise_at(step: int, *signals: signal.Signals) -> Any:
    def progress(report: FitStep) -> None:
        if report.step == step:
            for number in signals:
                signal.raise_signal(number)

    return progress


def test_a_signal_saves_at_the_step_boundary_and_the_resume_is_bitwise(tmp_path: Path) -> None:
    overrides = [*TINY, "trainer.schedule.steps=5"]
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    out = io.StringIO()
    stopped = uform.fit(PAIRS, tmp_path / "split", overrides=overrides, progress=raise_at(2, signal.SIGTERM), log=out)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # nothing left behind
    # Step 3 was in flight when step 2 reported (fit keeps two): it finishes, and the run stops after it.
    assert stopped.interrupted == signal.SIGTERM and (stopped.step, stopped.taken) == (3, 3)
    assert stopped.checkpoint == str(tmp_path / "split" / "checkpoints" / "step-00000003.safetensors")
    assert "SIGTERM: stopping after step 3" in out.getvalue()
    assert stopped.report().startswith("uform: run interrupted by SIGTERM at step 3 of 5")
    assert "--resume latest" in stopped.report()
    rest = uform.fit(PAIRS, tmp_path / "split", overrides=overrides, resume="latest", log=None)
    whole = uform.fit(PAIRS, tmp_path / "straight", overrides=overrides, log=None)
    assert rest.checkpoint is not None and whole.checkpoint is not None and rest.interrupted is None
    assert_same_tensors(tensors(rest.checkpoint), tensors(whole.checkpoint))


def test_a_second_signal_stops_at_once_leaving_the_last_whole_checkpoint(tmp_path: Path) -> None:
    overrides = [*TINY, "trainer.schedule.steps=6", "checkpoint.every=1"]
    # The second signal puts back the handler from before the run and raises again. Python's own (a
    # KeyboardInterrupt) is what a process started from a terminal has; one started as a shell's background job
    # inherits SIGINT ignored, which Python keeps, and there the second signal would rightly do nothing.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            uform.fit(
                PAIRS, tmp_path / "run", overrides=overrides, progress=raise_at(3, *[signal.SIGINT] * 2), log=None
            )
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert names(tmp_path / "run") == ["step-00000001.safetensors", "step-00000002.safetensors"]
    assert latest(tmp_path / "run") == str(tmp_path / "run" / "checkpoints" / "step-00000002.safetensors")


def test_handlers_live_only_inside_fit_and_only_in_the_main_thread(tmp_path: Path) -> None:
    seen: list[Any] = []

    def look(report: FitStep) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))

    overrides = [*TINY, "trainer.schedule.steps=1"]
    uform.fit(PAIRS, tmp_path / "main", overrides=overrides, progress=look, log=None)
    assert callable(seen[0]) and seen[0] is not signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    worker = threading.Thread(
        target=uform.fit,
        args=(PAIRS, tmp_path / "thread"),
        kwargs={"overrides": overrides, "progress": look, "log": None},
    )
    worker.start()
    worker.join()
    assert seen[1] == signal.SIG_DFL and (tmp_path / "thread" / "checkpoints" / "step-00000001.safetensors").exists()
    with Interrupts() as caught:
        signal.raise_signal(signal.SIGINT)
    assert caught.signal == signal.SIGINT and caught.name == "SIGINT"
    assert (exit_status(signal.SIGINT), exit_status(signal.SIGTERM)) == (130, 143)


def test_sigterm_to_uform_train_mid_run_then_resume_latest_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    steps = 100  # far more than the 3 steps waited for: the signal lands mid-run even on a loaded machine
    overrides = [*TINY, f"trainer.schedule.steps={steps}"]
    sets = [arg for o in overrides for arg in ("--set", o)]
    run = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-m", "uform", "train", PAIRS, "--output", str(run), *sets],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    metrics = run / "metrics.jsonl"
    try:
        while child.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.005)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, err
    stopped = latest(run)
    assert stopped is not None
    at = int(Path(stopped).stem.removeprefix("step-"))
    assert 3 <= at < steps, "the run ended before the signal"
    assert f"interrupted at step {at}" in out and "SIGTERM" in err
    assert [r["step"] for r in read_metrics(metrics) if r["kind"] == "step"] == list(range(1, at + 1))

    assert main(["train", PAIRS, "--output", str(run), "--resume", "latest", *sets]) == 0
    whole = uform.fit(PAIRS, tmp_path / "straight", overrides=overrides, log=None)
    assert whole.checkpoint is not None
    assert_same_tensors(tensors(run / "checkpoints" / f"step-{steps:08d}.safetensors"), tensors(whole.checkpoint))


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_of_a_two_device_run_saves_at_a_step_boundary(tmp_path: Path) -> None:
    # A terminal's Ctrl-C reaches every process of the group: the device workers leave it to the trainer's process.
    run = tmp_path / "run"
    sets = [arg for o in [*TINY, "trainer.schedule.steps=40"] for arg in ("--set", o)]
    child = subprocess.Popen(
        [sys.executable, "-m", "uform", "train", PAIRS, "--output", str(run), "--devices", "cpu:2", *sets],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a shell gives a job
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    metrics = run / "metrics.jsonl"
    try:
        while child.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.005)
        os.killpg(child.pid, signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, err
    stopped = latest(run)
    assert stopped is not None and "SIGINT: stopping after step" in err
    at = int(Path(stopped).stem.removeprefix("step-"))
    assert 2 <= at < 40 and read_data_state(stopped)["step"] == at + 1


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_every_process_at_one_step_and_saves_there(tmp_path: Path) -> None:
    # torchrun forwards the signal to each process; they agree on the step (a check every STOP_CHECK_EVERY steps).
    from uform.fitting import STOP_CHECK_EVERY

    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    sets = [arg for o in [*TINY, "trainer.schedule.steps=60"] for arg in ("--set", o)]
    child = subprocess.Popen(
        [*command, "-m", "uform", "train", PAIRS, "--output", "run", *sets],
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        while child.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.005)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=200)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    stopped = latest(tmp_path / "run")
    assert stopped is not None, err[-4000:]
    at = int(Path(stopped).stem.removeprefix("step-"))
    assert at % STOP_CHECK_EVERY == 0 and at < 60 and f"interrupted at step {at}" in out
    assert sorted(read_data_state(stopped)["shares"]) == ["0", "1"]  # both processes' positions, merged
    assert [r["step"] for r in read_metrics(metrics) if r["kind"] == "step"] == list(range(1, at + 1))
