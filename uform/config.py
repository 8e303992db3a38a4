"""The configuration structs of UForm 4's trainer API, field by field, and the one place their zeros are
derived.

Every struct is a keyword-only dataclass whose fields keep the reference API's names and order and default to
zero / empty / None, as the C structs they mirror. `resolve()` is the single, pure function that turns
a user's config into the one a run uses: it applies every "zero derives" rule (in the visible derivation
block below, one line per rule) and then checks every rule of a run, raising `ValueError` naming the
field. The resolved config is what a checkpoint stores (docs/design.md §1).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .enums import LateInteractionSide, Negatives, Objective, PairLossForm, Scalar

ProgressCallback = Callable[[int, int], "bool | None"]
"""Called as `progress(done, total)`; answering `False` stops the call (`None` or `True` go on)."""

HEAD_DIM = 64
"""Attention head width: a tower of `hidden` has `hidden // 64` heads."""


# --------------------------------------------------------------------------------------------------
# Batch geometry


@dataclass(kw_only=True)
class ImageShape:
    """The image slice of a batch envelope; a zero patch_side leaves images out of the run."""

    patch_side: int = 0
    """The square patch side images tile into, in pixels."""
    channels: int = 0
    """Channels every pixel carries; zero derives four, RGBA end to end."""


@dataclass(kw_only=True)
class VideoShape:
    """The video slice of a batch envelope; a zero patch_side leaves video out of the run."""

    patch_side: int = 0
    """The square patch side one tube tiles into, in pixels."""
    tube_frames: int = 0
    """Frames one tube folds ahead of its patch; zero derives two."""
    frame_stride: int = 0
    """Source frames between sampled ones; zero derives one, every frame."""
    channels: int = 0
    """Channels every pixel carries; zero derives three."""


@dataclass(kw_only=True)
class AudioShape:
    """The audio slice of a batch envelope; a zero chunk_samples leaves audio out of the run."""

    chunk_samples: int = 0
    """Raw samples per frame, the fan-in of the learned frontend."""
    sample_rate: int = 0
    """The mono rate every recording is resampled to; zero derives 16000."""


@dataclass(kw_only=True)
class BatchShape:
    """What one device's step carries at most, whatever the modality mix: capacity fixed at creation."""

    max_rows_per_device: int = 0
    """Rows one device's step packs."""
    max_segments_per_device: int = 0
    """Items one device's step carries across all its rows, which is also its pooling axis."""
    max_columns_per_row: int = 0
    """Positions one row spans, the sequence length."""
    max_bags_per_device: int = 0
    """Bags one device's step carries; zero keeps every item its own routing unit."""
    max_choices_per_item: int = 0
    """Legal bytes one item offers to choose from at most; zero makes no choices."""
    image: ImageShape = field(default_factory=ImageShape)
    """The image geometry."""
    video: VideoShape = field(default_factory=VideoShape)
    """The video geometry."""
    audio: AudioShape = field(default_factory=AudioShape)
    """The audio geometry."""


# --------------------------------------------------------------------------------------------------
# Objectives


@dataclass(kw_only=True)
class Masking:
    """How the masked objective corrupts a batch and weighs its heads; every zero derives a default."""

    token_mask_probability: float = 0.0
    """Fraction of text positions covered by spans; 0.15."""
    token_mean_span: float = 0.0
    """Mean geometric span length in bytes; 16."""
    replace_fraction: float = 0.0
    """Of covered positions, the share shown as MASK; 0.8."""
    random_fraction: float = 0.0
    """Of covered positions, the share replaced by a random byte, the rest kept clean; 0.1."""
    image_mask_ratio: float = 0.0
    """Fraction of image patches masked; 0.75."""
    video_mask_ratio: float = 0.0
    """Fraction of video tubes masked, tubed across time; 0.75."""
    audio_mask_ratio: float = 0.0
    """Fraction of audio frames masked; 0.75."""
    text_weight: float = 0.0
    """The weight of the text head; 1."""
    image_weight: float = 0.0
    """The weight of the image head; 1."""
    video_weight: float = 0.0
    """The weight of the video head; 1."""
    audio_weight: float = 0.0
    """The weight of the audio head; 1."""


@dataclass(kw_only=True)
class Contrastive:
    """How the contrastive loss scores the pooled embeddings; every zero derives a default."""

    matryoshka_dimensions: Sequence[int] = ()
    """Matryoshka prefix widths, strictly ascending, each a multiple of 8, at most 8 of them, every one
    scored; empty scores the full width alone. Copied, not borrowed."""
    temperature_groups: int = 0
    """Learnable inverse temperature and bias pairs, one per group a step's items select; one."""
    inverse_temperature: float = 0.0
    """The starting inverse temperature of every group; 10 under the sigmoid form, SigLIP's, else 1."""
    bias: float = 0.0
    """The starting logit bias of every group; -10 under the sigmoid form, SigLIP's, else zero."""
    negatives: Negatives = Negatives.Ambient
    """Which pairs repel."""
    ambient_repulsion_weight: float = 0.0
    """The weight of every pair no edge names, under Negatives.Ambient; 1."""
    max_edges_per_device: int = 0
    """Edges one device's step names per edge set at most; max_segments_per_device."""
    pair_loss: PairLossForm = PairLossForm.Derived
    """The pair loss over each anchor's row; sigmoid."""


@dataclass(kw_only=True)
class LateInteraction:
    """How the late-interaction loss scores per-token vectors of queries and documents."""

    weight: float = 0.0
    """The loss weight; zero trains no token head."""
    width: int = 0
    """The token vectors' width, a multiple of 8; 128."""
    inverse_temperature: float = 0.0
    """The starting inverse temperature of every contrastive group; 1."""
    bias: float = 0.0
    """The starting logit bias of every contrastive group; zero is zero."""
    max_query_span: int = 0
    """Tokens one query item contributes at most, its first past the prefix; 64."""
    max_query_tokens_per_device: int = 0
    """Query token rows one device's step holds at most; max_query_span of every item."""
    max_documents_per_device: int = 0
    """Document items one device's step holds at most; max_segments_per_device."""
    max_document_tokens_per_device: int = 0
    """Document token rows one device's step holds at most; the batch's tokens per device."""
    pair_loss: PairLossForm = PairLossForm.Derived
    """The pair loss over each query's row of hard MaxSim scores; ranked."""


@dataclass(kw_only=True)
class Choices:
    """The calibrated choices term: KL(target || softmax over an item's legal bytes) at an appended MASK."""

    weight: float = 0.0
    """The loss weight; zero trains no choices (and needs no max_choices_per_item)."""


@dataclass(kw_only=True)
class Schedule:
    """The learning-rate schedule: a linear warmup to the peak, then a cosine decay to the floor."""

    learning_rate: float = 0.0
    """The peak learning rate; zero derives 5e-4."""
    min_learning_rate: float = 0.0
    """The floor the cosine settles at; zero derives 1e-5."""
    warmup_steps: int = 0
    """Steps from zero to the peak; zero derives a tenth of steps, at most 400."""
    steps: int = 0
    """Steps the run takes across resumes, which the cosine spans; zero is refused."""


@dataclass(kw_only=True)
class TrainerInitVramConfig:
    """The geometry, objective and starting point of a run; see `Trainer.init_vram`."""

    resume: Any = None
    """The checkpoint to continue from, at its saved step; None starts from seed."""
    depth: int = 0
    """Transformer blocks stacked."""
    hidden: int = 0
    """Embedding width, a multiple of 128."""
    batch: BatchShape = field(default_factory=BatchShape)
    """What one device's step carries at most."""
    objective: Objective = Objective.Masked
    """Which losses a step relaxes."""
    masking: Masking = field(default_factory=Masking)
    """The masked objective's corruption and weights, read unless the objective is contrastive alone."""
    contrastive: Contrastive = field(default_factory=Contrastive)
    """The contrastive loss's scoring, read unless the objective is masked alone."""
    late_interaction: LateInteraction = field(default_factory=LateInteraction)
    """The late-interaction loss beside the pooled one, read when its weight is positive."""
    choices: Choices = field(default_factory=Choices)
    """The calibrated choices beside every other term, read when its weight is positive, which needs
    the batch's max_choices_per_item."""
    schedule: Schedule = field(default_factory=Schedule)
    """The learning-rate schedule."""
    mesh: Any = None
    """The mesh made over the same executor, borrowed until the trainer drops; None runs alone."""
    seed: int = 0
    """The base of every keyed draw: initialization, corruption and the shuffle."""
    progress: ProgressCallback | None = None
    """Reports the tensors placed on a resume and stops wherever it says to."""
    progress_steps: int = 0
    """Reports the call makes at most, the last at completion; zero derives to ten."""


# --------------------------------------------------------------------------------------------------
# Per-step and per-save configs


@dataclass(kw_only=True)
class TrainerStepStats:
    """What a step reports, every loss its world mean, overwritten by the call."""

    step: int = 0
    """The step number the call ran as (its place in the schedule), counted from one across resumes; the
    optimizer step it applied, unless it was skipped (`nonfinite`)."""
    learning_rate: float = 0.0
    """The learning rate it applied."""
    loss: float = 0.0
    """The total loss the step minimized."""
    contrastive_loss: float = 0.0
    """The contrastive term; zero when the objective is masked alone."""
    masked_text_loss: float = 0.0
    """The text reconstruction term, before its weight; zero when absent."""
    masked_image_loss: float = 0.0
    """The image reconstruction term, before its weight; zero when absent."""
    masked_video_loss: float = 0.0
    """The video reconstruction term, before its weight; zero when absent."""
    masked_audio_loss: float = 0.0
    """The audio reconstruction term, before its weight; zero when absent."""
    late_interaction_loss: float = 0.0
    """The late-interaction term, weighted; zero when absent."""
    choices_loss: float = 0.0
    """The choices term over the items that made a choice, before its weight; zero when absent."""
    truncated: int = 0
    """Items cut at a row's width."""
    dropped: int = 0
    """Segments dropped whole because the batch had no room for them, since the last step that read
    its stats."""
    skipped: int = 0
    """Media items skipped because they could not be decoded or broke a limit, since the last step that
    read its stats (a field this implementation adds to the reference API's)."""
    items: int = 0
    """Items the step was given, the whole world's (a field this implementation adds to the reference API's)."""
    nonfinite: int = 0
    """Steps whose update was skipped on every process because their loss or gradients were not finite
    somewhere in the world (or their learning rate would carry the update out of float32), since the last step
    that read its stats, this one included (a field this implementation adds to the reference API's). A skipped step
    keeps its number (the schedule and the draws move on) but changes no weight, moment or `steps_taken`."""


@dataclass(kw_only=True)
class TrainerStepConfig:
    """The routing, targets and reports of a step."""

    bags: Sequence[int] = ()
    """The bag of each item, items sharing a bag landing on one device; empty keeps every item its own bag."""
    temperature_groups: Sequence[int] = ()
    """The temperature group of each item, each below the run's temperature_groups; empty puts every
    item in group zero."""
    sides: Sequence[LateInteractionSide | int | str] = ()
    """The late-interaction side of each item; empty makes every item LateInteractionSide.None_."""
    choices: Any = ((), ())
    """Each item's legal choices, one byte each, as a (data, offsets) tape; empty offsets make no choices."""
    choice_targets: Any = ((), ())
    """The target probability of each choice, a (data, offsets) tape shaped like `choices`."""
    relations: Any = None
    """The contrastive targets (a `Relations`), read unless the objective is masked alone."""
    arena: Any = None
    """The `Arena` the pooled embeddings land in, as the contrastive loss scored them before the update;
    None skips the copy, and the step answers no rows."""
    outputs_scalar: Scalar = Scalar.F32
    """The scalar type the embeddings land as, read only with an arena."""
    stats: TrainerStepStats | None = None
    """Where the losses land, overwritten by the call; None skips their readback too."""


@dataclass(kw_only=True)
class TrainerSaveConfig:
    """The path a checkpoint is written to and the handler counting its tensors."""

    path: Any = None
    """Destination of the safetensors checkpoint, written whole and renamed into place."""
    progress: ProgressCallback | None = None
    """Reports the tensors written and stops wherever it says to."""
    progress_steps: int = 0
    """Reports the call makes at most, the last at completion; zero derives to ten."""


# --------------------------------------------------------------------------------------------------
# resolve(): every "zero derives" rule, then every rule of a run


def _or(value: Any, default: Any) -> Any:
    return value if value else default


def derived_pooled_form(form: PairLossForm) -> PairLossForm:
    """`Derived` under the pooled contrastive term is SigLIP's sigmoid form."""
    return PairLossForm.Sigmoid if form == PairLossForm.Derived else PairLossForm(form)


def derived_token_form(form: PairLossForm) -> PairLossForm:
    """`Derived` under the late-interaction term is the ranked form."""
    return PairLossForm.Ranked if form == PairLossForm.Derived else PairLossForm(form)


def resolve(config: TrainerInitVramConfig) -> TrainerInitVramConfig:
    """Answers a new config with every zero derived and every rule checked; `config` is not changed.

    Raises `ValueError` (or `TypeError`) naming the first field that breaks a rule. Resolving a resolved
    config answers an equal one.
    """
    _check_types(config)
    b, m, c, li, s = config.batch, config.masking, config.contrastive, config.late_interaction, config.schedule
    segments = b.max_segments_per_device
    pooled_form = derived_pooled_form(PairLossForm.parse(c.pair_loss, "contrastive.pair_loss"))
    sigmoid = pooled_form == PairLossForm.Sigmoid
    span = _or(li.max_query_span, 64)

    # ---- the derivation block: one line per rule ---------------------------------------------------
    batch = dataclasses.replace(
        b,
        image=dataclasses.replace(b.image, channels=_or(b.image.channels, 4)),
        video=dataclasses.replace(
            b.video,
            tube_frames=_or(b.video.tube_frames, 2),
            frame_stride=_or(b.video.frame_stride, 1),
            channels=_or(b.video.channels, 3),
        ),
        audio=dataclasses.replace(b.audio, sample_rate=_or(b.audio.sample_rate, 16000)),
    )
    masking = Masking(
        token_mask_probability=_or(m.token_mask_probability, 0.15),
        token_mean_span=_or(m.token_mean_span, 16.0),
        replace_fraction=_or(m.replace_fraction, 0.8),
        random_fraction=_or(m.random_fraction, 0.1),
        image_mask_ratio=_or(m.image_mask_ratio, 0.75),
        video_mask_ratio=_or(m.video_mask_ratio, 0.75),
        audio_mask_ratio=_or(m.audio_mask_ratio, 0.75),
        text_weight=_or(m.text_weight, 1.0),
        image_weight=_or(m.image_weight, 1.0),
        video_weight=_or(m.video_weight, 1.0),
        audio_weight=_or(m.audio_weight, 1.0),
    )
    contrastive = Contrastive(
        matryoshka_dimensions=tuple(int(w) for w in c.matryoshka_dimensions),
        temperature_groups=_or(c.temperature_groups, 1),
        inverse_temperature=_or(c.inverse_temperature, 10.0 if sigmoid else 1.0),
        bias=_or(c.bias, -10.0 if sigmoid else 0.0),
        negatives=Negatives.parse(c.negatives, "contrastive.negatives"),
        ambient_repulsion_weight=_or(c.ambient_repulsion_weight, 1.0),
        max_edges_per_device=_or(c.max_edges_per_device, segments),
        pair_loss=pooled_form,
    )
    late = LateInteraction(
        weight=li.weight,
        width=_or(li.width, 128),
        inverse_temperature=_or(li.inverse_temperature, 1.0),
        bias=li.bias,
        max_query_span=span,
        max_query_tokens_per_device=_or(li.max_query_tokens_per_device, span * segments),
        max_documents_per_device=_or(li.max_documents_per_device, segments),
        max_document_tokens_per_device=_or(
            li.max_document_tokens_per_device, b.max_rows_per_device * b.max_columns_per_row
        ),
        pair_loss=derived_token_form(PairLossForm.parse(li.pair_loss, "late_interaction.pair_loss")),
    )
    schedule = Schedule(
        learning_rate=_or(s.learning_rate, 5e-4),
        min_learning_rate=_or(s.min_learning_rate, 1e-5),
        warmup_steps=_or(s.warmup_steps, min(s.steps // 10, 400)),
        steps=s.steps,
    )
    resolved = dataclasses.replace(
        config,
        batch=batch,
        objective=Objective.parse(config.objective, "objective"),
        masking=masking,
        contrastive=contrastive,
        late_interaction=late,
        choices=Choices(weight=config.choices.weight),
        schedule=schedule,
        progress_steps=_or(config.progress_steps, 10),
    )
    # -----------------------------------------------------------------------------------------------
    _check_numbers(resolved)  # a derived product (a span times the segments, say) may pass int64 too
    check(resolved)
    return resolved


def _check_types(config: TrainerInitVramConfig) -> None:
    expected = {
        "batch": BatchShape,
        "masking": Masking,
        "contrastive": Contrastive,
        "late_interaction": LateInteraction,
        "choices": Choices,
        "schedule": Schedule,
    }
    if not isinstance(config, TrainerInitVramConfig):
        raise TypeError(f"config: expected a TrainerInitVramConfig, got {type(config).__name__}")
    for name, kind in expected.items():
        if not isinstance(getattr(config, name), kind):
            raise TypeError(f"{name}: expected a {kind.__name__}, got {type(getattr(config, name)).__name__}")
    for name, kind in (("image", ImageShape), ("video", VideoShape), ("audio", AudioShape)):
        if not isinstance(getattr(config.batch, name), kind):
            raise TypeError(f"batch.{name}: expected a {kind.__name__}")
    _check_numbers(config)
    if config.progress is not None and not callable(config.progress):
        raise TypeError(
            f"progress: expected None or a callable progress(done, total), got {type(config.progress).__name__}"
        )
    widths = config.contrastive.matryoshka_dimensions
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence):
        raise TypeError(f"contrastive.matryoshka_dimensions: expected a sequence of ints, got {type(widths).__name__}")
    for i, w in enumerate(widths):
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"contrastive.matryoshka_dimensions[{i}]: expected an int, got {type(w).__name__}")


_FLOAT32_MAX = 3.4028234663852886e38


def _check_numbers(obj: Any, prefix: str = "") -> None:
    """Every int field holds an int (not a bool) and every float field a real number."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_numbers(value, name + ".")
        elif f.type in ("int", int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if name != "seed" and not -(2**63) <= value < 2**63:  # `seed` is unsigned, checked on its own
                raise ValueError(f"{name}: must fit a signed 64-bit integer, got {value}")
        elif f.type in ("float", float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
            if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                raise ValueError(f"{name}: must be finite in float32 (|x| <= 3.4e38), got {value}")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check(r: TrainerInitVramConfig) -> None:
    """Every rule of a run over a resolved config; raises `ValueError` naming the field."""
    b = r.batch
    _need(r.depth > 0, f"depth: must be positive, got {r.depth}")
    _need(r.hidden > 0 and r.hidden % 128 == 0, f"hidden: must be a positive multiple of 128, got {r.hidden}")
    _need(r.schedule.steps > 0, f"schedule.steps: must be positive, got {r.schedule.steps}")
    _need(r.seed >= 0 and r.seed < 2**64, f"seed: must fit an unsigned 64-bit integer, got {r.seed}")
    for name in ("max_rows_per_device", "max_segments_per_device", "max_columns_per_row"):
        _need(getattr(b, name) > 0, f"batch.{name}: must be positive, got {getattr(b, name)}")
    for name in ("max_bags_per_device", "max_choices_per_item"):
        _need(getattr(b, name) >= 0, f"batch.{name}: must not be negative, got {getattr(b, name)}")
    _need(
        b.max_columns_per_row >= 4,
        f"batch.max_columns_per_row: must hold a prefix and content (>= 4), got {b.max_columns_per_row}",
    )
    _need(
        b.max_choices_per_item <= 256,
        f"batch.max_choices_per_item: at most 256 legal bytes, got {b.max_choices_per_item}",
    )
    for name, value in (
        ("batch.image.patch_side", b.image.patch_side),
        ("batch.video.patch_side", b.video.patch_side),
        ("batch.audio.chunk_samples", b.audio.chunk_samples),
    ):
        _need(value >= 0, f"{name}: must not be negative, got {value}")
    for name, value in (("batch.image.channels", b.image.channels), ("batch.video.channels", b.video.channels)):
        _need(value in (1, 3, 4), f"{name}: must be 1, 3 or 4, got {value}")
    for name, value in (
        ("batch.video.tube_frames", b.video.tube_frames),
        ("batch.video.frame_stride", b.video.frame_stride),
        ("batch.audio.sample_rate", b.audio.sample_rate),
    ):
        _need(value > 0, f"{name}: must be positive, got {value}")

    m = r.masking
    _need(
        0 < m.token_mask_probability <= 1,
        f"masking.token_mask_probability: must lie in (0, 1], got {m.token_mask_probability}",
    )
    _need(m.token_mean_span >= 1, f"masking.token_mean_span: must be at least 1 byte, got {m.token_mean_span}")
    for name in ("replace_fraction", "random_fraction"):
        value = getattr(m, name)
        _need(0 <= value <= 1, f"masking.{name}: must lie in [0, 1], got {value}")
    _need(
        m.replace_fraction + m.random_fraction <= 1 + 1e-6,
        f"masking.replace_fraction + masking.random_fraction: must not exceed 1, got {m.replace_fraction + m.random_fraction}",
    )
    for name in ("image_mask_ratio", "video_mask_ratio", "audio_mask_ratio"):
        value = getattr(m, name)
        _need(0 < value < 1, f"masking.{name}: must lie in (0, 1), got {value}")
    for name in ("text_weight", "image_weight", "video_weight", "audio_weight"):
        _need(getattr(m, name) >= 0, f"masking.{name}: must not be negative, got {getattr(m, name)}")

    c = r.contrastive
    widths = list(c.matryoshka_dimensions)
    _need(len(widths) <= 8, f"contrastive.matryoshka_dimensions: at most 8 widths, got {len(widths)}")
    for i, w in enumerate(widths):
        _need(
            w > 0 and w % 8 == 0, f"contrastive.matryoshka_dimensions[{i}]: must be a positive multiple of 8, got {w}"
        )
        _need(w <= r.hidden, f"contrastive.matryoshka_dimensions[{i}]: {w} is wider than hidden {r.hidden}")
        _need(
            i == 0 or w > widths[i - 1], f"contrastive.matryoshka_dimensions: must be strictly ascending, got {widths}"
        )
    _need(c.temperature_groups > 0, f"contrastive.temperature_groups: must be positive, got {c.temperature_groups}")
    _need(c.inverse_temperature > 0, f"contrastive.inverse_temperature: must be positive, got {c.inverse_temperature}")
    _need(
        c.ambient_repulsion_weight > 0,
        f"contrastive.ambient_repulsion_weight: must be positive, got {c.ambient_repulsion_weight}",
    )
    _need(
        c.max_edges_per_device > 0, f"contrastive.max_edges_per_device: must be positive, got {c.max_edges_per_device}"
    )

    li = r.late_interaction
    _need(li.weight >= 0, f"late_interaction.weight: must not be negative, got {li.weight}")
    _need(
        li.width > 0 and li.width % 8 == 0, f"late_interaction.width: must be a positive multiple of 8, got {li.width}"
    )
    _need(
        li.inverse_temperature > 0,
        f"late_interaction.inverse_temperature: must be positive, got {li.inverse_temperature}",
    )
    for name in (
        "max_query_span",
        "max_query_tokens_per_device",
        "max_documents_per_device",
        "max_document_tokens_per_device",
    ):
        _need(getattr(li, name) > 0, f"late_interaction.{name}: must be positive, got {getattr(li, name)}")

    _need(r.choices.weight >= 0, f"choices.weight: must not be negative, got {r.choices.weight}")
    _need(
        r.choices.weight == 0 or b.max_choices_per_item > 0,
        "choices.weight: a positive weight needs batch.max_choices_per_item > 0",
    )

    s = r.schedule
    _need(s.learning_rate > 0, f"schedule.learning_rate: must be positive, got {s.learning_rate}")
    _need(s.min_learning_rate > 0, f"schedule.min_learning_rate: must be positive, got {s.min_learning_rate}")
    _need(
        s.min_learning_rate <= s.learning_rate,
        f"schedule.min_learning_rate: {s.min_learning_rate} exceeds schedule.learning_rate {s.learning_rate}",
    )
    _need(
        0 <= s.warmup_steps <= s.steps, f"schedule.warmup_steps: must lie in [0, steps={s.steps}], got {s.warmup_steps}"
    )
    _need(r.progress_steps > 0, f"progress_steps: must be positive, got {r.progress_steps}")


# --------------------------------------------------------------------------------------------------
# The resolved config as JSON, for a checkpoint's metadata

_SKIPPED = {"resume", "mesh", "progress"}


def to_dict(config: TrainerInitVramConfig) -> dict[str, Any]:
    """The config's plain fields (no resume path, mesh or callback), enums as their words."""

    def plain(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in _SKIPPED}
        if isinstance(obj, (list, tuple)):
            return [plain(v) for v in obj]
        if hasattr(obj, "words"):
            return str(obj)
        return obj

    return plain(config)


def from_dict(data: dict[str, Any]) -> TrainerInitVramConfig:
    """The inverse of `to_dict`; unknown keys are refused with the key named."""

    def build(kind: type, values: dict[str, Any], prefix: str) -> Any:
        if not isinstance(values, dict):
            raise ValueError(f"config{prefix}: expected an object")
        fields = {f.name: f for f in dataclasses.fields(kind)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in fields:
                raise ValueError(f"config{prefix}.{key}: unknown field")
            nested = _NESTED.get((kind, key))
            if nested is not None:
                kwargs[key] = build(nested, value, f"{prefix}.{key}")
            elif key in _ENUMS:
                kwargs[key] = _ENUMS[key].parse(value, key)
            elif key == "matryoshka_dimensions":
                kwargs[key] = tuple(value)
            else:
                kwargs[key] = value
        return kind(**kwargs)

    return build(TrainerInitVramConfig, data, "")


def to_json(config: TrainerInitVramConfig) -> str:
    return json.dumps(to_dict(config), sort_keys=True)


_NESTED: dict[tuple[type, str], type] = {
    (TrainerInitVramConfig, "batch"): BatchShape,
    (TrainerInitVramConfig, "masking"): Masking,
    (TrainerInitVramConfig, "contrastive"): Contrastive,
    (TrainerInitVramConfig, "late_interaction"): LateInteraction,
    (TrainerInitVramConfig, "choices"): Choices,
    (TrainerInitVramConfig, "schedule"): Schedule,
    (BatchShape, "image"): ImageShape,
    (BatchShape, "video"): VideoShape,
    (BatchShape, "audio"): AudioShape,
}
_ENUMS: dict[str, Any] = {"objective": Objective, "negatives": Negatives, "pair_loss": PairLossForm}
