"""`Trainer.init_vram(init_from=...)`: a new run from another run's tower (issue 13, item 6)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from uform import (
    BatchShape,
    Executor,
    ImageShape,
    Objective,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    TrainerStepStats,
)
from uform.replica.checkpoint import CheckpointError

TEXTS = ["a cat on a mat", "a dog in the fog", "rain on the roof", "a boat at sea"]


def source_config(**overrides: object) -> TrainerInitVramConfig:
    fields: dict[str, object] = dict(
        depth=1,
        hidden=128,
        objective=Objective.Masked,
        batch=BatchShape(max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=32),
        schedule=Schedule(steps=10, learning_rate=1e-2),
        seed=1,
    )
    fields.update(overrides)
    return TrainerInitVramConfig(**fields)  # type: ignore[arg-type]


def new_config(**overrides: object) -> TrainerInitVramConfig:
    """Another run over the same tower: another seed, objective, schedule and an image input the source lacks."""
    batch = BatchShape(
        max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=32, image=ImageShape(patch_side=16)
    )
    fields: dict[str, object] = dict(objective=Objective.Joint, batch=batch, schedule=Schedule(steps=50), seed=2)
    fields.update(overrides)
    return source_config(**fields)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A masked run after two steps, saved: its checkpoint and its weights."""
    path = tmp_path_factory.mktemp("init_from") / "source.safetensors"
    trainer = Trainer.init_vram(Executor.cpu(), source_config())
    for _ in range(2):
        trainer.step(["text"] * len(TEXTS), TEXTS, TrainerStepConfig())
    trainer.save(path)
    weights = trainer.weights().tensors
    trainer.close()
    return path, weights


def test_a_new_run_starts_from_the_other_runs_tower(source: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, theirs = source
    trainer = Trainer.init_vram(Executor.cpu(), new_config(), init_from=path)
    alone = Trainer.init_vram(Executor.cpu(), new_config())  # the same run from its seed alone
    ours, seeded = trainer.network.state_dict(), alone.network.state_dict()
    plan = trainer.init_from
    assert plan is not None and plan.source_step == 2
    tower = [name for name in ours if name.startswith("tower.")]
    assert tower and set(tower) <= set(plan.taken)
    for name in plan.taken:
        assert torch.equal(ours[name], theirs[name]), name  # bitwise: the other run's weights
    assert "embed.weight" in plan.taken or any(n.startswith("embed.") for n in plan.taken)
    # The image input and head the source never had, and the temperatures this run's config states: fresh.
    assert any(n.startswith("media.image.") for n in plan.fresh)
    assert any(n.startswith("temperatures.") for n in plan.fresh)
    for name in plan.fresh:
        assert torch.equal(ours[name], seeded[name]), name
    assert set(plan.taken) | set(plan.fresh) == set(ours) and not set(plan.taken) & set(plan.fresh)
    assert "init_from" in plan.summary() and "tower" in plan.summary()
    # A new run: step one of its own schedule, a fresh optimizer.
    assert trainer.steps_taken == 0 and not trainer.optimizer.state
    stats, reference = TrainerStepStats(), TrainerStepStats()
    trainer.step(["text"] * len(TEXTS), TEXTS, TrainerStepConfig(stats=stats, relations=None))
    alone.step(["text"] * len(TEXTS), TEXTS, TrainerStepConfig(stats=reference, relations=None))
    assert stats.step == 1 and stats.learning_rate == reference.learning_rate
    trainer.close()
    alone.close()


def test_another_depth_or_hidden_is_refused(source: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = source
    for config in (new_config(depth=2), new_config(hidden=256)):
        with pytest.raises(ValueError, match=r"init_from: .* depth 1 and hidden 128; this run builds depth"):
            Trainer.init_vram(Executor.cpu(), config, init_from=path)


def test_a_file_that_is_not_a_uform_checkpoint_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.safetensors"
    save_file({"tower.blocks.0.weight": torch.zeros(4, 4)}, str(foreign), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="not a uform"):
        Trainer.init_vram(Executor.cpu(), new_config(), init_from=foreign)
    text = tmp_path / "notes.safetensors"
    text.write_text("not a checkpoint at all")
    with pytest.raises(CheckpointError):
        Trainer.init_vram(Executor.cpu(), new_config(), init_from=text)
    with pytest.raises(TypeError, match="init_from: expected a path"):
        Trainer.init_vram(Executor.cpu(), new_config(), init_from=3)  # type: ignore[arg-type]


def test_init_from_and_resume_together_are_refused(source: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = source
    with pytest.raises(ValueError, match=r"init_from: .*resume continues a run; give one"):
        Trainer.init_vram(Executor.cpu(), source_config(resume=str(path)), init_from=path)


def test_workers_start_from_the_other_runs_tower(source: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, theirs = source
    two = Executor.cpu(workers=2)
    try:
        trainer = Trainer.init_vram(two, new_config(), init_from=path)
        plan = trainer.init_from
        assert plan is not None
        ours = trainer.weights().tensors
        for name in plan.taken:
            assert torch.equal(ours[name], theirs[name]), name
        alone = Trainer.init_vram(Executor.cpu(), new_config(), init_from=path)
        same = alone.network.state_dict()
        assert all(torch.equal(ours[name], same[name]) for name in ours)  # one device or two: the same start
        alone.close()
        trainer.close()
    finally:
        two.close()


def test_the_plan_takes_matching_heads_and_leaves_the_rest(source: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = source
    wider = dataclasses.replace(
        new_config(), late_interaction=dataclasses.replace(new_config().late_interaction, weight=0.5)
    )
    trainer = Trainer.init_vram(Executor.cpu(), wider, init_from=path)
    plan = trainer.init_from
    assert plan is not None
    assert any(n.startswith("token_head.") for n in plan.fresh)  # a head the source never trained
    assert any(n.startswith("text_head.") for n in plan.taken)  # the masked text head both runs have
    trainer.close()
