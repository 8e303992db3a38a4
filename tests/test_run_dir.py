"""Where a run writes (issue 13, item 8): config.toml, metrics.jsonl, checkpoints and the newest whole one."""

from __future__ import annotations

import dataclasses
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from uform import BatchShape, Executor, Objective, Schedule, Trainer, TrainerInitVramConfig, TrainerStepConfig
from uform.config import TrainerStepStats, resolve
from uform.notices import CheckpointWarning, Notices
from uform.run_config import RunConfig, read_run_config
from uform.run_dir import RunDir, latest, read_metrics

TEXTS = ["a cat on a mat", "a dog in the fog", "rain on the roof", "a boat at sea"]
CONFIG = TrainerInitVramConfig(
    depth=1,
    hidden=128,
    objective=Objective.Masked,
    batch=BatchShape(max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=32),
    schedule=Schedule(steps=10),
    seed=3,
)
RUN = RunConfig(trainer=resolve(CONFIG))


def test_create_writes_the_resolved_config_and_refuses_a_used_folder(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "out" / "run", RUN)
    assert run.config() == RUN and run.config().trainer == resolve(CONFIG)
    assert sorted(p.name for p in Path(run.path).iterdir()) == ["checkpoints", "config.toml"]
    before = (Path(run.path) / "config.toml").read_bytes()
    with pytest.raises(FileExistsError, match="already holds files"):
        RunDir.create(run.path, dataclasses.replace(RUN, init_from="x.safetensors"))
    assert (Path(run.path) / "config.toml").read_bytes() == before
    assert RunDir.open(run.path).config() == RUN
    with pytest.raises(FileNotFoundError, match="not a run's folder"):
        RunDir.open(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert RunDir.create(empty, RUN).config() == RUN  # an empty folder that exists is fine


def test_a_refused_create_makes_nothing(tmp_path: Path) -> None:
    broken = resolve(CONFIG)
    broken = dataclasses.replace(broken, schedule=dataclasses.replace(broken.schedule, learning_rate=math.nan))
    with pytest.raises(ValueError, match=r"trainer\.schedule\.learning_rate: nan"):
        RunDir.create(tmp_path / "new", RunConfig(trainer=broken))
    assert not (tmp_path / "new").exists()
    with pytest.raises(TypeError, match="config: expected a RunConfig"):
        RunDir.create(tmp_path / "new", CONFIG)  # type: ignore[arg-type]
    assert not (tmp_path / "new").exists()


def test_metrics_carry_the_step_stats_by_name_one_flushed_line_each(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run", RUN)
    trainer = Trainer.init_vram(Executor.cpu(), CONFIG)
    writer = run.metrics()
    for _ in range(2):
        stats = TrainerStepStats()
        trainer.step(["text"] * len(TEXTS), TEXTS, TrainerStepConfig(stats=stats))
        writer.step(stats, items=len(TEXTS), seconds=0.5, wall_time=1000.0 + stats.step)
        assert len(read_metrics(run.metrics_path)) == stats.step  # on disk before the writer closes
    writer.eval(2, {"recall@1": 0.5, "split": "held_out"}, wall_time=2000.0)
    writer.close()
    trainer.close()
    records = read_metrics(run.metrics_path)
    names = [f.name for f in dataclasses.fields(TrainerStepStats)]
    assert [r["kind"] for r in records] == ["step", "step", "eval"]
    for step, record in enumerate(records[:2], start=1):
        assert set(names) <= set(record) and record["step"] == step
        assert record["items_per_second"] == len(TEXTS) / 0.5 and record["wall_time"] == 1000.0 + step
        assert record["loss"] > 0 and record["learning_rate"] > 0
    assert records[2] == {"kind": "eval", "step": 2, "recall@1": 0.5, "split": "held_out", "wall_time": 2000.0}
    with pytest.raises(ValueError, match="was closed"):
        writer.eval(3, {})
    with pytest.raises(ValueError, match="not a result name"):
        run.metrics().eval(3, {"step": 1})


def test_metrics_keep_nonfinite_values_skip_a_torn_tail_and_drop_lost_steps(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run", RUN)
    with run.metrics() as writer:
        for step in (1, 2, 3):
            writer.step(TrainerStepStats(step=step, loss=math.nan if step == 2 else 1.0), items=4, seconds=0)
    text = Path(run.metrics_path).read_text()
    assert "NaN" not in text and '"loss": "nan"' in text  # strict JSON on disk
    records = read_metrics(run.metrics_path)
    assert math.isnan(records[1]["loss"]) and records[0]["items_per_second"] is None
    with open(run.metrics_path, "a") as f:
        f.write('{"kind": "step", "st')  # a run killed while writing its last line
    assert len(read_metrics(run.metrics_path)) == 3
    run.metrics(resumed_at=1).close()  # the run resumed from step 1's checkpoint: steps 2 and 3 are lost work
    assert [r["step"] for r in read_metrics(run.metrics_path)] == [1]
    Path(run.metrics_path).write_text('{"kind": "step"}\nnot json\n{"kind": "step"}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON object"):
        read_metrics(run.metrics_path)


def test_latest_is_the_newest_whole_checkpoint(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run", RUN)
    assert latest(run.path) is None
    trainer = Trainer.init_vram(Executor.cpu(), CONFIG)
    for step in (1, 2):
        trainer.step(["text"] * len(TEXTS), TEXTS, TrainerStepConfig())
        assert run.save(trainer, step) == str(Path(run.checkpoints) / f"step-{step:08d}.safetensors")
    trainer.close()
    folder = Path(run.checkpoints)
    good = folder / "step-00000002.safetensors"
    data = good.read_bytes()
    (folder / "step-00000003.safetensors").write_bytes(data[: len(data) // 2])  # torn
    flipped = bytearray(data)
    flipped[-1] ^= 1
    (folder / "step-00000004.safetensors").write_bytes(bytes(flipped))  # whole header, corrupt data
    save_file({"w": torch.zeros(2)}, str(folder / "step-00000005.safetensors"), metadata={"format": "pt"})  # foreign
    (folder / "notes.txt").write_text("hello")
    shutil.copy(good, folder / ".step-00000006.safetensors.tmp-123-0123456789ab")  # a save in flight
    notices = Notices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = run.latest(notices)
    assert found == str(good)
    assert [w.category for w in caught] == [CheckpointWarning]  # shown once,
    assert notices.count("checkpoint") == 4  # every file passed over counted
    with pytest.warns(CheckpointWarning, match=r"passed over .*notes\.txt"):
        assert latest(folder, Notices()) == str(good)  # the checkpoints folder itself names the same
    resumed = Trainer.init_vram(Executor.cpu(), dataclasses.replace(CONFIG, resume=found))
    assert resumed.steps_taken == 2
    resumed.close()
    with pytest.raises(FileNotFoundError, match="not a run's folder"):
        latest(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="step: must lie in"):
        run.checkpoint_path(-1)


def test_the_pieces_make_a_run_that_resumes_from_latest(tmp_path: Path) -> None:
    """What `uform train` will do with them: a run file, a new run from another's weights, its folder, a resume."""
    base = Trainer.init_vram(Executor.cpu(), CONFIG)
    base.step(["text"] * len(TEXTS), TEXTS, TrainerStepConfig())
    base.save(tmp_path / "base.safetensors")
    base.close()
    (tmp_path / "run.toml").write_text(
        '[trainer]\ndepth = 1\nhidden = 128\nobjective = "masked"\nseed = 9\ninit_from = "base.safetensors"\n'
        "[trainer.batch]\nmax_rows_per_device = 4\nmax_segments_per_device = 8\nmax_columns_per_row = 32\n"
        "[trainer.schedule]\nsteps = 10\n"
    )
    config = read_run_config(tmp_path / "run.toml", ["trainer.schedule.steps=20"])
    run = RunDir.create(tmp_path / "out", config)
    trainer = Trainer.init_vram(Executor.cpu(), run.config().trainer, init_from=run.config().init_from)
    assert trainer.init_from is not None and trainer.init_from.source_step == 1
    with run.metrics() as metrics:
        for _ in range(2):
            stats = TrainerStepStats()
            trainer.step(["text"] * len(TEXTS), TEXTS, TrainerStepConfig(stats=stats))
            metrics.step(stats, items=len(TEXTS), seconds=0.1)
            run.save(trainer, stats.step)
    trainer.close()
    found = run.latest()
    assert found is not None and found.endswith("step-00000002.safetensors")
    resumed = Trainer.init_vram(Executor.cpu(), dataclasses.replace(run.config().trainer, resume=found))
    assert resumed.steps_taken == 2 and resumed.config.schedule.steps == 20
    resumed.close()
    assert [r["step"] for r in read_metrics(run.metrics_path)] == [1, 2]
