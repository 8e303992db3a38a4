"""Saving and resuming: a resumed run is the run that never stopped, bit for bit; saves are atomic."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest
from conftest import (
    assert_same,
    assert_same_output,
    make_config,
    overfull_texts,
    snapshot,
    step_with,
)
from safetensors import safe_open

import uform
from uform import (
    BatchShape,
    Objective,
    Schedule,
    Stopped,
    Trainer,
    TrainerInitVramConfig,
    TrainerSaveConfig,
)
from uform.checkpoint import read_metadata

OVERFULL = overfull_texts(12)


def _step(trainer: Trainer, k: int):
    """The k-th step of the scripted run: step 2 is overfull and reads no stats, so its drops carry over."""
    if k == 2:
        return step_with(trainer, OVERFULL, stats=False)
    if k == 3:
        return step_with(trainer, OVERFULL)
    return step_with(trainer)


def _tensor_count(path: os.PathLike | str) -> int:
    with safe_open(os.fspath(path), framework="pt") as f:
        return len(list(f.keys()))


@pytest.fixture
def straight(make_trainer):
    """Four steps without a stop: the stats and outputs of each, and the final state."""
    trainer = make_trainer()
    results = [_step(trainer, k) for k in range(1, 5)]
    return results, snapshot(trainer), trainer


def _check_continues(resumed: Trainer, straight) -> None:
    results, final, _ = straight
    assert resumed.steps_taken == 2
    for k in (3, 4):
        stats, out = _step(resumed, k)
        assert stats == results[k - 1][0], f"step {k}"
        assert stats.step == k
        assert_same_output(out, results[k - 1][1])
    assert resumed.steps_taken == 4
    assert_same(snapshot(resumed), final)


def test_resume_is_bitwise_the_run_that_never_stopped(make_trainer, executor, straight, tmp_path) -> None:
    results, _, _ = straight
    # The scripted run really carries drops over the save: step 3 reports step 2's drops and its own.
    assert results[1][0] is None
    dropped = [int((out.abs().sum(dim=1) == 0).sum()) for _, out in results]
    assert dropped[1] > 0 and dropped[2] > 0
    assert results[2][0].dropped == dropped[1] + dropped[2]
    assert results[3][0].dropped == dropped[3] == 0

    first = make_trainer()
    for k in (1, 2):
        _step(first, k)
    path = tmp_path / "run.safetensors"
    first.save(path)
    resumed = make_trainer(make_config(resume=path))
    _check_continues(resumed, straight)


def test_resume_with_the_stored_config_alone(make_trainer, straight, tmp_path) -> None:
    first = make_trainer()
    for k in (1, 2):
        _step(first, k)
    path = tmp_path / "run.safetensors"
    first.save(path)
    resumed = make_trainer(TrainerInitVramConfig(resume=path))
    assert dataclasses.replace(resumed.config, resume=None) == dataclasses.replace(first.config, resume=None)
    _check_continues(resumed, straight)


@pytest.mark.parametrize("form", ["str", "bytes", "pathlike"])
def test_save_and_resume_take_str_bytes_and_pathlike(make_trainer, straight, tmp_path, form: str) -> None:
    first = make_trainer()
    for k in (1, 2):
        _step(first, k)
    target = tmp_path / "run.safetensors"
    path = {"str": str(target), "bytes": os.fsencode(target), "pathlike": target}[form]
    first.save(path)
    assert target.is_file()
    resumed = make_trainer(make_config(resume=path))
    _check_continues(resumed, straight)


def test_save_config_with_a_bytes_path(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    step_with(trainer)
    trainer.save(TrainerSaveConfig(path=os.fsencode(tmp_path / "b.safetensors")))
    trainer.on(trainer.executor).save(TrainerSaveConfig(path=tmp_path / "c.safetensors"))
    assert (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "c.safetensors").read_bytes()


def test_save_refuses_a_wrong_path_type(make_trainer) -> None:
    trainer = make_trainer()
    with pytest.raises(TypeError, match="path"):
        trainer.save(42)
    with pytest.raises(TypeError, match="path"):
        trainer.save(TrainerSaveConfig(path=None))


def test_resume_keeps_saving_the_same_run(make_trainer, tmp_path) -> None:
    """A checkpoint of a resumed run holds the same step, config and tensors as the original's."""
    first = make_trainer()
    for k in (1, 2):
        _step(first, k)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    first.save(a)
    make_trainer(make_config(resume=a)).save(b)
    assert a.read_bytes() == b.read_bytes()
    meta = read_metadata(a)
    assert meta["uform.step"] == "2"


def test_resume_may_lengthen_the_schedule(make_trainer, tmp_path) -> None:
    first = make_trainer()
    step_with(first)
    path = tmp_path / "run.safetensors"
    first.save(path)
    longer = Schedule(steps=40, warmup_steps=2, learning_rate=1e-3)
    resumed = make_trainer(make_config(resume=path, schedule=longer))
    stats, _ = step_with(resumed)
    assert stats.step == 2
    assert stats.learning_rate == uform.optim.learning_rate(uform.resolve(make_config(schedule=longer)).schedule, 2)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden": 256}, "hidden"),
        ({"depth": 2}, "depth"),
        ({"seed": 8}, "seed"),
        ({"objective": Objective.Masked}, "objective"),
        ({"batch": BatchShape(max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=128)}, "batch"),
    ],
    ids=["hidden", "depth", "seed", "objective", "batch"],
)
def test_resume_refuses_another_run(make_trainer, executor, tmp_path, overrides, field: str) -> None:
    first = make_trainer()
    step_with(first)
    path = tmp_path / "run.safetensors"
    first.save(path)
    with pytest.raises(ValueError) as caught:
        Trainer.init_vram(executor, make_config(resume=path, **overrides))
    assert str(caught.value).startswith(field), caught.value


def test_resume_reports_progress_and_stops_when_told(make_trainer, executor, tmp_path) -> None:
    first = make_trainer()
    step_with(first)
    path = tmp_path / "run.safetensors"
    first.save(path)
    total = _tensor_count(path)

    calls: list[tuple[int, int]] = []
    resumed = make_trainer(make_config(resume=path, progress=lambda d, t: calls.append((d, t)), progress_steps=4))
    assert 1 <= len(calls) <= 4
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted({d for d, _ in calls})
    assert_same(snapshot(resumed), snapshot(first))

    calls.clear()
    make_trainer(TrainerInitVramConfig(resume=path, progress=lambda d, t: calls.append((d, t))))
    assert 1 <= len(calls) <= 10 and calls[-1] == (total, total)

    with pytest.raises(Stopped):
        Trainer.init_vram(executor, make_config(resume=path, progress=lambda d, t: False))
    seen: list[int] = []

    def stop_at_the_end(done: int, t: int) -> bool:
        seen.append(done)
        return done < t

    with pytest.raises(Stopped):
        Trainer.init_vram(executor, make_config(resume=path, progress=stop_at_the_end, progress_steps=3))
    assert seen[-1] == total


@pytest.mark.parametrize("progress_steps", [0, 1, 3, 1000])
def test_save_reports_progress(make_trainer, tmp_path, progress_steps: int) -> None:
    trainer = make_trainer()
    step_with(trainer)
    calls: list[tuple[int, int]] = []
    path = tmp_path / "run.safetensors"
    trainer.save(
        TrainerSaveConfig(path=path, progress=lambda d, t: calls.append((d, t)), progress_steps=progress_steps)
    )
    total = _tensor_count(path)
    assert 1 <= len(calls) <= (progress_steps or 10)
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted({d for d, _ in calls})
    if progress_steps >= total:
        assert len(calls) == total


@pytest.mark.parametrize("stop_at", ["first", "last"])
def test_a_stopped_save_leaves_the_earlier_checkpoint(make_trainer, tmp_path, stop_at: str) -> None:
    trainer = make_trainer()
    step_with(trainer)
    path = tmp_path / "run.safetensors"
    trainer.save(path)
    before = path.read_bytes()
    step_with(trainer)  # the run moved on: a finished save would change the file

    def stop(done: int, total: int) -> bool:
        return stop_at == "last" and done < total

    with pytest.raises(Stopped):
        trainer.save(TrainerSaveConfig(path=path, progress=stop, progress_steps=5))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["run.safetensors"]

    with pytest.raises(Stopped):
        trainer.save(TrainerSaveConfig(path=tmp_path / "new.safetensors", progress=stop))
    assert os.listdir(tmp_path) == ["run.safetensors"]

    # The trainer is unharmed: its next save and step work, and the stopped save changed nothing of it.
    state = snapshot(trainer)
    trainer.save(path)
    assert path.read_bytes() != before
    assert_same(snapshot(trainer), state)
    stats, _ = step_with(trainer)
    assert stats.step == 3


def test_a_stopped_deferred_save_fails_its_future(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    step_with(trainer)
    future = trainer.deferred(trainer.executor).save(
        TrainerSaveConfig(path=tmp_path / "run.safetensors", progress=lambda d, t: False)
    )
    assert isinstance(future.exception(timeout=60), Stopped)
    assert os.listdir(tmp_path) == []
    stats, _ = step_with(trainer)
    assert stats.step == 2


def test_save_folder_must_exist(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    with pytest.raises(OSError):
        trainer.save(pathlib.Path(tmp_path / "missing" / "run.safetensors"))
    assert os.listdir(tmp_path) == []


def test_resume_at_step_zero(make_trainer, tmp_path) -> None:
    fresh = make_trainer()
    path = tmp_path / "zero.safetensors"
    fresh.save(path)
    resumed = make_trainer(make_config(resume=path))
    assert resumed.steps_taken == 0
    assert_same(snapshot(resumed), snapshot(fresh))
    for _ in range(2):
        a, b = step_with(fresh), step_with(resumed)
        assert a[0] == b[0]
        assert_same_output(a[1], b[1])
    assert_same(snapshot(resumed), snapshot(fresh))


def test_resume_alone_does_not_silently_drop_other_fields(make_trainer, executor, tmp_path) -> None:
    first = make_trainer()
    step_with(first)
    path = tmp_path / "run.safetensors"
    first.save(path)
    # A conflicting seed is another run: refused, naming the field.
    with pytest.raises(ValueError, match="seed"):
        Trainer.init_vram(executor, TrainerInitVramConfig(resume=path, seed=99))
    # A longer schedule is a resumable field: honoured (or, at the least, refused by name).
    longer = Schedule(steps=40, warmup_steps=2, learning_rate=1e-3)
    resumed = make_trainer(TrainerInitVramConfig(resume=path, schedule=longer))
    assert resumed.config.schedule.steps == 40
