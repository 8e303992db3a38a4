"""Refused calls name their field and the rule, and change nothing (issue 10, item 8): per-item sequences
that are no sequence or hold values past int64, text that is no valid Unicode, a closed trainer, the edges
limit a user never set; and the step past the schedule, which runs but is said once and counted."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    SEGMENTS,
    TEXTS,
    assert_refusal_changes_nothing,
    make_config,
    pair_relations,
    step_with,
    two_good_steps,
)

from uform import (
    Arena,
    BatchShape,
    Choices,
    Edges,
    Executor,
    Relations,
    Schedule,
    ScheduleWarning,
    Trainer,
    TrainerSaveConfig,
    TrainerStepConfig,
    TrainerStepStats,
)

MODS = ["text"] * len(TEXTS)
DATA = np.frombuffer("".join(TEXTS).encode(), np.uint8)
FALLING = np.cumsum([0, *(len(t) for t in TEXTS)]).astype(np.uint64)[[0, 2, 1, 3, 4, 5, 6]]
SURROGATE = "a lone \ud800 surrogate"


def _good_step(trainer: Trainer) -> tuple[TrainerStepStats, torch.Tensor]:
    stats = TrainerStepStats()
    config = TrainerStepConfig(relations=pair_relations(3), stats=stats, arena=Arena())
    return stats, trainer.on(trainer.executor).step(MODS, TEXTS, config)


@pytest.fixture(scope="module")
def reference(executor: Executor):
    trainer = Trainer.init_vram(executor, make_config())
    try:
        yield two_good_steps(trainer, _good_step)
    finally:
        trainer.close()


def _with(**fields: Any) -> TrainerStepConfig:
    return TrainerStepConfig(relations=pair_relations(3), **fields)


# (id, contents, step config, error, words the message must hold: the field and the rule)
BAD_CALLS = [
    ("bags an int", TEXTS, _with(bags=5), TypeError, "bags: expected a sequence"),
    ("groups an int", TEXTS, _with(temperature_groups=5), TypeError, "temperature_groups: expected a sequence"),
    ("sides an int", TEXTS, _with(sides=5), TypeError, "sides: expected a sequence"),
    ("bags a generator", TEXTS, _with(bags=(i for i in range(6))), TypeError, "bags: expected a sequence"),
    ("bag 2^63", TEXTS, _with(bags=[0, 1, 2, 3, 4, 2**63]), ValueError, "bags[5]: must lie below"),
    ("bag 2^64", TEXTS, _with(bags=[2**64] * 6), ValueError, "bags[0]: must lie below"),
    ("bag below int64", TEXTS, _with(bags=[-(2**63) - 1] * 6), ValueError, "bags[0]: must not be negative"),
    ("group 2^63", TEXTS, _with(temperature_groups=[0] * 5 + [2**63]), ValueError, "temperature_groups[5]: must lie below"),
    ("group 2^70", TEXTS, _with(temperature_groups=[2**70] * 6), ValueError, "temperature_groups[0]: must lie below"),
    ("surrogate text", [*TEXTS[:2], SURROGATE, *TEXTS[3:]], _with(), ValueError, "contents[2]: not valid Unicode"),
    # Found by the fuzz campaign: falling uint64 offsets, whose differences wrap round to large positives,
    # passed as non-decreasing and cut the items wrong.
    ("falling uint64 tape", (DATA, FALLING), _with(), ValueError, "contents: a tape's offsets must be non-decreasing"),
]  # fmt: skip


@pytest.mark.parametrize("verb", ["on", "deferred"])
@pytest.mark.parametrize(("contents", "config", "error", "words"), [pytest.param(*c[1:], id=c[0]) for c in BAD_CALLS])
def test_a_refused_call_names_its_field_and_changes_nothing(
    make_trainer, reference, verb: str, contents: Any, config: TrainerStepConfig, error: type, words: str
) -> None:
    assert_refusal_changes_nothing(make_trainer(), reference, _good_step, verb, MODS, contents, config, error, words)


def test_a_surrogate_among_choices_is_refused_by_name(make_trainer) -> None:
    trainer = make_trainer(batch=BatchShape(max_rows_per_device=2, max_segments_per_device=SEGMENTS,
                                            max_columns_per_row=64, max_choices_per_item=4),
                           choices=Choices(weight=1.0))  # fmt: skip
    choices = ["ab", "\udfff", "", "", "", ""]
    targets = [[0.5, 0.5], [1.0], [], [], [], []]
    with pytest.raises(ValueError, match=r"choices\[1\]: not valid Unicode"):
        step_with(trainer, choices=choices, choice_targets=targets)
    assert trainer.steps_taken == 0


@pytest.mark.parametrize("verb", ["on", "deferred"])
def test_a_closed_trainer_says_so(make_trainer, tmp_path, verb: str) -> None:
    trainer = make_trainer()
    receiver = getattr(trainer, verb)(trainer.executor)
    trainer.close()
    with pytest.raises(ValueError, match="trainer: this trainer was closed"):
        receiver.step(MODS, TEXTS, _with())
    with pytest.raises(ValueError, match="trainer: this trainer was closed"):
        receiver.save(tmp_path / "never.safetensors")
    with pytest.raises(ValueError, match="trainer: this trainer was closed"):
        trainer.step(MODS, TEXTS, _with())
    assert not (tmp_path / "never.safetensors").exists()


def _too_many_edges(count: int) -> Relations:
    """Item 0 attracts every other item: count - 1 edges."""
    return Relations(attract=Edges(offsets=[0] + [count - 1] * count, ids=list(range(1, count))))


def test_the_edges_limit_left_to_derive_names_max_segments(make_trainer) -> None:
    trainer = make_trainer(batch=BatchShape(max_rows_per_device=2, max_segments_per_device=4, max_columns_per_row=64))
    texts = TEXTS[:6]
    with pytest.raises(ValueError) as caught:
        step_with(trainer, texts, relations=_too_many_edges(6))
    message = str(caught.value)
    assert "relations.attract.ids: names 5 edges" in message
    assert "derives from batch.max_segments_per_device" in message, message


def test_an_edges_limit_that_was_set_names_only_itself(make_trainer) -> None:
    from uform import Contrastive

    trainer = make_trainer(contrastive=Contrastive(max_edges_per_device=3))
    with pytest.raises(ValueError) as caught:
        step_with(trainer, TEXTS, relations=_too_many_edges(6))
    message = str(caught.value)
    assert "more than contrastive.max_edges_per_device (3)" in message
    assert "max_segments_per_device" not in message


def test_a_step_past_the_schedule_warns_once_and_is_counted(make_trainer) -> None:
    trainer = make_trainer(schedule=Schedule(steps=2, warmup_steps=1, learning_rate=1e-3, min_learning_rate=1e-4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rates = [step_with(trainer)[0].learning_rate for _ in range(2)]  # type: ignore[union-attr]
        assert not [w for w in caught if issubclass(w.category, ScheduleWarning)]
        rates += [step_with(trainer)[0].learning_rate for _ in range(3)]  # type: ignore[union-attr]
    shown = [w for w in caught if issubclass(w.category, ScheduleWarning)]
    assert len(shown) == 1, [str(w.message) for w in shown]
    message = str(shown[0].message)
    assert "step 3 is past schedule.steps (2)" in message and "schedule.min_learning_rate" in message
    assert trainer.notices.count("schedule") == 3
    assert rates[2:] == [1e-4] * 3  # it still runs, at the floor, as the schedule says


def _choice_trainer(make_trainer) -> Trainer:
    return make_trainer(batch=BatchShape(max_rows_per_device=2, max_segments_per_device=SEGMENTS,
                                         max_columns_per_row=64, max_choices_per_item=4),
                        choices=Choices(weight=1.0))  # fmt: skip


def test_falling_uint64_choice_offsets_are_refused(make_trainer) -> None:
    trainer = _choice_trainer(make_trainer)
    offsets = np.array([0, 2, 1, 3, 3, 3, 3], np.uint64)  # 2 then 1: a uint64 difference wraps round
    choices = (np.frombuffer(b"abc", np.uint8), offsets)
    targets = (np.array([0.5, 0.5, 1.0], np.float32), offsets.copy())
    with pytest.raises(ValueError, match="choices: a tape's offsets must be non-decreasing"):
        step_with(trainer, choices=choices, choice_targets=targets)
    assert trainer.steps_taken == 0


def test_a_target_past_the_float_range_is_refused_by_name(make_trainer) -> None:
    trainer = _choice_trainer(make_trainer)
    choices = [b"ab", b"", b"", b"", b"", b""]
    with pytest.raises(ValueError, match=r"choice_targets\[0\]: a target probability is past the float range"):
        step_with(trainer, choices=choices, choice_targets=[[10**400, 0], [], [], [], [], []])
    assert trainer.steps_taken == 0


def test_numpy_integers_name_modalities_and_sides(make_trainer) -> None:
    """An enum field takes its integer value as a numpy integer too (a side read from an array, say), as
    bags and temperature groups do; the fuzz campaign found them refused."""
    trainer, twin = make_trainer(), make_trainer()
    sides = np.array([1, 2, 0, 1, 2, 3])
    step_with(trainer, sides=sides)
    trainer.on(trainer.executor).step(np.zeros(6, np.int64), TEXTS, _with(sides=sides, stats=TrainerStepStats()))
    step_with(twin, sides=sides.tolist())
    twin.on(twin.executor).step([0] * 6, TEXTS, _with(sides=sides.tolist(), stats=TrainerStepStats()))
    from conftest import assert_same, snapshot

    assert_same(snapshot(trainer), snapshot(twin))


@pytest.mark.parametrize(
    ("config", "error", "words"),
    [
        (TrainerSaveConfig(path="x.safetensors", progress_steps="3"), TypeError, "progress_steps: expected an int"),
        (TrainerSaveConfig(path="x.safetensors", progress=5), TypeError, "progress: expected None or a callable"),
        ("a\0b.safetensors", ValueError, "path: 'a\\x00b.safetensors' holds a NUL byte"),
        ("\ud800.safetensors", ValueError, "path: '\\ud800.safetensors' has no file-system encoding"),
    ],
)
def test_a_refused_save_names_its_field(make_trainer, tmp_path, monkeypatch, config, error, words) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer()
    for verb in ("on", "deferred"):
        with pytest.raises(error) as caught:
            getattr(trainer, verb)(trainer.executor).save(config)
        assert words in str(caught.value)
    assert list(tmp_path.iterdir()) == []
