"""The configuration structs of UForm 4's trainer API, `resolve()`'s derivations and checks, and the checkpoint dictionary."""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import json
import math

import pytest

from uform import config as C
from uform.config import (
    AudioShape,
    BatchShape,
    Choices,
    Contrastive,
    ImageShape,
    LateInteraction,
    Masking,
    Schedule,
    TrainerInitVramConfig,
    VideoShape,
    from_dict,
    resolve,
    to_dict,
    to_json,
)
from uform.enums import Negatives, Objective, PairLossForm, Scalar

# --------------------------------------------------------------------------------------------------
# The reference API's structs and their fields, in its order (docs/design.md §1; Choices is ours, read from
# TrainerInitVramConfig.choices: "read when its weight is positive").

REFERENCE_FIELDS = {
    "AudioShape": ["chunk_samples", "sample_rate"],
    "BatchShape": [
        "max_rows_per_device",
        "max_segments_per_device",
        "max_columns_per_row",
        "max_bags_per_device",
        "max_choices_per_item",
        "image",
        "video",
        "audio",
    ],
    "Contrastive": [
        "matryoshka_dimensions",
        "temperature_groups",
        "inverse_temperature",
        "bias",
        "negatives",
        "ambient_repulsion_weight",
        "max_edges_per_device",
        "pair_loss",
    ],
    "Edges": ["offsets", "ids", "weights"],
    "ImageShape": ["patch_side", "channels"],
    "LateInteraction": [
        "weight",
        "width",
        "inverse_temperature",
        "bias",
        "max_query_span",
        "max_query_tokens_per_device",
        "max_documents_per_device",
        "max_document_tokens_per_device",
        "pair_loss",
    ],
    "Masking": [
        "token_mask_probability",
        "token_mean_span",
        "replace_fraction",
        "random_fraction",
        "image_mask_ratio",
        "video_mask_ratio",
        "audio_mask_ratio",
        "text_weight",
        "image_weight",
        "video_weight",
        "audio_weight",
    ],
    "Relations": ["attract", "repel", "ignore"],
    "Schedule": ["learning_rate", "min_learning_rate", "warmup_steps", "steps"],
    "TrainerInitVramConfig": [
        "resume",
        "depth",
        "hidden",
        "batch",
        "objective",
        "masking",
        "contrastive",
        "late_interaction",
        "choices",
        "schedule",
        "mesh",
        "seed",
        "progress",
        "progress_steps",
    ],
    "TrainerSaveConfig": ["path", "progress", "progress_steps"],
    "TrainerStepConfig": [
        "bags",
        "temperature_groups",
        "sides",
        "choices",
        "choice_targets",
        "relations",
        "arena",
        "outputs_scalar",
        "stats",
    ],
    "TrainerStepStats": [
        "step",
        "learning_rate",
        "loss",
        "contrastive_loss",
        "masked_text_loss",
        "masked_image_loss",
        "masked_video_loss",
        "masked_audio_loss",
        "late_interaction_loss",
        "choices_loss",
        "truncated",
        "dropped",
    ],
    "VideoShape": ["patch_side", "tube_frames", "frame_stride", "channels"],
    "Choices": ["weight"],
}

# Enum-typed fields and the enum (whose zero member is the default) each holds.
ENUM_FIELDS = {
    ("Contrastive", "negatives"): Negatives,
    ("Contrastive", "pair_loss"): PairLossForm,
    ("LateInteraction", "pair_loss"): PairLossForm,
    ("TrainerInitVramConfig", "objective"): Objective,
    ("TrainerStepConfig", "outputs_scalar"): Scalar,
}


def _struct(name: str) -> type:
    """The struct from uform.config, or (Edges, Relations) from uform.relations where it lives."""
    kind = getattr(C, name, None)
    if kind is None:
        try:
            relations = importlib.import_module("uform.relations")
        except ImportError:
            relations = None
        kind = getattr(relations, name, None)
    if kind is None:
        pytest.skip(f"{name} is defined in neither uform.config nor uform.relations")
    return kind


def _is_zero(value) -> bool:
    """Zero, empty or None, recursively (a nested struct of zeros, a tape of empty sequences)."""
    if value is None:
        return True
    if dataclasses.is_dataclass(value):
        return all(_is_zero(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, enum.Enum):
        return value.value == 0
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value == 0
    if isinstance(value, (str, bytes)):
        return len(value) == 0
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, (tuple, list)) and _is_zero(v) for v in value)
    return False


# --------------------------------------------------------------------------------------------------
# 1. Structs: names, order, defaults, keyword-only


# Fields this implementation adds after the reference API's own, each by an issue that asks for it.
ADDED_FIELDS = {"TrainerStepStats": ["skipped", "items", "nonfinite"]}


@pytest.mark.parametrize("name", list(REFERENCE_FIELDS))
def test_struct_has_the_reference_fields_in_order(name):
    kind = _struct(name)
    assert dataclasses.is_dataclass(kind)
    assert [f.name for f in dataclasses.fields(kind)] == REFERENCE_FIELDS[name] + ADDED_FIELDS.get(name, [])


@pytest.mark.parametrize("name", list(REFERENCE_FIELDS))
def test_struct_defaults_to_zero(name):
    kind = _struct(name)
    instance = kind()
    for f in dataclasses.fields(kind):
        value = getattr(instance, f.name)
        assert _is_zero(value), f"{name}.{f.name} defaults to {value!r}"
        if f.type in ("int", int):
            assert type(value) is int, f"{name}.{f.name}"
        if f.type in ("float", float):
            assert isinstance(value, float), f"{name}.{f.name}"


@pytest.mark.parametrize(("owner", "field_name"), list(ENUM_FIELDS), ids=[f"{o}.{f}" for o, f in ENUM_FIELDS])
def test_enum_field_defaults_to_the_zero_member(owner, field_name):
    kind = ENUM_FIELDS[(owner, field_name)]
    value = getattr(_struct(owner)(), field_name)
    assert value is kind(0)


@pytest.mark.parametrize("name", list(REFERENCE_FIELDS))
def test_struct_is_keyword_only(name):
    kind = _struct(name)
    assert all(f.kw_only for f in dataclasses.fields(kind))
    with pytest.raises(TypeError):
        kind(0)


def test_nested_defaults_are_not_shared():
    a, b = TrainerInitVramConfig(), TrainerInitVramConfig()
    assert a.batch is not b.batch
    assert a.batch.image is not b.batch.image
    assert a.masking is not b.masking
    assert a.contrastive is not b.contrastive
    assert a.schedule is not b.schedule


# --------------------------------------------------------------------------------------------------
# A valid config to vary: distinct capacities so that derived products cannot coincide.

ROWS, SEGMENTS, COLUMNS, STEPS = 3, 10, 96, 1000


def make(**paths) -> TrainerInitVramConfig:
    """A valid config with `paths` set, each key a field path with `__` for the dots."""
    config = TrainerInitVramConfig(
        depth=2,
        hidden=128,
        batch=BatchShape(max_rows_per_device=ROWS, max_segments_per_device=SEGMENTS, max_columns_per_row=COLUMNS),
        schedule=Schedule(steps=STEPS),
    )
    for path, value in paths.items():
        config = _set(config, path.split("__"), value)
    return config


def _set(obj, names: list[str], value):
    head, *rest = names
    if rest:
        value = _set(getattr(obj, head), rest, value)
    return dataclasses.replace(obj, **{head: value})


def _get(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _kw(path: str) -> str:
    return path.replace(".", "__")


# --------------------------------------------------------------------------------------------------
# 2. resolve(): one case per "zero derives" rule

DERIVATIONS = [
    # (field path, value derived from zero, a nonzero value that must be kept)
    ("schedule.learning_rate", 5e-4, 3e-3),
    ("schedule.min_learning_rate", 1e-5, 2e-6),
    ("batch.image.channels", 4, 3),
    ("batch.video.channels", 3, 1),
    ("batch.video.tube_frames", 2, 4),
    ("batch.video.frame_stride", 1, 3),
    ("batch.audio.sample_rate", 16000, 24000),
    ("contrastive.max_edges_per_device", SEGMENTS, 77),
    ("contrastive.temperature_groups", 1, 5),
    ("contrastive.ambient_repulsion_weight", 1.0, 0.25),
    ("contrastive.pair_loss", PairLossForm.Sigmoid, PairLossForm.Balanced),
    ("late_interaction.width", 128, 64),
    ("late_interaction.max_query_span", 64, 32),
    ("late_interaction.max_query_tokens_per_device", 64 * SEGMENTS, 100),
    ("late_interaction.max_documents_per_device", SEGMENTS, 7),
    ("late_interaction.max_document_tokens_per_device", ROWS * COLUMNS, 50),
    ("late_interaction.inverse_temperature", 1.0, 20.0),
    ("late_interaction.bias", 0.0, -3.0),
    ("late_interaction.pair_loss", PairLossForm.Ranked, PairLossForm.Sigmoid),
    ("masking.token_mask_probability", 0.15, 0.3),
    ("masking.token_mean_span", 16.0, 4.0),
    ("masking.replace_fraction", 0.8, 0.5),
    ("masking.random_fraction", 0.1, 0.2),
    ("masking.image_mask_ratio", 0.75, 0.5),
    ("masking.video_mask_ratio", 0.75, 0.9),
    ("masking.audio_mask_ratio", 0.75, 0.6),
    ("masking.text_weight", 1.0, 0.5),
    ("masking.image_weight", 1.0, 2.0),
    ("masking.video_weight", 1.0, 3.0),
    ("masking.audio_weight", 1.0, 4.0),
    ("progress_steps", 10, 3),
]


@pytest.mark.parametrize(("path", "expected"), [pytest.param(p, d, id=p) for p, d, _ in DERIVATIONS])
def test_zero_derives(path, expected):
    resolved = resolve(make())
    value = _get(resolved, path)
    if isinstance(expected, float):
        assert value == pytest.approx(expected, rel=1e-12)
    else:
        assert value == expected
        assert type(value) is type(expected)


@pytest.mark.parametrize(("path", "value"), [pytest.param(p, v, id=p) for p, _, v in DERIVATIONS])
def test_nonzero_is_kept(path, value):
    assert _get(resolve(make(**{_kw(path): value})), path) == value


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        pytest.param(100, 10, id="a-tenth-of-100"),
        pytest.param(1000, 100, id="a-tenth-of-1000"),
        pytest.param(4000, 400, id="a-tenth-of-4000-is-the-cap"),
        pytest.param(10000, 400, id="capped-at-400"),
        pytest.param(100_000, 400, id="capped-at-400-far-out"),
    ],
)
def test_warmup_derives_a_tenth_of_steps_at_most_400(steps, expected):
    assert resolve(make(schedule__steps=steps)).schedule.warmup_steps == expected


def test_warmup_explicit_is_kept():
    resolved = resolve(make(schedule__steps=10000, schedule__warmup_steps=7))
    assert resolved.schedule.warmup_steps == 7
    resolved = resolve(make(schedule__steps=100, schedule__warmup_steps=100))
    assert resolved.schedule.warmup_steps == 100


def test_steps_is_kept():
    assert resolve(make(schedule__steps=12345)).schedule.steps == 12345


def test_late_query_tokens_follow_an_explicit_span():
    resolved = resolve(make(late_interaction__max_query_span=16))
    assert resolved.late_interaction.max_query_tokens_per_device == 16 * SEGMENTS


@pytest.mark.parametrize(
    ("form", "inverse_temperature", "bias"),
    [
        pytest.param(PairLossForm.Derived, 10.0, -10.0, id="derived-is-sigmoid-10-and-minus-10"),
        pytest.param(PairLossForm.Sigmoid, 10.0, -10.0, id="sigmoid-10-and-minus-10"),
        pytest.param(PairLossForm.Balanced, 1.0, 0.0, id="balanced-1-and-0"),
        pytest.param(PairLossForm.Ranked, 1.0, 0.0, id="ranked-1-and-0"),
    ],
)
def test_contrastive_temperature_and_bias_follow_the_pair_loss(form, inverse_temperature, bias):
    contrastive = resolve(make(contrastive__pair_loss=form)).contrastive
    assert contrastive.inverse_temperature == inverse_temperature
    assert contrastive.bias == bias


@pytest.mark.parametrize(
    "form", [PairLossForm.Sigmoid, PairLossForm.Balanced, PairLossForm.Ranked], ids=lambda f: str(f)
)
def test_contrastive_explicit_temperature_and_bias_are_kept(form):
    contrastive = resolve(
        make(contrastive__pair_loss=form, contrastive__inverse_temperature=3.0, contrastive__bias=-2.0)
    ).contrastive
    assert contrastive.inverse_temperature == 3.0
    assert contrastive.bias == -2.0
    assert contrastive.pair_loss is form


@pytest.mark.parametrize(
    "form", [PairLossForm.Sigmoid, PairLossForm.Balanced, PairLossForm.Ranked], ids=lambda f: str(f)
)
def test_late_temperature_and_bias_do_not_follow_the_pair_loss(form):
    late = resolve(make(late_interaction__pair_loss=form)).late_interaction
    assert late.inverse_temperature == 1.0
    assert late.bias == 0.0
    assert late.pair_loss is form


def test_fields_without_a_derivation_stay_zero():
    resolved = resolve(make())
    assert resolved.late_interaction.weight == 0
    assert resolved.choices.weight == 0
    assert resolved.batch.max_bags_per_device == 0
    assert resolved.batch.max_choices_per_item == 0
    assert resolved.batch.image.patch_side == 0
    assert resolved.batch.video.patch_side == 0
    assert resolved.batch.audio.chunk_samples == 0
    assert resolved.contrastive.matryoshka_dimensions == ()
    assert resolved.contrastive.negatives is Negatives.Ambient
    assert resolved.objective is Objective.Masked
    assert resolved.seed == 0


def test_enum_words_resolve_to_members():
    resolved = resolve(
        make(
            objective="joint",
            contrastive__negatives="named",
            contrastive__pair_loss="ranked",
            late_interaction__pair_loss=1,
        )
    )
    assert resolved.objective is Objective.Joint
    assert resolved.contrastive.negatives is Negatives.Named
    assert resolved.contrastive.pair_loss is PairLossForm.Ranked
    assert resolved.late_interaction.pair_loss is PairLossForm.Balanced


def full_config() -> TrainerInitVramConfig:
    """Every derivable field set nonzero: resolve() must answer it unchanged."""
    return TrainerInitVramConfig(
        depth=4,
        hidden=256,
        batch=BatchShape(
            max_rows_per_device=4,
            max_segments_per_device=16,
            max_columns_per_row=128,
            max_bags_per_device=8,
            max_choices_per_item=4,
            image=ImageShape(patch_side=16, channels=3),
            video=VideoShape(patch_side=8, tube_frames=4, frame_stride=2, channels=1),
            audio=AudioShape(chunk_samples=320, sample_rate=8000),
        ),
        objective=Objective.Joint,
        masking=Masking(
            token_mask_probability=0.2,
            token_mean_span=8.0,
            replace_fraction=0.7,
            random_fraction=0.2,
            image_mask_ratio=0.5,
            video_mask_ratio=0.6,
            audio_mask_ratio=0.4,
            text_weight=0.5,
            image_weight=0.25,
            video_weight=2.0,
            audio_weight=3.0,
        ),
        contrastive=Contrastive(
            matryoshka_dimensions=(32, 64, 256),
            temperature_groups=3,
            inverse_temperature=5.0,
            bias=-1.0,
            negatives=Negatives.Named,
            ambient_repulsion_weight=0.5,
            max_edges_per_device=40,
            pair_loss=PairLossForm.Balanced,
        ),
        late_interaction=LateInteraction(
            weight=0.3,
            width=64,
            inverse_temperature=2.0,
            bias=0.5,
            max_query_span=16,
            max_query_tokens_per_device=200,
            max_documents_per_device=12,
            max_document_tokens_per_device=300,
            pair_loss=PairLossForm.Sigmoid,
        ),
        choices=Choices(weight=0.5),
        schedule=Schedule(learning_rate=1e-3, min_learning_rate=1e-4, warmup_steps=50, steps=500),
        seed=42,
        progress_steps=4,
    )


def test_a_fully_given_config_resolves_to_itself():
    config = full_config()
    assert resolve(config) == config


RESOLVE_CASES = [
    pytest.param(make, id="minimal"),
    pytest.param(full_config, id="full"),
    pytest.param(lambda: make(contrastive__pair_loss=PairLossForm.Balanced), id="balanced"),
    pytest.param(lambda: make(schedule__steps=5), id="warmup-derives-zero"),
    pytest.param(
        lambda: make(
            objective="contrastive",
            contrastive__matryoshka_dimensions=[64, 128],
            late_interaction__weight=1.0,
            late_interaction__max_query_span=8,
        ),
        id="words-lists-and-late-interaction",
    ),
]


@pytest.mark.parametrize("factory", RESOLVE_CASES)
def test_resolve_is_pure(factory):
    config = factory()
    before = copy.deepcopy(config)
    resolved = resolve(config)
    assert config == before
    assert resolved is not config
    # The answer shares no mutable struct with its input.
    for path in (
        "batch",
        "batch.image",
        "batch.video",
        "batch.audio",
        "masking",
        "contrastive",
        "late_interaction",
        "choices",
        "schedule",
    ):
        assert _get(resolved, path) is not _get(config, path), path


@pytest.mark.parametrize("factory", RESOLVE_CASES)
def test_resolve_is_idempotent(factory):
    once = resolve(factory())
    twice = resolve(once)
    assert twice == once
    assert resolve(copy.deepcopy(twice)) == once


def test_matryoshka_widths_are_copied_not_borrowed():
    widths = [32, 64]
    resolved = resolve(make(contrastive__matryoshka_dimensions=widths))
    widths.append(128)
    assert tuple(resolved.contrastive.matryoshka_dimensions) == (32, 64)


# --------------------------------------------------------------------------------------------------
# 3. resolve(): one case per validation rule

REJECTIONS = [
    # (id, overrides, the field the message names)
    ("hidden-not-a-multiple-of-128", {"hidden": 100}, "hidden"),
    ("hidden-64", {"hidden": 64}, "hidden"),
    ("hidden-zero", {"hidden": 0}, "hidden"),
    ("hidden-negative", {"hidden": -128}, "hidden"),
    ("depth-zero", {"depth": 0}, "depth"),
    ("depth-negative", {"depth": -1}, "depth"),
    ("steps-zero", {"schedule__steps": 0}, "schedule.steps"),
    ("matryoshka-descending", {"contrastive__matryoshka_dimensions": (64, 32)}, "contrastive.matryoshka_dimensions"),
    ("matryoshka-repeated", {"contrastive__matryoshka_dimensions": (64, 64)}, "contrastive.matryoshka_dimensions"),
    (
        "matryoshka-not-multiple-of-8",
        {"contrastive__matryoshka_dimensions": (60,)},
        "contrastive.matryoshka_dimensions",
    ),
    ("matryoshka-zero-width", {"contrastive__matryoshka_dimensions": (0, 64)}, "contrastive.matryoshka_dimensions"),
    (
        "matryoshka-more-than-8",
        {"contrastive__matryoshka_dimensions": tuple(range(8, 80, 8))},
        "contrastive.matryoshka_dimensions",
    ),
    (
        "matryoshka-wider-than-hidden",
        {"contrastive__matryoshka_dimensions": (64, 256)},
        "contrastive.matryoshka_dimensions",
    ),
    ("late-width-not-multiple-of-8", {"late_interaction__width": 100}, "late_interaction.width"),
    ("late-width-negative", {"late_interaction__width": -8}, "late_interaction.width"),
    ("rows-zero", {"batch__max_rows_per_device": 0}, "batch.max_rows_per_device"),
    ("segments-zero", {"batch__max_segments_per_device": 0}, "batch.max_segments_per_device"),
    ("columns-zero", {"batch__max_columns_per_row": 0}, "batch.max_columns_per_row"),
    ("token-mask-probability-above-1", {"masking__token_mask_probability": 1.5}, "masking.token_mask_probability"),
    ("token-mask-probability-negative", {"masking__token_mask_probability": -0.1}, "masking.token_mask_probability"),
    (
        "replace-plus-random-above-1",
        {"masking__replace_fraction": 0.6, "masking__random_fraction": 0.5},
        "replace_fraction",
    ),
    ("replace-fraction-above-1", {"masking__replace_fraction": 1.2}, "masking.replace_fraction"),
    ("random-fraction-negative", {"masking__random_fraction": -0.1}, "masking.random_fraction"),
    ("image-mask-ratio-1", {"masking__image_mask_ratio": 1.0}, "masking.image_mask_ratio"),
    ("video-mask-ratio-1", {"masking__video_mask_ratio": 1.0}, "masking.video_mask_ratio"),
    ("audio-mask-ratio-1", {"masking__audio_mask_ratio": 1.0}, "masking.audio_mask_ratio"),
    ("image-mask-ratio-above-1", {"masking__image_mask_ratio": 1.5}, "masking.image_mask_ratio"),
    ("text-weight-negative", {"masking__text_weight": -1.0}, "masking.text_weight"),
    ("image-weight-negative", {"masking__image_weight": -1.0}, "masking.image_weight"),
    ("video-weight-negative", {"masking__video_weight": -1.0}, "masking.video_weight"),
    ("audio-weight-negative", {"masking__audio_weight": -1.0}, "masking.audio_weight"),
    ("late-weight-negative", {"late_interaction__weight": -1.0}, "late_interaction.weight"),
    ("choices-weight-negative", {"choices__weight": -1.0}, "choices.weight"),
    (
        "ambient-repulsion-weight-negative",
        {"contrastive__ambient_repulsion_weight": -1.0},
        "contrastive.ambient_repulsion_weight",
    ),
    ("choices-weight-without-max-choices", {"choices__weight": 1.0}, "choices.weight"),
    ("min-lr-above-derived-lr", {"schedule__min_learning_rate": 1e-3}, "schedule.min_learning_rate"),
    (
        "min-lr-above-explicit-lr",
        {"schedule__learning_rate": 1e-4, "schedule__min_learning_rate": 2e-4},
        "schedule.min_learning_rate",
    ),
    ("warmup-above-steps", {"schedule__steps": 100, "schedule__warmup_steps": 101}, "schedule.warmup_steps"),
    ("image-channels-2", {"batch__image__channels": 2}, "batch.image.channels"),
    ("image-channels-5", {"batch__image__channels": 5}, "batch.image.channels"),
    ("video-channels-2", {"batch__video__channels": 2}, "batch.video.channels"),
    ("video-channels-5", {"batch__video__channels": 5}, "batch.video.channels"),
    ("nan-mask-probability", {"masking__token_mask_probability": math.nan}, "masking.token_mask_probability"),
    ("infinite-learning-rate", {"schedule__learning_rate": math.inf}, "schedule.learning_rate"),
    ("unknown-objective-word", {"objective": "both"}, "objective"),
    ("unknown-negatives-word", {"contrastive__negatives": "hard"}, "contrastive.negatives"),
    ("pair-loss-out-of-range", {"contrastive__pair_loss": 9}, "contrastive.pair_loss"),
    # Issue 10 (8): an int past int64 is a ValueError naming its field, never an OverflowError later.
    ("temperature-groups-2-63", {"contrastive__temperature_groups": 2**63}, "contrastive.temperature_groups"),
    ("depth-2-63", {"depth": 2**63}, "depth"),
    ("edges-2-64", {"contrastive__max_edges_per_device": 2**64}, "contrastive.max_edges_per_device"),
    ("rows-below-int64", {"batch__max_rows_per_device": -(2**63) - 1}, "batch.max_rows_per_device"),
    (  # a product the derivation block forms (span x segments) past int64
        "derived-query-tokens-past-int64",
        {"late_interaction__max_query_span": 2**62},
        "late_interaction.max_query_tokens_per_device",
    ),
]


@pytest.mark.parametrize(("overrides", "field_name"), [pytest.param(o, f, id=i) for i, o, f in REJECTIONS])
def test_rejected(overrides, field_name):
    config = make(**overrides)
    before = copy.deepcopy(config)
    with pytest.raises(ValueError) as caught:
        resolve(config)
    assert field_name in str(caught.value)
    assert config == before


def test_choices_weight_with_max_choices_is_accepted():
    resolved = resolve(make(choices__weight=1.0, batch__max_choices_per_item=4))
    assert resolved.choices.weight == 1.0


def test_rejected_max_choices_message_names_the_batch_field():
    with pytest.raises(ValueError, match="max_choices_per_item"):
        resolve(make(choices__weight=1.0))


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_legal_channels_are_accepted(channels):
    resolved = resolve(make(batch__image__channels=channels, batch__video__channels=channels))
    assert resolved.batch.image.channels == channels
    assert resolved.batch.video.channels == channels


def test_boundaries_that_are_accepted():
    resolved = resolve(
        make(
            hidden=384,
            masking__token_mask_probability=1.0,
            masking__replace_fraction=0.9,
            masking__random_fraction=0.1,
            contrastive__matryoshka_dimensions=tuple(range(8, 72, 8)),
            schedule__learning_rate=1e-4,
            schedule__min_learning_rate=1e-4,
        )
    )
    assert len(resolved.contrastive.matryoshka_dimensions) == 8
    assert resolved.masking.token_mask_probability == 1.0
    assert resolved.schedule.min_learning_rate == resolved.schedule.learning_rate
    # The widest prefix may be the full width.
    assert resolve(make(contrastive__matryoshka_dimensions=(64, 128))).contrastive.matryoshka_dimensions == (64, 128)


WRONG_TYPES = [
    ("float-depth", {"depth": 2.0}, "depth"),
    ("bool-hidden", {"hidden": True}, "hidden"),
    ("string-steps", {"schedule__steps": "100"}, "schedule.steps"),
    ("string-rows", {"batch__max_rows_per_device": "3"}, "batch.max_rows_per_device"),
    ("float-channels", {"batch__image__channels": 4.0}, "batch.image.channels"),
    ("string-seed", {"seed": "42"}, "seed"),
    ("none-progress-steps", {"progress_steps": None}, "progress_steps"),
    ("string-learning-rate", {"schedule__learning_rate": "fast"}, "schedule.learning_rate"),
    ("bool-text-weight", {"masking__text_weight": True}, "masking.text_weight"),
    ("none-bias", {"contrastive__bias": None}, "contrastive.bias"),
    ("float-objective", {"objective": 1.5}, "objective"),
    ("bool-negatives", {"contrastive__negatives": True}, "contrastive.negatives"),
    ("none-late-pair-loss", {"late_interaction__pair_loss": None}, "late_interaction.pair_loss"),
    ("float-matryoshka-width", {"contrastive__matryoshka_dimensions": (64.0,)}, "contrastive.matryoshka_dimensions"),
    ("string-matryoshka-width", {"contrastive__matryoshka_dimensions": ("64",)}, "contrastive.matryoshka_dimensions"),
    ("string-matryoshka", {"contrastive__matryoshka_dimensions": "64"}, "contrastive.matryoshka_dimensions"),
    ("int-matryoshka", {"contrastive__matryoshka_dimensions": 64}, "contrastive.matryoshka_dimensions"),
    ("dict-batch", {"batch": {"max_rows_per_device": 3}}, "batch"),
    ("wrong-image-struct", {"batch__image": VideoShape()}, "batch.image"),
    ("int-progress", {"progress": 5}, "progress"),  # issue 10 (8): refused here, not when first reported
]


@pytest.mark.parametrize(("overrides", "field_name"), [pytest.param(o, f, id=i) for i, o, f in WRONG_TYPES])
def test_wrong_type(overrides, field_name):
    config = make(**overrides)
    before = copy.deepcopy(config)
    with pytest.raises(TypeError) as caught:
        resolve(config)
    assert field_name in str(caught.value)
    assert config == before


def test_resolve_refuses_what_is_not_a_config():
    with pytest.raises(TypeError, match="config"):
        resolve({"depth": 2})


# --------------------------------------------------------------------------------------------------
# 4. The checkpoint dictionary


def _round_trip_config() -> TrainerInitVramConfig:
    return resolve(
        make(
            objective=Objective.Joint,
            contrastive__matryoshka_dimensions=[32, 64, 128],
            contrastive__negatives=Negatives.Named,
            contrastive__pair_loss=PairLossForm.Balanced,
            late_interaction__weight=0.5,
            late_interaction__pair_loss=PairLossForm.Sigmoid,
            batch__image__patch_side=16,
            batch__video__patch_side=8,
            batch__audio__chunk_samples=320,
            seed=7,
        )
    )


def test_to_dict_from_dict_round_trips_a_resolved_config():
    resolved = _round_trip_config()
    data = to_dict(resolved)
    assert from_dict(data) == resolved
    assert resolve(from_dict(data)) == resolved


def test_to_dict_round_trips_through_json():
    resolved = _round_trip_config()
    assert from_dict(json.loads(to_json(resolved))) == resolved
    assert from_dict(json.loads(json.dumps(to_dict(resolved)))) == resolved


def test_to_dict_holds_plain_values():
    data = to_dict(_round_trip_config())
    assert data["objective"] == "joint"
    assert data["contrastive"]["negatives"] == "named"
    assert data["contrastive"]["pair_loss"] == "balanced"
    assert data["late_interaction"]["pair_loss"] == "sigmoid"
    assert data["contrastive"]["matryoshka_dimensions"] == [32, 64, 128]
    assert data["batch"]["image"] == {"patch_side": 16, "channels": 4}
    # The resume path, the mesh and the callback are not part of a checkpoint's config.
    for skipped in ("resume", "mesh", "progress"):
        assert skipped not in data
    # Nothing in it is an enum member or a struct: it is JSON as it stands.
    assert json.loads(json.dumps(data)) == data


def test_from_dict_restores_enum_members():
    restored = from_dict(to_dict(_round_trip_config()))
    assert restored.objective is Objective.Joint
    assert restored.contrastive.negatives is Negatives.Named
    assert restored.contrastive.pair_loss is PairLossForm.Balanced
    assert restored.late_interaction.pair_loss is PairLossForm.Sigmoid
    assert isinstance(restored.batch.image, ImageShape)
    assert tuple(restored.contrastive.matryoshka_dimensions) == (32, 64, 128)


@pytest.mark.parametrize(
    ("where", "key"),
    [
        pytest.param((), "colour", id="top-level"),
        pytest.param(("batch",), "max_rows", id="batch"),
        pytest.param(("batch", "image"), "colour_space", id="batch.image"),
        pytest.param(("contrastive",), "temperature", id="contrastive"),
        pytest.param(("schedule",), "epochs", id="schedule"),
    ],
)
def test_from_dict_refuses_an_unknown_key_naming_it(where, key):
    data = to_dict(_round_trip_config())
    node = data
    for name in where:
        node = node[name]
    node[key] = 1
    with pytest.raises(ValueError, match=key):
        from_dict(data)


def test_from_dict_refuses_an_unknown_enum_word():
    data = to_dict(_round_trip_config())
    data["objective"] = "both"
    with pytest.raises(ValueError, match="objective"):
        from_dict(data)
