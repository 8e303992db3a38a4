"""The run file (issue 13, item 1): `[trainer]` by key path, `[data]`'s shape, `--set` overrides, the round trip."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

import pytest

from uform import BatchShape, Contrastive, ImageShape, Negatives, Objective, Schedule, TrainerInitVramConfig
from uform.config import resolve
from uform.run_config import (
    DataConfig,
    EvalConfig,
    RunConfig,
    RunConfigError,
    apply_overrides,
    check_eval,
    dump_run_config,
    load_run_config,
    read_run_config,
)

TEXT = """
[trainer]
depth = 2
hidden = 128
objective = "joint"
seed = 7
init_from = "runs/base/checkpoints/step-00000100.safetensors"

[trainer.batch]
max_rows_per_device = 4
max_segments_per_device = 8
max_columns_per_row = 64

[trainer.batch.image]
patch_side = 16

[trainer.contrastive]
matryoshka_dimensions = [64, 128]
negatives = "named"
pair_loss = "balanced"

[trainer.schedule]
steps = 100
learning_rate = 1e-3

[data]
train = "shards/{000..009}.tar"
fields = { jpg = "image", txt = "text" }
held_out = ["held/a.jsonl", "s3://bucket/held/*.tar"]
"""

EXPECTED = TrainerInitVramConfig(
    depth=2,
    hidden=128,
    objective=Objective.Joint,
    seed=7,
    batch=BatchShape(
        max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=64, image=ImageShape(patch_side=16)
    ),
    contrastive=Contrastive(matryoshka_dimensions=(64, 128), negatives=Negatives.Named, pair_loss="balanced"),
    schedule=Schedule(steps=100, learning_rate=1e-3),
)


def error(text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(RunConfigError) as raised:
        load_run_config(text, overrides or [])
    return str(raised.value)


def test_a_file_reads_into_the_resolved_config_the_library_call_makes() -> None:
    run = load_run_config(TEXT)
    assert run.trainer == resolve(EXPECTED)
    assert run.init_from == "runs/base/checkpoints/step-00000100.safetensors"
    assert run.data == DataConfig(
        train=("shards/{000..009}.tar",),
        fields=(("jpg", "image"), ("txt", "text")),
        held_out=("held/a.jsonl", "s3://bucket/held/*.tar"),
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.batch.image.patch_side='x'", "trainer.batch.image.patch_side: expected an int, got 'x'"),
        ("trainer.batch.image.patch_side=x", "trainer.batch.image.patch_side: expected an int, got 'x'"),
        (
            "trainer.batch.image.patch_sid=16",
            "trainer.batch.image.patch_sid: unknown key (did you mean trainer.batch.image.patch_side?)",
        ),
        ("trainer.scheduel.steps=5", "trainer.scheduel: unknown key (did you mean trainer.schedule?)"),
        ("trainer.dept=2", "trainer.dept: unknown key (did you mean trainer.depth?)"),
        (
            "trainer.objective='masekd'",
            "trainer.objective: unknown word 'masekd'; expected one of ['masked', 'contrastive', 'joint']",
        ),
        (
            "trainer.contrastive.negatives=3",
            "trainer.contrastive.negatives: expected one of the words ['ambient', 'named'], got 3",
        ),
        ("trainer.schedule.steps=5.0", "trainer.schedule.steps: expected an int, got 5.0"),
        ("trainer.schedule.steps=true", "trainer.schedule.steps: expected an int, got True"),
        ("trainer.schedule.learning_rate='fast'", "trainer.schedule.learning_rate: expected a number, got 'fast'"),
        (
            "trainer.contrastive.matryoshka_dimensions=[64, 'a']",
            "trainer.contrastive.matryoshka_dimensions[1]: expected an int, got 'a'",
        ),
        ("trainer.schedule=3", "trainer.schedule: expected a table ([trainer.schedule]), got 3"),
        ("trainer.schedule.steps=0", "trainer.schedule.steps: must be positive, got 0"),
        ("trainer.hidden=100", "trainer.hidden: must be a positive multiple of 128, got 100"),
        ("trainer.resume='x.safetensors'", "trainer.resume: not a run file key (a run resumes from the command line"),
        ("trainer.mesh=1", "trainer.mesh: not a run file key"),
        ("trainer.init_from=3", "trainer.init_from: expected a string, got 3"),
        ("seed=3", "seed: unknown key (did you mean trainer.seed?)"),
        ("trainr.seed=3", "trainr: unknown key (did you mean trainer?)"),
        ("checkpoint.every=-1", "checkpoint.every: expected a non-negative int, got -1"),
        ("checkpoint.keep_last=1.5", "checkpoint.keep_last: expected an int, got 1.5"),
        ("checkpoint.keep=3", "checkpoint.keep: unknown key (did you mean checkpoint.keep_last?)"),
        ("checkpoint.best=3", "checkpoint.best: expected a string, got 3"),
        ("checkpoint.mode=max", "checkpoint.mode: 'max' needs checkpoint.best"),
        ("checkpoint.best=eval/speed", "checkpoint.mode: cannot tell from 'eval/speed' whether more is better"),
        ("checkpoint={best='eval/a/recall@1', mode='most'}", "checkpoint.mode: expected 'max' or 'min', got 'most'"),
        ("log.every=0", "log.every: expected a positive int"),
        ("log.every=true", "log.every: expected an int, got True"),
        ("log.tensorboard=1", "log.tensorboard: expected true or false, got 1"),
        ("log.bar=true", "log.bar: unknown key (log: known keys are every, tensorboard)"),
        ("log=3", "log: expected a table ([log]), got 3"),
        ("eval.every=-1", "eval.every: must not be negative, got -1"),
        ("eval.evry=10", "eval.evry: unknown key (did you mean eval.every?)"),
        ("eval.records=0", "eval.records: must be positive, got 0"),
        ("eval.widths=[64, 256]", "eval.widths[1]: must lie in [1, trainer.hidden = 128], got 256"),
        ("eval.widths=[64, 64]", "eval.widths[1]: 64 is named twice"),
        ("eval.batch=1.5", "eval.batch: expected an int, got 1.5"),
        ("eval=3", "eval: expected a table ([eval]), got 3"),
        ("data.trian='x'", "data.trian: unknown key (did you mean data.train?)"),
        ("data.train=[]", "data.train: an empty list names no records"),
        ("data.train=3", "data.train: expected a string or an array of strings, got 3"),
        ("data.held_out=['a', 3]", "data.held_out[1]: expected a string, got 3"),
        ("data.fields=3", "data.fields: expected a table"),
        ("data.fields.jpg=1", "data.fields.jpg: expected a string, got 1"),
    ],
)
def test_a_bad_key_or_value_names_its_key_path_and_the_rule(override: str, message: str) -> None:
    assert error(TEXT, [override]).startswith(message)


def test_the_same_errors_come_from_the_file_itself() -> None:
    assert error(TEXT.replace("[trainer.schedule]", "[trainer.scheduel]")).startswith(
        "trainer.scheduel: unknown key (did you mean trainer.schedule?)"
    )
    assert error(TEXT.replace("patch_side = 16", 'patch_side = "x"')).startswith(
        "trainer.batch.image.patch_side: expected an int, got 'x'"
    )
    assert error(TEXT.replace('objective = "joint"', 'objective = "jiont"')).startswith(
        "trainer.objective: unknown word 'jiont'"
    )
    assert error("[data]\ntrain = 'x'\n").startswith("trainer: missing")
    assert error("[trainer\n").startswith("config: not valid TOML")
    no_data = TEXT.split("[data]")[0]
    assert load_run_config(no_data + "[data]\ntrain = 'a'\n").data == DataConfig(train=("a",))
    assert error(no_data + "[data]\nfields = { jpg = 'image' }\n").startswith("data.train: missing")
    assert load_run_config(no_data).data is None


def test_overrides_lay_values_over_the_file() -> None:
    run = load_run_config(
        TEXT,
        [
            "trainer.schedule.steps=500",
            "trainer.objective=contrastive",  # a bare word: a string
            "trainer.contrastive.matryoshka_dimensions=[128]",
            "trainer.batch.video.patch_side = 8",  # a table the file lacks, created
            "data.train=['a/{0..3}.tar', 'b.jsonl']",
            "trainer.schedule.learning_rate=2e-4",
        ],
    )
    assert run.trainer.schedule.steps == 500 and run.trainer.schedule.learning_rate == 2e-4
    assert run.trainer.objective == Objective.Contrastive
    assert run.trainer.contrastive.matryoshka_dimensions == (128,)
    assert run.trainer.batch.video.patch_side == 8
    assert run.data is not None and run.data.train == ("a/{0..3}.tar", "b.jsonl")


def test_a_malformed_override_is_refused_and_the_table_is_not_changed() -> None:
    table = tomllib.loads(TEXT)
    before = repr(table)
    for bad, message in [
        ("trainer.schedule.steps", "--set trainer.schedule.steps: expected KEY=VALUE"),
        ("trainer..steps=3", "--set trainer..steps=3: 'trainer..steps' is not a dotted path"),
        ("trainer.depth.x=3", "trainer.depth: not a table, so trainer.depth.x cannot be set"),
    ]:
        with pytest.raises(RunConfigError, match="^" + message.replace("[", r"\[").replace(".", r"\.")):
            apply_overrides(table, [bad])
    with pytest.raises(TypeError, match="overrides: expected a sequence"):
        apply_overrides(table, "trainer.seed=1")  # type: ignore[arg-type]
    over = apply_overrides(table, ["trainer.schedule.steps=9"])
    assert over["trainer"]["schedule"]["steps"] == 9
    assert repr(table) == before  # the parsed file itself is left as it was


def test_dump_reads_back_to_an_equal_config() -> None:
    run = load_run_config(TEXT)
    written = dump_run_config(run)
    assert load_run_config(written) == run
    assert dump_run_config(load_run_config(written)) == written
    plain = load_run_config(
        TEXT.split("[data]")[0].replace('init_from = "runs/base/checkpoints/step-00000100.safetensors"', "")
    )
    assert load_run_config(dump_run_config(plain)) == plain and "init_from" not in dump_run_config(plain)


def test_the_log_and_checkpoint_tables_read_by_key_and_round_trip() -> None:
    from uform.run_config import CheckpointConfig, LogConfig

    run = load_run_config(
        TEXT
        + '[log]\nevery = 50\ntensorboard = false\n[checkpoint]\nevery = 100\nkeep_last = 3\nbest = "eval/text->image/recall@10"\n'
    )
    assert run.log == LogConfig(every=50, tensorboard=False)
    assert run.checkpoint == CheckpointConfig(every=100, keep_last=3, best="eval/text->image/recall@10", mode="max")
    written = dump_run_config(run)
    assert load_run_config(written) == run and dump_run_config(load_run_config(written)) == written
    assert 'best = "eval/text->image/recall@10"' in written and 'mode = "max"' in written
    plain = load_run_config(TEXT)  # the defaults: the console every 25 steps, TensorBoard when installed, a save a call
    assert plain.log == LogConfig() and plain.log.tensorboard is None and plain.checkpoint == CheckpointConfig()
    assert load_run_config(dump_run_config(plain)) == plain and "tensorboard" not in dump_run_config(plain)
    assert CheckpointConfig(best="eval/held_out/masked_loss").mode == "min"
    assert CheckpointConfig(best="eval/choices/kl", mode="max").mode == "max"  # stated wins over the name
    with pytest.raises(TypeError, match="log: expected a LogConfig"):
        RunConfig(trainer=run.trainer, log={"every": 5})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LogConfig(5)  # type: ignore[misc]  # keyword-only: a table's keys, not positions


def test_the_eval_table_reads_checks_and_round_trips() -> None:
    run = load_run_config(TEXT, ["eval.every=25", "eval.widths=[64]", "eval.records=16"])
    assert run.eval == EvalConfig(every=25, records=16, widths=(64,), batch=0)
    written = dump_run_config(run)
    assert "[eval]" in written and load_run_config(written) == run
    plain = load_run_config(TEXT)  # no [eval]: its defaults, written out beside the held-out data
    assert plain.eval == EvalConfig() and load_run_config(dump_run_config(plain)) == plain
    assert check_eval(plain.eval, plain.trainer).widths == (64, 128)  # derived: the Matryoshka widths and hidden
    assert check_eval(run.eval, run.trainer) == run.eval
    with pytest.raises(RunConfigError, match=r"^eval\.every: expected an int"):
        check_eval(EvalConfig(every="3"), plain.trainer)  # type: ignore[arg-type]


def test_strings_with_quotes_and_control_characters_round_trip() -> None:
    odd = 'we"ird\\path\n\t\x7f\x01 é/{0..2}.tar'
    run = RunConfig(trainer=resolve(EXPECTED), data=DataConfig(train=(odd,), fields=(("a b", "text"),)))
    assert load_run_config(dump_run_config(run)) == run


def test_a_written_config_of_a_library_config_loads_back_equal(tmp_path: Path) -> None:
    for config in (EXPECTED, dataclasses.replace(EXPECTED, objective=Objective.Masked, seed=2**63 - 1)):
        resolved = resolve(config)
        path = tmp_path / "config.toml"
        path.write_text(dump_run_config(RunConfig(trainer=resolved)))
        assert read_run_config(path).trainer == resolved


def test_relative_paths_are_the_files_folder(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TEXT)
    run = read_run_config(tmp_path / "run.toml")
    assert run.init_from == os.path.join(tmp_path, "runs/base/checkpoints/step-00000100.safetensors")
    assert run.data is not None
    assert run.data.train == (os.path.join(tmp_path, "shards/{000..009}.tar"),)
    assert run.data.held_out == (os.path.join(tmp_path, "held/a.jsonl"), "s3://bucket/held/*.tar")
    over = read_run_config(tmp_path / "run.toml", ["trainer.init_from=here.safetensors", "data.train=['x.tar']"])
    assert over.init_from == "here.safetensors"  # a command line's path is the current folder's, as written
    assert over.data is not None and over.data.train == ("x.tar",)
    assert over.data.held_out == run.data.held_out
    (tmp_path / "bad.toml").write_bytes(b"[trainer]\nx = '\xff'\n")
    with pytest.raises(RunConfigError, match=r"bad\.toml: not UTF-8"):
        read_run_config(tmp_path / "bad.toml")
