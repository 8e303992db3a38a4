"""Media at the trainer level: real images, clips and recordings decode, pack, mask and train (issue 3).

Every sample is built from files other people made (scikit-image's photographs, pygame's recordings,
see media_samples.py). Runs are tiny (depth 1, hidden 128, 128-256 columns, rows of 2-6) and trainers
are shared across checks where they can be, since each one starts its own pool of decoder processes.

Pins: every container the media decoders accept trains with a finite, positive masked loss of its modality; unit
counts, positions, markers and slots in the packed rows; mask ratios (video tube masks agree across
time; no masking under Contrastive); per-unit normalised targets and the masked sum against a naive loop;
the gradient reaching every media parameter; broken, oversized and slow items skipped (counted and
warned about once per trainer, naming them) or, when strict, refused with the trainer untouched; a mixed batch of every
modality training in one Joint step; modalities out of the run refused.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest
import soxr
import torch
from conftest import assert_same, snapshot
from media_samples import (
    VIDEO_FRAMES,
    encode_image,
    encode_sound,
    flat_png,
    forged_jpeg,
    opus_webm,
    photo,
    pictures,
    pygame_file,
    recording,
    skimage_file,
    video,
)
from PIL import Image

from uform import (
    Arena,
    AudioShape,
    BatchShape,
    Edges,
    Executor,
    ImageShape,
    Masking,
    Modality,
    Objective,
    Relations,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    TrainerStepStats,
    VideoShape,
    vocab,
)
from uform.config import resolve
from uform.data.batch import MEDIA_KINDS, mask_media, prepare
from uform.data.items import parse_modalities
from uform.data.keyed import keyed_states
from uform.losses.masked import masked_units_sum, normalised_targets
from uform.losses.term import Term
from uform.media.decode import MediaPolicy, decode_item
from uform.media.limits import MediaError, MediaLimits
from uform.media.units import Units
from uform.model.inputs import to_device
from uform.model.network import Network
from uform.notices import MediaWarning, Notices

RATE = 16000

# ---- samples -------------------------------------------------------------------------------------------


def jpeg(name: str = "astronaut.png", size: tuple[int, int] = (64, 48)) -> bytes:
    return encode_image(photo(name).convert("RGB").resize(size, Image.Resampling.BOX), "JPEG", quality=90)


def png(name: str = "astronaut.png", size: tuple[int, int] = (64, 48)) -> bytes:
    return encode_image(photo(name).convert("RGBA").resize(size, Image.Resampling.BOX), "PNG")


def webp(name: str = "chelsea.png", size: tuple[int, int] = (64, 48)) -> bytes:
    return encode_image(photo(name).convert("RGB").resize(size, Image.Resampling.BOX), "WEBP", quality=90)


def house(rate: int, seconds: float | None = None) -> np.ndarray:
    """pygame's house recording resampled to `rate`, cut to `seconds` when given."""
    samples, source = recording("house_lo.wav")
    out = soxr.resample(samples, source, rate).astype(np.float32)
    return out if seconds is None else out[: round(seconds * rate)]


def wav16k(samples: int) -> bytes:
    """A 16 kHz float WAV of exactly `samples` samples of the house recording (no resampling on decode)."""
    return encode_sound(house(RATE)[:samples], RATE, "WAV", "FLOAT")


CONTAINERS: dict[str, tuple[str, Any]] = {
    "jpeg (rocket.jpg)": ("image", lambda: skimage_file("rocket.jpg")),
    "jpeg (alien1.jpg)": ("image", lambda: pygame_file("alien1.jpg")),
    "png (alien1.png, palette)": ("image", lambda: pygame_file("alien1.png")),
    "png (astronaut)": ("image", png),
    "webp (chelsea)": ("image", webp),
    "mp4": ("video", lambda: video("mp4")[0]),
    "webm": ("video", lambda: video("webm")[0]),
    "wav (house_lo.wav)": ("audio", lambda: pygame_file("house_lo.wav")),
    "flac": ("audio", lambda: encode_sound(*recording("boom.wav"), "FLAC")),
    "mp3 (house_lo.mp3)": ("audio", lambda: pygame_file("house_lo.mp3")),
    "ogg vorbis (house_lo.ogg)": ("audio", lambda: pygame_file("house_lo.ogg")),
    "ogg opus": ("audio", lambda: encode_sound(house(48000, 2.0), 48000, "OGG", "OPUS")),
    "webm opus": ("audio", lambda: opus_webm("boom.wav")),
}

# ---- runs ----------------------------------------------------------------------------------------------


def media_config(
    objective: Objective = Objective.Masked,
    *,
    rows: int = 2,
    columns: int = 128,
    segments: int = 8,
    image: int = 16,
    video_side: int = 16,
    tube_frames: int = 2,
    frame_stride: int = 1,
    audio: int = 320,
    masking: Masking | None = None,
    depth: int = 1,
    seed: int = 5,
) -> TrainerInitVramConfig:
    return TrainerInitVramConfig(
        depth=depth,
        hidden=128,
        objective=objective,
        batch=BatchShape(
            max_rows_per_device=rows,
            max_segments_per_device=segments,
            max_columns_per_row=columns,
            image=ImageShape(patch_side=image),
            video=VideoShape(patch_side=video_side, tube_frames=tube_frames, frame_stride=frame_stride),
            audio=AudioShape(chunk_samples=audio),
        ),
        masking=masking or Masking(),
        schedule=Schedule(steps=50, warmup_steps=2, learning_rate=1e-3),
        seed=seed,
    )


# UFORM_TEST_CUDA=1 runs the shared trainers (every container, the losses, skipping, the mixed batch) on CUDA
# device 0: compiled step, FlexAttention, bf16 autocast. Host-side checks (strictness, time limits) stay on
# the CPU executor, where twin runs are bitwise equal.
ON_CUDA = os.environ.get("UFORM_TEST_CUDA") == "1"


@pytest.fixture(scope="module")
def executor() -> Executor:
    return Executor.cpu()


@pytest.fixture(scope="module")
def device_executor() -> Executor:
    if not ON_CUDA:
        return Executor.cpu()
    if not torch.cuda.is_available():
        pytest.skip("UFORM_TEST_CUDA=1 needs a CUDA device")
    return Executor.for_vram([0])


@pytest.fixture(scope="module")
def masked_trainer(device_executor: Executor) -> Iterator[Trainer]:
    """A Masked run of every media modality, shared by the container and loss checks."""
    trainer = Trainer.init_vram(device_executor, media_config(), media=MediaPolicy(workers=2))
    yield trainer
    trainer.close()


# Limits the shared Joint run applies: the good samples are well inside them, the oversized ones each
# break one (bytes are checked first, then pixels from the header, then seconds from the header).
LIMITS = MediaLimits(max_bytes=200_000, max_pixels=100_000, max_seconds=3.0)


@pytest.fixture(scope="module")
def joint_trainer(device_executor: Executor) -> Iterator[Trainer]:
    """A Joint run of every media modality with tight limits, shared by the skipping and mixed-batch checks."""
    config = media_config(Objective.Joint, rows=4, columns=256, segments=16, depth=2)
    trainer = Trainer.init_vram(device_executor, config, media=MediaPolicy(workers=2, limits=LIMITS))
    yield trainer
    trainer.close()


def pairs(count: int, couples: Sequence[tuple[int, int]]) -> Relations:
    """Attract edges both ways between the items of each couple, over `count` items."""
    linked: list[list[int]] = [[] for _ in range(count)]
    for a, b in couples:
        linked[a].append(b)
        linked[b].append(a)
    offsets = np.cumsum([0] + [len(ids) for ids in linked]).tolist()
    return Relations(attract=Edges(offsets=offsets, ids=[j for ids in linked for j in sorted(ids)]))


def train(
    trainer: Trainer,
    modalities: Sequence[str],
    contents: Sequence[bytes | str],
    *,
    relations: Relations | None = None,
    stats: bool = True,
    arena: bool = False,
) -> tuple[TrainerStepStats | None, torch.Tensor | None, list[str]]:
    """One blocking step; answers (stats, embeddings, the MediaWarning messages it raised)."""
    st = TrainerStepStats() if stats else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.step(
            modalities,
            contents,
            TrainerStepConfig(relations=relations, stats=st, arena=Arena() if arena else None),
        )
    return st, out, [str(w.message) for w in caught if issubclass(w.category, MediaWarning)]


def decode(config: TrainerInitVramConfig, kind: str, data: bytes, limits: MediaLimits | None = None) -> Units:
    """An item's units as the trainer's decode stage makes them (in this process)."""
    b = config.batch
    return decode_item(kind, data, dict(vars(getattr(b, kind))), b.max_columns_per_row - 1, limits or MediaLimits())


def prepared(
    config: TrainerInitVramConfig,
    modalities: Sequence[str],
    contents: Sequence[bytes | str],
    *,
    step: int = 1,
    relations: Relations | None = None,
) -> tuple[Any, dict[int, Units]]:
    """The host batch of a step (decoded here, every media item good) and each media item's units."""
    mods = parse_modalities(modalities)
    data = [c.encode() if isinstance(c, str) else c for c in contents]
    units = {i: decode(config, MEDIA_KINDS[m], data[i]) for i, m in enumerate(mods) if m != Modality.Text}
    batch = prepare(config, mods, data, bags=None, groups=None, sides=None, relations=relations, step=step, units=units)
    return batch, units


def forward(
    network: Network, config: TrainerInitVramConfig, batch: Any
) -> tuple[dict[str, Term], dict[str, torch.Tensor]]:
    """`network.losses` and `network.total` of a prepared batch, as the trainer's CPU step computes them."""
    inputs = to_device(
        batch.host_tensors(False),
        torch.device("cpu"),
        network.rotary,
        attention="dense",
        dtype=torch.float32,
        dynamic=False,
    )
    terms, _ = network.losses(inputs, None, batch.positives)
    return terms, network.total(terms)


def finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


# ---- 1. every container trains ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_every_container_trains(masked_trainer: Trainer, name: str) -> None:
    kind, build = CONTAINERS[name]
    st, _, warned = train(masked_trainer, [kind, "text"], [build(), f"a caption for {name}"])
    assert st is not None and not warned, warned
    assert st.skipped == 0 and st.dropped == 0
    for other in ("image", "video", "audio"):
        value = getattr(st, f"masked_{other}_loss")
        if other == kind:
            assert finite_positive(value), (name, st)
        else:
            assert value == 0.0, (name, other, st)  # no units of that modality in the step
    assert finite_positive(st.masked_text_loss) and finite_positive(st.loss)
    assert st.contrastive_loss == 0.0


# ---- 2. counts, positions, markers and values in the packed rows ---------------------------------------------


def check_placed(batch: Any, config: TrainerInitVramConfig, item: int, kind: str, units: Units, at: int) -> None:
    """Item `item`'s units sit in `batch.media[kind]` from row `at`: values as decoded, index at the
    positions after its one-id prefix, each holding the modality marker, the item's slot and its axial
    position offset by the prefix."""
    C = config.batch.max_columns_per_row
    layout = batch.layout
    row, column, slot = int(layout.row[item]), int(layout.column[item]), int(layout.slot[item])
    n, p = len(units), 1
    assert slot >= 0 and int(layout.length[item]) == p + n
    media = batch.media[kind]
    index = media["index"][at : at + n]
    np.testing.assert_array_equal(index, row * C + column + p + np.arange(n))
    np.testing.assert_array_equal(media["values"][at : at + n], units.values)
    assert media["valid"][at : at + n].all()
    marker = vocab.MODALITY_MARKER[Modality.parse(kind)]
    tokens, segments = batch.tokens.reshape(-1), batch.segments.reshape(-1)
    positions = batch.positions.reshape(-1, 3)
    assert (tokens[index] == marker).all()
    assert (segments[index] == slot).all()
    np.testing.assert_array_equal(positions[index], units.positions + p)
    # The prefix: the marker at position 0, same segment; nothing of the item past its units.
    assert tokens[row * C + column] == marker and (positions[row * C + column] == 0).all()
    assert segments[row * C + column] == slot
    after = row * C + column + p + n
    if column + p + n < C:
        assert segments[after] != slot


def grid_positions(times: int, rows: int, columns: int) -> np.ndarray:
    return np.array([(t, r, c) for t in range(times) for r in range(rows) for c in range(columns)], dtype=np.int64)


def test_counts_and_positions_of_known_sizes() -> None:
    config = resolve(media_config(rows=4, columns=128, segments=12, tube_frames=2, frame_stride=2, audio=160))
    items = [
        ("text", "an astronaut, 64 x 48"),
        ("image", png("astronaut.png", (64, 48))),  # 4 x 3 patches of 16, exact
        ("image", png("coffee.png", (40, 24))),  # 3 x 2 patches, zero-padded, never upscaled
        ("image", png("chelsea.png", (256, 192))),  # 192 patches > 127: downscaled to 192 x 144, 12 x 9
        ("text", "a clip"),
        ("video", video("mp4")[0]),  # 12 frames 64 x 48, every 2nd sampled, tubes of 2: 3 x 3 x 4
        ("audio", wav16k(1000)),  # 1000 samples at 16 kHz in frames of 160: 7 frames, the last padded
    ]
    batch, units = prepared(config, [m for m, _ in items], [c for _, c in items])
    expected = {1: (1, 3, 4), 2: (1, 2, 3), 3: (1, 9, 12), 5: (VIDEO_FRAMES // 2 // 2, 3, 4), 6: (7, 1, 1)}
    for i, grid in expected.items():
        assert units[i].grid == grid, (i, units[i].grid)
        assert len(units[i]) == math.prod(grid) and not units[i].truncated
        if items[i][0] == "audio":
            steps = np.arange(7)
            np.testing.assert_array_equal(units[i].positions, np.stack([steps] * 3, axis=1))
        else:
            np.testing.assert_array_equal(units[i].positions, grid_positions(*grid))
    assert batch.truncated == 0 and batch.dropped == 0 and batch.skipped == 0
    assert len(set(batch.layout.slot.tolist())) == len(items)

    # Each modality's units are stacked in item order.
    at = {"image": 0, "video": 0, "audio": 0}
    for i, (kind, _) in enumerate(items):
        if kind == "text":
            continue
        check_placed(batch, config, i, kind, units[i], at[kind])
        at[kind] += len(units[i])
    for kind, count in at.items():
        media = batch.media[kind]
        assert len(media["index"]) == max(2, count)  # padded with inert units to at least two
        assert media["valid"].sum() == count and not media["masked"][count:].any()

    # The exact image comes back pixel for pixel from the batch's rows; the small one is padded, not scaled.
    image = batch.media["image"]
    back = Units(values=image["values"][:12], positions=units[1].positions, grid=(1, 3, 4), truncated=False)
    original = np.asarray(photo("astronaut.png").convert("RGBA").resize((64, 48), Image.Resampling.BOX))
    np.testing.assert_array_equal(pictures(back, 16, 4)[0], original)
    small = Units(values=image["values"][12:18], positions=units[2].positions, grid=(1, 2, 3), truncated=False)
    padded = pictures(small, 16, 4)[0]
    assert (padded[:24, :40, 3] == 255).all() and not padded[24:].any() and not padded[:, 40:].any()
    # Audio: the frames are the recording (normalised over itself), then zeros to a whole frame.
    audio = batch.media["audio"]["values"][:7].reshape(-1)
    assert audio.dtype == np.float32 and not audio[1000:].any()
    samples = house(RATE)[:1000].astype(np.float64)
    normalised = (samples - samples.mean()) / math.sqrt(np.var(samples) + 1e-7)
    np.testing.assert_allclose(audio[:1000], normalised, atol=1e-4)


def test_media_arrays_keep_their_dtype_without_items() -> None:
    """A step without units of a modality still carries its arrays (two inert units) in that modality's
    dtype, so the compiled step sees one dtype per modality whatever the mix."""
    config = resolve(media_config(audio=160))
    for kinds, contents in ((["text"], ["words only"]), (["audio", "image"], [wav16k(500), jpeg()])):
        batch, _ = prepared(config, kinds, contents)
        assert batch.media["image"]["values"].dtype == np.uint8
        assert batch.media["video"]["values"].dtype == np.uint8
        assert batch.media["audio"]["values"].dtype == np.float32
        assert not batch.media["video"]["valid"].any() and len(batch.media["video"]["valid"]) == 2


def test_long_items_cut_to_the_row() -> None:
    """A row of 32 columns holds 31 units: a clip keeps two tube-times of 12, a recording 31 frames."""
    config = resolve(media_config(rows=2, columns=32, segments=4, audio=160))
    batch, units = prepared(config, ["video", "audio"], [video("mp4")[0], pygame_file("house_lo.wav")])
    assert units[0].grid == (2, 3, 4) and units[0].truncated
    assert units[1].grid == (31, 1, 1) and units[1].truncated
    assert batch.truncated == 2 and batch.dropped == 0
    check_placed(batch, config, 0, "video", units[0], 0)
    check_placed(batch, config, 1, "audio", units[1], 0)


# ---- 3. masks ------------------------------------------------------------------------------------------


MASK_ITEMS = [
    ("image", lambda: png("astronaut.png", (64, 48))),  # 12 patches
    ("image", lambda: png("coffee.png", (96, 80))),  # 6 x 5 = 30 patches
    ("video", lambda: video("webm")[0]),  # 6 tube-times of 3 x 4
    ("video", lambda: video("mp4", frames=6)[0]),  # 3 tube-times of 3 x 4
    ("audio", lambda: wav16k(1000)),  # 7 frames of 160
    ("audio", lambda: encode_sound(house(RATE, 1.5), RATE, "FLAC")),  # 150 frames
]


def item_masks(batch: Any, units: dict[int, Units], kinds: list[str]) -> dict[int, np.ndarray]:
    at = {"image": 0, "video": 0, "audio": 0}
    out = {}
    for i, kind in enumerate(kinds):
        n = len(units[i])
        out[i] = batch.media[kind]["masked"][at[kind] : at[kind] + n]
        at[kind] += n
    return out


def test_masks_hit_their_ratios_and_tubes_agree_across_time() -> None:
    ratios = {"image": 0.5, "video": 0.25, "audio": 0.6}
    masking = Masking(image_mask_ratio=0.5, video_mask_ratio=0.25, audio_mask_ratio=0.6)
    config = resolve(media_config(rows=6, columns=256, segments=8, audio=160, masking=masking))
    kinds = [k for k, _ in MASK_ITEMS]
    contents = [build() for _, build in MASK_ITEMS]
    seen: dict[int, list[np.ndarray]] = {i: [] for i in range(len(kinds))}
    for step in (1, 2, 3):
        batch, units = prepared(config, kinds, contents, step=step)
        masks = item_masks(batch, units, kinds)
        for i, kind in enumerate(kinds):
            mask = masks[i]
            seen[i].append(mask)
            if kind == "video":
                times, rows, columns = units[i].grid
                plane = mask.reshape(times, rows * columns)
                assert (plane == plane[0]).all(), f"item {i}: tube masks differ across time"
                assert plane[0].sum() == round(ratios[kind] * rows * columns)
            else:
                assert mask.sum() == round(ratios[kind] * len(units[i])), (i, mask.sum(), len(units[i]))
        again, _ = prepared(config, kinds, contents, step=step)  # keyed by (seed, step): reproducible
        for kind in ratios:
            np.testing.assert_array_equal(again.media[kind]["masked"], batch.media[kind]["masked"])
    for i, masks in seen.items():  # and a new draw every step
        assert any(not np.array_equal(masks[0], m) for m in masks[1:]), f"item {i}: the same mask every step"


def test_media_masks_are_the_same_whether_the_decoder_or_the_packer_keys_the_items() -> None:
    """Units decoded without their key (`keyed=False`) are keyed by the packer from the item's bytes, so the
    step's masks and every other array are bitwise those of units the decoder keyed."""
    masking = Masking(image_mask_ratio=0.5, video_mask_ratio=0.25, audio_mask_ratio=0.6)
    config = resolve(media_config(rows=6, columns=256, segments=8, audio=160, masking=masking))
    kinds = [k for k, _ in MASK_ITEMS]
    contents = [build() for _, build in MASK_ITEMS]
    keyed, units = prepared(config, kinds, contents, step=3)
    assert all(u.key is not None for u in units.values())
    bare = {i: dataclasses.replace(u, key=None) for i, u in units.items()}
    mods = parse_modalities(kinds)
    unkeyed = prepare(config, mods, contents, bags=None, groups=None, sides=None, relations=None, step=3, units=bare)
    for kind in keyed.media:
        for name, array in keyed.media[kind].items():
            np.testing.assert_array_equal(unkeyed.media[kind][name], array, err_msg=f"{kind}.{name}")
    assert any(keyed.media[kind]["masked"].any() for kind in keyed.media)  # masks were drawn at all
    np.testing.assert_array_equal(unkeyed.tokens, keyed.tokens)


def _units(grid: tuple[int, int, int]) -> Units:
    n = math.prod(grid)
    return Units(values=np.zeros((n, 3), np.uint8), positions=np.zeros((n, 3), np.int64), grid=grid, truncated=False)


def test_media_masks_are_uniform_over_units_and_each_items_own() -> None:
    """Over 4,000 keyed images every unit is masked with chance count / N (each within z binomial standard errors,
    z set by a 1e-4 chance over the units), the count exact in each; a clip masks one plane, tiled over its times;
    and an item's mask is its key's alone, whatever other items (of other sizes, kinds and ratios) share the call."""
    trials, grid = 4000, (1, 4, 8)
    keys = keyed_states(5, 1, 3, list(range(trials)))[:, :2]
    masks = np.array(mask_media(["image"] * trials, [_units(grid)] * trials, [0.25] * trials, keys))  # [T, 32]
    assert (masks.sum(axis=1) == 8).all()
    share, z = 0.25, NormalDist().inv_cdf(1 - 1e-4 / (2 * 32))
    assert np.abs(masks.mean(axis=0) - share).max() <= z * math.sqrt(share * (1 - share) / trials)
    clip = (3, 4, 4)
    mixed = mask_media(
        ["audio", "video", "image"],
        [_units((7, 1, 1)), _units(clip), _units(grid)],
        [0.5, 0.5, 0.25],
        keyed_states(5, 1, 3, [77, 78, 3])[:, :2],
    )
    assert mixed[0].sum() == round(0.5 * 7) and mixed[1].sum() == 3 * round(0.5 * 16)
    plane = mixed[1].reshape(3, 16)
    assert (plane == plane[0]).all()
    assert np.array_equal(mixed[2], masks[3])  # key 3 among the 4,000 images and here: the same mask


def dirty(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
    """An `alloc` whose memory holds garbage, as a preparer's slab holds the last step's arrays."""
    array = np.empty(shape, dtype)
    array.reshape(-1).view(np.uint8)[:] = 0xA5
    return array


def test_the_media_arrays_are_the_same_in_memory_that_holds_anything() -> None:
    """`prepare` writes its media arrays whole, the padding units too, so the step is bitwise the same whatever
    memory `alloc` gives (a preparer process builds them in its slab, over the last step's)."""
    config = resolve(media_config(rows=6, columns=256, segments=8, audio=160))
    kinds = ["image", "image", "text"]  # video and audio: their padding units alone
    contents = [MASK_ITEMS[0][1](), MASK_ITEMS[1][1](), b"a caption"]
    mods = parse_modalities(kinds)
    units = {i: decode(config, "image", contents[i]) for i in (0, 1)}
    answers = [
        prepare(
            config, mods, contents, bags=None, groups=None, sides=None, relations=None, step=4, units=units, **extra
        )
        for extra in ({}, {"alloc": dirty})
    ]
    clean, built = (a.arrays() for a in answers)
    assert sorted(clean) == sorted(built) and clean["image.valid"].sum() == 42 and clean["video.valid"].sum() == 0
    for name, array in clean.items():
        assert array.dtype == built[name].dtype and np.array_equal(array, built[name]), name


def test_no_masking_under_contrastive() -> None:
    config = resolve(media_config(Objective.Contrastive, rows=6, columns=256, segments=8, audio=160))
    kinds = [k for k, _ in MASK_ITEMS]
    batch, _ = prepared(
        config, [*kinds, "text"], [*(b() for _, b in MASK_ITEMS), "a caption"], relations=pairs(7, [(0, 6)])
    )
    for kind in ("image", "video", "audio"):
        assert batch.media[kind]["valid"].sum() > 0 and not batch.media[kind]["masked"].any()
    assert batch.target_weight.sum() == 0  # nor any text
    network = Network(config)
    network.initialize(config.seed)
    with torch.no_grad():
        terms, totals = forward(network, config, batch)
    for kind in ("image", "video", "audio"):
        assert terms[f"masked_{kind}"].count == 0 and totals[f"masked_{kind}_loss"] == 0


# ---- 4. targets and the masked sum --------------------------------------------------------------------


def test_targets_are_normalised_per_unit() -> None:
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, size=(9, 16 * 16 * 4), dtype=np.uint8))
    frames = torch.from_numpy(rng.normal(0.3, 2.5, size=(7, 160)).astype(np.float32))
    for values in (pixels, frames):
        targets = normalised_targets(values)
        assert targets.dtype == torch.float32 and targets.shape == values.shape
        torch.testing.assert_close(targets.mean(dim=1), torch.zeros(len(values)), atol=1e-5, rtol=0)
        torch.testing.assert_close(targets.var(dim=1, unbiased=False), torch.ones(len(values)), atol=1e-4, rtol=0)
    flat = normalised_targets(torch.full((2, 64), 200, dtype=torch.uint8))  # a flat patch: zeros, not NaN
    assert torch.equal(flat, torch.zeros(2, 64))


def test_masked_units_sum_equals_a_naive_loop() -> None:
    rng = np.random.default_rng(1)
    values = torch.from_numpy(rng.integers(0, 256, size=(10, 48), dtype=np.uint8))
    masked = torch.from_numpy(rng.random(10) < 0.5)
    masked[0], masked[1] = True, False
    predictions = torch.randn(10, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a = predictions.clone().requires_grad_(True)
    total, count = masked_units_sum(a, values, masked)
    total.backward()

    b = predictions.clone().requires_grad_(True)
    naive = torch.zeros((), dtype=torch.float64)
    for u in range(len(values)):
        if not masked[u]:
            continue
        x = values[u].double()
        target = (x - x.mean()) / torch.sqrt(((x - x.mean()) ** 2).mean() + 1e-6)
        naive = naive + sum((b[u, f] - target[f]) ** 2 for f in range(values.shape[1])) / values.shape[1]
    naive.backward()
    assert count == masked.sum()
    torch.testing.assert_close(total.double(), naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert (a.grad[~masked] == 0).all()


def test_step_losses_are_the_network_function(masked_trainer: Trainer) -> None:
    """The stats of a trainer's step are `network.total` of its prepared batch before the update."""
    trainer = masked_trainer
    kinds = ["image", "text", "video", "audio"]
    contents = [webp(), "a cat", video("mp4")[0], pygame_file("boom.wav")]
    batch, _ = prepared(trainer.config, kinds, contents, step=trainer.steps_taken + 1)
    with torch.no_grad():  # the CPU fp32 reference of the step, whatever the trainer's device
        _, totals = forward(copy.deepcopy(trainer.network).cpu(), trainer.config, batch)
    st, _, warned = train(trainer, kinds, contents)
    assert st is not None and not warned
    for name in ("loss", "masked_text_loss", "masked_image_loss", "masked_video_loss", "masked_audio_loss"):
        assert finite_positive(getattr(st, name))
        # on CUDA: bf16 autocast against the fp32 reference
        assert getattr(st, name) == pytest.approx(float(totals[name]), rel=2e-2 if ON_CUDA else 1e-5), name


# ---- 5. gradients ------------------------------------------------------------------------------------------


def test_gradient_reaches_every_media_parameter(masked_trainer: Trainer) -> None:
    config = masked_trainer.config
    network = copy.deepcopy(masked_trainer.network).cpu()
    network.zero_grad(set_to_none=True)
    kinds = ["image", "video", "audio", "text"]
    batch, _ = prepared(config, kinds, [jpeg(), video("webm")[0], pygame_file("boom.wav"), "a caption"])
    _, totals = forward(network, config, batch)
    totals["loss"].backward()
    media = network.media
    convolutions = [m for m in media["audio"].embedding.convolutions if isinstance(m, torch.nn.Conv1d)]
    assert len(convolutions) >= 2
    named = {
        "image embedding": media["image"].embedding.weight,
        "video embedding": media["video"].embedding.weight,
        "audio projection": media["audio"].embedding.projection.weight,
        **{f"audio convolution {i}": c.weight for i, c in enumerate(convolutions)},
        **{f"{k} mask": media[k].mask for k in ("image", "video", "audio")},
        **{f"{k} head": network.reconstruct[k].weight for k in ("image", "video", "audio")},
        **{f"{k} head bias": network.reconstruct[k].bias for k in ("image", "video", "audio")},
    }
    for name, parameter in named.items():
        grad = parameter.grad
        assert grad is not None, f"{name}: no gradient"
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, f"{name}: zero gradient"


@pytest.mark.parametrize("chunk", [160, 320, 397, 398])
def test_audio_frontend_sees_every_frame(chunk: int) -> None:
    """Whatever `chunk_samples` factors into (397 is prime: one convolution over the whole frame; 398 =
    199 x 2), distinct frames of a real recording embed apart and the first convolution learns."""
    config = resolve(media_config(audio=chunk, image=0, video_side=0))
    network = Network(config)
    network.initialize(config.seed)
    frontend = network.media["audio"].embedding
    frames = torch.from_numpy(decode(config, "audio", pygame_file("boom.wav")).values[4:12])
    embedded = frontend(frames)
    apart = torch.cdist(embedded, embedded)[~torch.eye(len(frames), dtype=torch.bool)]
    assert apart.min() > 1e-2, f"frames embed alike: {apart.min():.2e}"
    target = torch.randn(embedded.shape, generator=torch.Generator().manual_seed(0))
    ((embedded - target) ** 2).mean().backward()
    first = frontend.convolutions[0].weight
    assert first.grad.norm() / first.norm() > 1e-3


# ---- 6. broken and oversized items ------------------------------------------------------------------------


def broken_items() -> list[tuple[str, bytes, str]]:
    """(modality, bytes, a word of the reason) of items no decoder may accept under LIMITS."""
    rng = np.random.default_rng(3)
    return [
        ("image", jpeg()[: len(jpeg()) // 2], "truncated"),
        ("image", pygame_file("boom.wav"), "not a JPEG, PNG or WebP"),
        ("audio", b"", "zero bytes"),
        ("video", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not an MP4 or WebM"),
        ("video", video("mp4")[0][:3000], "truncated"),
        ("audio", encode_sound(house(44100, 2.0), 44100, "WAV", "FLOAT"), "bytes is over the limit"),
        ("image", jpeg("astronaut.png", (512, 512)), "pixels is over the limit"),
        ("audio", pygame_file("house_lo.wav"), "over the limit of 3.0 s"),
    ]


def test_broken_and_oversized_items_are_skipped(joint_trainer: Trainer) -> None:
    good = [("image", jpeg()), ("text", "an astronaut"), ("audio", pygame_file("boom.wav")), ("text", "a boom")]
    bad = broken_items()
    items = [*good, *((m, c) for m, c, _ in bad)]
    relations = pairs(len(items), [(0, 1), (2, 3)])
    joint_trainer.notices = Notices()  # this step's media warning is the trainer's first
    st, out, warned = train(
        joint_trainer, [m for m, _ in items], [c for _, c in items], relations=relations, arena=True
    )
    assert st is not None and out is not None
    assert st.skipped == len(bad) and st.dropped == 0
    # One warning for the step's broken items (it was one per item), naming each; every one counted.
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"uform: skipped {len(bad)} media items") and "TrainerStepStats.skipped" in warned[0]
    assert joint_trainer.notices.count("media") == len(bad)
    for k, (modality, _, reason) in enumerate(bad):
        named = warned[0].split(f"contents[{len(good) + k}] ({modality}): ", 1)
        assert len(named) == 2 and reason in named[1].split("; contents[")[0], (k, reason, warned)
    for name in ("loss", "contrastive_loss", "masked_text_loss", "masked_image_loss", "masked_audio_loss"):
        assert finite_positive(getattr(st, name)), (name, st)
    assert st.masked_video_loss == 0.0  # every clip of the step was broken
    norms = out.norm(dim=1)
    torch.testing.assert_close(norms[: len(good)], torch.ones(len(good)))
    assert (out[len(good) :] == 0).all()


def test_skipped_accumulates_until_read(joint_trainer: Trainer) -> None:
    trainer = joint_trainer
    trainer.notices = Notices()
    broken = pygame_file("boom.wav")  # a WAV declared as an image
    _, _, w1 = train(trainer, ["image", "image", "text"], [broken, broken, "x"], relations=pairs(3, []), stats=False)
    _, _, w2 = train(trainer, ["text", "audio"], ["y", b"\x00" * 64], relations=pairs(2, []), stats=False)
    assert [len(w1), len(w2)] == [1, 0]  # shown once per trainer, not once per item or step
    assert "contents[0] (image)" in w1[0] and "contents[1] (image)" in w1[0]
    assert trainer.notices.count("media") == 3
    st, _, w3 = train(trainer, ["image", "text"], [jpeg(), "z"], relations=pairs(2, [(0, 1)]))
    assert st is not None and not w3 and st.skipped == 3
    st, _, _ = train(trainer, ["image", "text"], [jpeg(), "z"], relations=pairs(2, [(0, 1)]))
    assert st is not None and st.skipped == 0


def test_hostile_images_refused_under_the_default_limits(executor: Executor) -> None:
    # Issue 10: a 1 KB JPEG claiming 3000 x 3000 decoded as a grey picture and was trained on; a flat 8000 x
    # 8000 PNG of 200 KB took 700 MB in one decoder. Lenient skips and counts them; strict names the item.
    config = media_config(rows=2, columns=128, segments=8)
    hostile = [(forged_jpeg(3000, 3000), "inconsistent JPEG"), (flat_png(8000, 8000), "pixels is over the limit")]
    lenient = Trainer.init_vram(executor, config, media=MediaPolicy(workers=1))
    strict = Trainer.init_vram(executor, config, media=MediaPolicy(strict=True, workers=1))
    try:
        modalities = ["image", "text", "image", "image", "text"]
        contents = [hostile[0][0], "a forged photo", hostile[1][0], jpeg(), "an astronaut"]
        st, _, warned = train(lenient, modalities, contents, relations=pairs(5, [(3, 4)]))
        assert st is not None and st.skipped == 2
        assert any("contents[0]" in w and "inconsistent JPEG" in w for w in warned), warned
        assert any("contents[2]" in w and "pixels is over the limit of 16000000" in w for w in warned), warned
        for data, reason in hostile:
            with pytest.raises(MediaError, match=rf"contents\[1\]: .*{reason}"):
                strict.step(["text", "image"], ["x", data], TrainerStepConfig(stats=TrainerStepStats()))
        assert strict.steps_taken == 0
    finally:
        lenient.close()
        strict.close()


def test_strict_refuses_the_step_and_leaves_the_trainer_unchanged(executor: Executor) -> None:
    config = media_config(rows=2, columns=128, segments=8)
    strict = Trainer.init_vram(executor, config, media=MediaPolicy(strict=True, workers=2))
    twin = Trainer.init_vram(executor, config, media=MediaPolicy(workers=1))
    try:
        first = (["image", "text", "audio"], [jpeg(), "a photo", pygame_file("boom.wav")])
        second = (["video", "text", "image"], [video("mp4")[0], "a clip", png()])
        for trainer in (strict, twin):
            train(trainer, *first)
        before = snapshot(strict)
        bad_modalities = ["text", "image", "image", "audio"]
        bad_contents = ["fine", png(), pygame_file("boom.wav"), b""]
        with pytest.raises(MediaError, match=r"contents\[2\]: not a JPEG, PNG or WebP file") as caught:
            strict.step(bad_modalities, bad_contents, TrainerStepConfig(stats=TrainerStepStats()))
        assert caught.value.item == 2 and isinstance(caught.value, ValueError)
        assert strict.steps_taken == 1
        assert_same(snapshot(strict), before)
        with pytest.raises(MediaError, match=r"contents\[0\]"):  # the deferred verb answers the same error
            strict.deferred(executor).step(["audio"], [b"RIFF" + bytes(40)]).result()
        assert strict.steps_taken == 1
        assert_same(snapshot(strict), before)

        a, _, _ = train(strict, *second)
        b, _, _ = train(twin, *second)
        assert a == b and a is not None and a.step == 2
        assert_same(snapshot(strict), snapshot(twin))
    finally:
        strict.close()
        twin.close()


# ---- 7. a slow decode ------------------------------------------------------------------------------------


# The slow sample is over the default pixel limit (which refuses it from its header at once): the time-limit
# tests decode it under this one.
SLOW_PIXELS = 8000 * 8000


def slow_png() -> bytes:
    """A genuinely slow image: scikit-image's astronaut blown up to 8000 x 8000 RGBA, as a PNG. It is small
    on disk (flat runs compress well) but inflates to 256 MB of pixels before it can be downscaled."""
    big = photo("astronaut.png").convert("RGBA").resize((8000, 8000), Image.Resampling.NEAREST)
    out = io.BytesIO()
    big.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def test_a_slow_decode_cannot_hang_a_step(executor: Executor) -> None:
    slow = slow_png()
    started = time.perf_counter()
    decode_item("image", slow, {"patch_side": 16, "channels": 4}, 127, MediaLimits(max_pixels=SLOW_PIXELS))
    slow_seconds = time.perf_counter() - started
    timeout = min(0.25, slow_seconds / 4)
    if timeout < 0.05:
        pytest.skip(f"the slow sample decodes in {slow_seconds:.2f} s here: too fast to time out honestly")
    limits = MediaLimits(timeout_seconds=timeout, max_pixels=SLOW_PIXELS)
    trainer = Trainer.init_vram(
        executor, media_config(video_side=0, audio=0), media=MediaPolicy(workers=1, limits=limits)
    )
    try:
        st, _, warned = train(trainer, ["image", "text"], [jpeg(), "warm"])  # the worker is up and warm
        assert st is not None and not warned and st.skipped == 0
        st, _, warned = train(trainer, ["image", "image", "text"], [jpeg(), slow, "a caption"])
        assert st is not None and st.skipped == 1
        assert len(warned) == 1 and "contents[1]" in warned[0] and "timed out" in warned[0], warned
        assert finite_positive(st.masked_image_loss)
        st, _, warned = train(trainer, ["image", "text"], [png(), "after"])  # a new worker took its place
        assert st is not None and not warned and finite_positive(st.masked_image_loss)
        assert trainer.steps_taken == 3
    finally:
        trainer.close()


# ---- 8. a mixed batch ------------------------------------------------------------------------------------


def test_mixed_batch_trains_in_one_joint_step(joint_trainer: Trainer) -> None:
    items = [
        ("text", "an astronaut in a white suit"),
        ("image", jpeg()),
        ("text", "a cup of coffee"),
        ("image", png("coffee.png")),
        ("text", "a cat on a blanket"),
        ("image", webp()),
        ("text", "panning over a coffee cup"),
        ("video", video("mp4")[0]),
        ("text", "the same, in webm"),
        ("video", video("webm")[0]),
        ("text", "a boom"),
        ("audio", pygame_file("boom.wav")),
        ("text", "a whiff, in opus"),
        ("audio", opus_webm("whiff.wav")),
        ("video", b"\x1a\x45\xdf\xa3 not really a webm"),
        ("text", "an orphan caption"),
    ]
    relations = pairs(len(items), [(i, i + 1) for i in range(0, 14, 2)])
    joint_trainer.notices = Notices()
    st, out, warned = train(
        joint_trainer, [m for m, _ in items], [c for _, c in items], relations=relations, arena=True
    )
    assert st is not None and out is not None
    assert len(warned) == 1 and "contents[14]" in warned[0]
    assert st.skipped == 1 and st.dropped == 0
    for name in ("loss", "contrastive_loss", "masked_text_loss", "masked_image_loss"):
        assert finite_positive(getattr(st, name)), (name, st)
    assert finite_positive(st.masked_video_loss) and finite_positive(st.masked_audio_loss)
    assert out.shape == (len(items), 128) and torch.isfinite(out).all()
    norms = out.norm(dim=1)
    placed = [i for i in range(len(items)) if i != 14]
    torch.testing.assert_close(norms[placed], torch.ones(len(placed)))
    assert (out[14] == 0).all()


# ---- 9. modalities out of the run ------------------------------------------------------------------------


def test_modalities_out_of_the_run_are_refused(executor: Executor) -> None:
    trainer = Trainer.init_vram(executor, media_config(video_side=0, audio=0), media=MediaPolicy(workers=1))
    text_only = Trainer.init_vram(executor, media_config(image=0, video_side=0, audio=0))
    try:
        cases = [
            (trainer, ["image", "video"], [jpeg(), video("mp4")[0]], r"modalities\[1\].*video.*patch_side"),
            (
                trainer,
                ["text", "image", "audio"],
                ["a", jpeg(), pygame_file("boom.wav")],
                r"modalities\[2\].*chunk_samples",
            ),
            (text_only, ["text", "text", "image"], ["a", "b", jpeg()], r"modalities\[2\].*image.*patch_side"),
        ]
        for run, modalities, contents, pattern in cases:
            with pytest.raises(ValueError, match=pattern):
                run.step(modalities, contents, TrainerStepConfig(stats=TrainerStepStats()))
            assert run.steps_taken == 0
        st, _, warned = train(trainer, ["image", "text"], [jpeg(), "still fine"])
        assert st is not None and st.step == 1 and not warned and finite_positive(st.masked_image_loss)
    finally:
        trainer.close()
        text_only.close()
