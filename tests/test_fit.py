"""`uform.fit` and `uform train` (issue 13, items 1, 5, 7, 8, 9): the examples end to end, config errors
before anything is written, exact resume with the data position, two CPU devices, init_from by run file."""

from __future__ import annotations

import json
import math
import tomllib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import uform
from uform import Executor, Trainer, TrainerInitVramConfig
from uform.cli import main
from uform.fitting import FitStep
from uform.replica.checkpoint import CheckpointError, read_checkpoint, read_metadata
from uform.replica.run_schema import DATA_KEY
from uform.replica.stored_run import read_data_state
from uform.run_config import read_run_config
from uform.run_dir import read_metrics
from uform.sources import Loader, open_source

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PAIRS = str(EXAMPLES / "text_pairs.toml")


def run_tensors(path: str) -> dict[str, torch.Tensor]:
    return read_checkpoint(path, None, 10, "cpu")[0]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("example", ["text_pairs.toml", "image_text.toml"])
def test_the_cli_trains_each_example_end_to_end(example: str, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error", uform.UformWarning)  # nothing skipped, dropped or cut quietly
        status = main(["train", str(EXAMPLES / example), "--output", str(out), "--set", "trainer.schedule.steps=3"])
    assert status == 0, capsys.readouterr().err
    steps = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and r["items_per_second"] > 0 for r in steps)
    assert all(r["dropped"] == 0 and r["skipped"] == 0 for r in steps)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003.safetensors"]
    assert read_run_config(out / "config.toml").trainer.schedule.steps == 3
    assert "done" in capsys.readouterr().out


def test_the_image_example_holds_what_its_script_draws(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("draw", EXAMPLES / "image_text" / "draw.py")
    assert spec is not None and spec.loader is not None
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    draw.main(str(tmp_path))
    for manifest in ("captions.jsonl", "held_out.jsonl"):
        ours = (EXAMPLES / "image_text" / manifest).read_text()
        assert (tmp_path / manifest).read_text() == ours
        for line in ours.splitlines():
            name = json.loads(line)["image"]
            drawn = np.asarray(Image.open(tmp_path / name))
            assert np.array_equal(np.asarray(Image.open(EXAMPLES / "image_text" / name)), drawn), name
    held = {json.loads(line)["caption"] for line in (tmp_path / "held_out.jsonl").read_text().splitlines()}
    trained = {json.loads(line)["caption"] for line in (tmp_path / "captions.jsonl").read_text().splitlines()}
    assert len(held) == 8 and not held & trained  # scenes the run never trains on


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.batch.max_rows=4", "trainer.batch.max_rows: unknown key"),
        ("trainer.objective=contrastiv", "trainer.objective"),
        ("trainer.schedule.steps=many", "trainer.schedule.steps: expected an int"),
        ("data.fields.question=txt", "fields.question: 'txt' is no role"),
        ("data.held_out=no-such-file.jsonl", "data.held_out: [Errno 2] No such file"),
        ("eval.every=-1", "eval.every: must not be negative, got -1"),
        ("eval.widths=[512]", "eval.widths[0]: must lie in [1, trainer.hidden = 128], got 512"),
    ],
)
def test_a_config_error_names_the_key_path_and_writes_nothing(
    override: str, key: str, tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "run"
    assert main(["train", PAIRS, "--output", str(out), "--set", override]) == 2
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_bad_devices_and_a_resume_without_a_run_exit_nonzero(tmp_path: Path, capsys: Any) -> None:
    assert main(["train", PAIRS, "--output", str(tmp_path / "a"), "--devices", "cpu:0"]) == 2
    assert main(["train", PAIRS, "--output", str(tmp_path / "b"), "--resume", "latest"]) == 2
    assert "holds no config.toml" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def logged(into: list[tuple[int, list[str]]]) -> Any:
    def progress(report: FitStep) -> None:
        into.append((report.step, report.records))

    return progress


def test_stop_at_k_and_resume_latest_equals_the_straight_run_bitwise_data_included(tmp_path: Path) -> None:
    # 24 pairs, 8 a step: 3 steps an epoch, so the resume at step 2 continues mid-epoch and crosses into the next.
    steps = ["trainer.schedule.steps=5"]
    straight: list[tuple[int, list[str]]] = []
    whole = uform.fit(PAIRS, tmp_path / "straight", overrides=steps, progress=logged(straight), log=None)
    assert (whole.step, whole.taken) == (5, 5)

    split: list[tuple[int, list[str]]] = []
    first = uform.fit(PAIRS, tmp_path / "split", overrides=steps, stop_after=2, progress=logged(split), log=None)
    assert (first.step, first.taken) == (2, 2) and first.checkpoint is not None
    assert read_data_state(first.checkpoint)["step"] == 3  # the loader's next step rides in the checkpoint
    rest = uform.fit(PAIRS, tmp_path / "split", overrides=steps, resume="latest", progress=logged(split), log=None)
    assert (rest.step, rest.taken) == (5, 3)

    assert split == straight
    assert len({r for _, records in straight[:3] for r in records}) == 24  # the first epoch read every record once
    assert whole.checkpoint is not None and rest.checkpoint is not None
    assert_same_tensors(run_tensors(rest.checkpoint), run_tensors(whole.checkpoint))
    assert read_data_state(rest.checkpoint) == read_data_state(whole.checkpoint)

    def losses(run: str) -> list[tuple[int, float]]:  # the step records (the example's evaluations beside them)
        return [(r["step"], r["loss"]) for r in read_metrics(tmp_path / run / "metrics.jsonl") if r["kind"] == "step"]

    assert losses("split") == losses("straight")


def test_two_cpu_devices_read_the_global_records_of_two_ranks_and_train(tmp_path: Path) -> None:
    run = read_run_config(PAIRS, ["trainer.schedule.steps=3"])
    seen: list[tuple[int, list[str]]] = []
    executor = Executor.cpu(workers=2)
    try:
        summary = uform.fit(run, tmp_path / "two", devices=executor, progress=logged(seen), log=None)
    finally:
        executor.close()
    assert summary.step == 3
    metrics = read_metrics(tmp_path / "two" / "metrics.jsonl")
    steps = [r for r in metrics if r["kind"] == "step"]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert [r["items"] for r in steps] == [len(records) for _, records in seen]  # both devices' items a step
    assert [r["step"] for r in metrics if r["kind"] == "eval"] == [3]  # the held-out pairs, through both workers

    # What two processes of one device each read (the loader's rank rule), together, step by step.
    assert run.data is not None
    source = open_source(list(run.data.train), fields=dict(run.data.fields))
    ranks = [Loader(source, run.trainer, rank=r, world=2, devices=2) for r in range(2)]
    expected = [(k, [i for loader in ranks for i in loader.next_step().records]) for k in (1, 2, 3)]
    assert seen == expected
    one = Loader(source, run.trainer, devices=1).next_step().records
    assert len(seen[0][1]) == 2 * len(one)  # two devices' shares a step, each one device's room


def test_init_from_in_the_run_file_starts_from_the_other_runs_tower(tmp_path: Path) -> None:
    base = uform.fit(PAIRS, tmp_path / "base", overrides=["trainer.schedule.steps=2"], log=None)
    assert base.checkpoint is not None
    # A new run (another seed) that barely moves its weights: its first checkpoint is the source's tower.
    tiny = [
        "trainer.schedule.steps=1",
        "trainer.schedule.learning_rate=1e-12",
        "trainer.schedule.min_learning_rate=1e-13",
        "trainer.seed=5",
    ]
    new = uform.fit(
        PAIRS, tmp_path / "new", overrides=[*tiny, f"trainer.init_from={json.dumps(base.checkpoint)}"], log=None
    )
    fresh = uform.fit(PAIRS, tmp_path / "fresh", overrides=tiny, log=None)
    assert new.checkpoint is not None and fresh.checkpoint is not None
    source, started, alone = (run_tensors(p) for p in (base.checkpoint, new.checkpoint, fresh.checkpoint))
    tower = [k for k in source if k.startswith("weights.") and ".blocks." in k]
    assert tower
    for name in tower:
        assert torch.allclose(started[name], source[name], atol=1e-6), name
    assert any(not torch.allclose(alone[name], source[name], atol=1e-3) for name in tower)
    assert read_metadata(new.checkpoint)["uform.step"] == "1"  # a new run: its own step count


def test_the_data_slot_round_trips_is_bounded_and_is_absent_from_a_plain_save(tmp_path: Path) -> None:
    from uform import BatchShape, Objective, Schedule, TrainerStepConfig

    config = TrainerInitVramConfig(
        depth=1,
        hidden=128,
        objective=Objective.Masked,
        batch=BatchShape(max_rows_per_device=2, max_segments_per_device=4, max_columns_per_row=32),
        schedule=Schedule(steps=2),
    )
    trainer = Trainer.init_vram(Executor.cpu(), config)
    try:
        trainer.step(["text", "text"], ["a cat", "a dog"], TrainerStepConfig())
        trainer.save(tmp_path / "plain.safetensors")
        assert read_data_state(tmp_path / "plain.safetensors") is None
        assert DATA_KEY not in read_metadata(tmp_path / "plain.safetensors")
        trainer.save(tmp_path / "data.safetensors", data_state={"shares": {"0": [1, 2]}})
        assert read_data_state(tmp_path / "data.safetensors") == {"shares": {"0": [1, 2]}}
        with pytest.raises(ValueError, match="data_state: must be plain JSON"):
            trainer.save(tmp_path / "nan.safetensors", data_state={"x": float("nan")})
        with pytest.raises(ValueError, match=r"data_state: .* more than MAX_DATA_BYTES"):
            trainer.save(tmp_path / "big.safetensors", data_state={"x": "y" * 1_000_001})
        with pytest.raises(TypeError, match="data_state: expected a JSON-able dict"):
            trainer.save(tmp_path / "list.safetensors", data_state=[1])  # type: ignore[arg-type]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data.safetensors", "plain.safetensors"]
    finally:
        trainer.close()


def test_a_stored_data_slot_of_another_format_is_refused_from_the_header(tmp_path: Path) -> None:
    from uform.replica.run_schema import DATA_FORMAT, stored_data

    assert stored_data({DATA_KEY: json.dumps({"format": DATA_FORMAT, "state": {"a": 1}})}, "f") == {"a": 1}
    for text in ("{", json.dumps({"format": "uform.data.9", "state": {}}), json.dumps([1]), "x" * 1_000_001):
        with pytest.raises(CheckpointError, match=DATA_KEY):
            stored_data({DATA_KEY: text}, "f")


def test_the_readmes_record_examples_read_by_their_fields(tmp_path: Path) -> None:
    from test_readme import blocks

    from uform.sources.fields import read_record

    mappings = [b for b in blocks("toml") if b.startswith("fields = ")]
    records = blocks("jsonl")
    assert len(mappings) == len(records) == 5
    for i, (mapping, lines) in enumerate(zip(mappings, records, strict=True)):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "data.jsonl").write_text(lines)
        for line in lines.splitlines():
            for value in json.loads(line).values():
                if isinstance(value, str) and value.startswith("images/"):
                    (folder / "images").mkdir(exist_ok=True)
                    Image.new("RGB", (32, 32), (200, 40, 40)).save(folder / value)
        source = open_source(str(folder / "data.jsonl"), fields=tomllib.loads(mapping)["fields"])
        read = [read_record(r, source.fields) for r in source.records(0)]
        assert len(read) == len(lines.splitlines()) and all(r.modalities and r.missing is None for r in read), i


def test_any_iterable_of_records_is_a_source_for_fit(tmp_path: Path) -> None:
    from uform.run_config import RunConfig

    trainer = read_run_config(PAIRS, ["trainer.schedule.steps=2"]).trainer
    rows = [{"k": f"r{i}", "a": f"question {i}?", "b": f"answer number {i}."} for i in range(12)]
    with pytest.raises(ValueError, match=r"data\.train"):
        uform.fit(RunConfig(trainer), tmp_path / "none", log=None)
    assert not (tmp_path / "none").exists()
    seen: list[tuple[int, list[str]]] = []
    fields = {"k": "id", "a": "text", "b": "text"}
    summary = uform.fit(
        RunConfig(trainer), tmp_path / "rows", data=rows, fields=fields, progress=logged(seen), log=None
    )
    assert summary.step == 2 and summary.items == sum(len(r) for _, r in seen)
    assert {r for _, records in seen for r in records} <= {f"r{i}" for i in range(12)}


def test_a_run_refused_at_init_vram_writes_no_folder(tmp_path: Path, capsys: Any) -> None:
    missing = json.dumps(str(tmp_path / "no-such.safetensors"))
    out = tmp_path / "run"
    assert main(["train", PAIRS, "--output", str(out), "--set", f"trainer.init_from={missing}"]) == 2
    assert "no-such.safetensors" in capsys.readouterr().err
    assert not out.exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["train", PAIRS, "--output", str(tmp_path / "full")]) == 2
    assert "already holds files" in capsys.readouterr().err
