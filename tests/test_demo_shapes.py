"""`uform.demo_shapes`: the drawn pictures say what their captions say, the split is keyed, and the image
part of the demo runs end to end in-process (tiny) with finite figures both ways."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from uform import Executor
from uform.demo_shapes import COLOURS, PLACES, SHAPES, SIZES, Scene, draw_scene, run_image_demo, scenes, split_scenes

torch.set_num_threads(2)

TINY = dict(steps=3, depth=1, hidden=128, side=24, patch_side=8, rows=16, columns=64, segments=16)


def _read(scene: Scene, side: int, seed: int) -> tuple[np.ndarray, str]:
    """The scene's pixels [side, side, 3] as decoded from its bytes, and the container Pillow saw."""
    picture = Image.open(io.BytesIO(draw_scene(scene, side, np.random.default_rng(seed))))
    return np.asarray(picture.convert("RGB")), str(picture.format)


# The test's own words for what it sees, independent of the module's tables: nearest prototype colour, and
# the cell of the grid by its row and column words.
PROTOTYPES = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "purple": (128, 0, 255),
    "white": (255, 255, 255),
}
ROW_WORDS, COLUMN_WORDS = ("top", "centre", "bottom"), ("left", "centre", "right")


def _seen(pixels: np.ndarray) -> tuple[str, str, str, str]:
    """(size, colour, shape, place) read back from the pixels alone, in the caption's words."""
    side = pixels.shape[0]
    mask = pixels.max(axis=-1) > 100  # the background is a grey darker than 60; every colour has a bright channel
    mean = pixels[mask].mean(axis=0)
    colour = min(PROTOTYPES, key=lambda name: float(((mean - PROTOTYPES[name]) ** 2).sum()))
    ys, xs = np.nonzero(mask)
    width = xs.max() - xs.min() + 1
    fill = mask.sum() / (width * (ys.max() - ys.min() + 1))  # square ~1, circle ~pi/4, triangle ~1/2
    shape = "square" if fill > 0.9 else "circle" if fill > 0.65 else "triangle"
    # The size classes' half-sides are at most 0.10 and at least 0.14 of the side: the box's width parts them.
    size = "small" if width <= 2 * 0.12 * side else "large"
    row, column = ROW_WORDS[int(ys.mean() * 3 // side)], COLUMN_WORDS[int(xs.mean() * 3 // side)]
    place = "centre" if row == column == "centre" else f"{row} {column}"
    return size, colour, shape, place


@pytest.mark.parametrize("side", [48, 96])
def test_every_caption_says_what_the_pixels_show(side: int) -> None:
    every = scenes()
    assert len(every) == len(SHAPES) * len(COLOURS) * len(SIZES) * len(PLACES)
    assert len({scene.caption for scene in every}) == len(every)
    for i, scene in enumerate(every):
        pixels, container = _read(scene, side, seed=i)
        assert container == "PNG" and pixels.shape == (side, side, 3)
        size, colour, shape, place = _seen(pixels)
        assert f"a {size} {colour} {shape} at the {place}" == scene.caption


def test_pictures_are_deterministic_from_the_seed() -> None:
    scene = Scene(shape=2, colour=1, size=1, place=4)
    assert draw_scene(scene, 48, np.random.default_rng(7)) == draw_scene(scene, 48, np.random.default_rng(7))
    drawn = {draw_scene(scene, 48, np.random.default_rng(seed)) for seed in range(8)}
    assert len(drawn) > 1  # the jitter, size and shade vary between draws


def test_split_is_keyed_disjoint_and_whole() -> None:
    train, held = split_scenes(seed=0)
    assert len(held) == round(0.1 * len(scenes())) and len(train) + len(held) == len(scenes())
    assert {s.caption for s in train}.isdisjoint(s.caption for s in held)
    assert split_scenes(seed=0) == (train, held)
    assert split_scenes(seed=1)[1] != held
    # Training still sees every word: each colour, shape, size and place appears among the training scenes.
    for field, names in (("shape", SHAPES), ("colour", COLOURS), ("size", SIZES), ("place", PLACES)):
        assert {getattr(s, field) for s in train} == set(range(len(names)))


def test_image_part_end_to_end_tiny() -> None:
    out = io.StringIO()
    metrics = run_image_demo(**TINY, seed=1, executor=Executor.cpu(), out=out)
    held = len(split_scenes(seed=1)[1])
    assert set(metrics) == {"before", "after"}
    for phase in metrics.values():
        assert set(phase) == {"text->image", "image->text"}
        for figures in phase.values():
            assert set(figures) == {"recall@1", "recall@5", "mrr", "chance@1", "chance@5"}
            assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in figures.values())
            assert figures["recall@1"] <= figures["recall@5"]
            assert figures["chance@1"] == pytest.approx(1 / held) and figures["chance@5"] == pytest.approx(5 / held)
    text = out.getvalue()
    for direction in ("text->image", "image->text"):
        assert f"before training, {direction}: recall@1 " in text and f"after training , {direction}: recall@1 " in text
    assert f"] {TINY['steps']}/{TINY['steps']} loss " in text and "no room" not in text
    assert f"{held} held-out captions" in text and "chance: recall@1 " in text
    again = run_image_demo(**TINY, seed=1, executor=Executor.cpu(), progress=False, out=io.StringIO())
    assert again == metrics


@pytest.mark.parametrize(
    ("overrides", "name"),
    [({"steps": 0}, "steps"), ({"segments": 1}, "segments"), ({"side": 16}, "side")],
)
def test_image_part_refuses_bad_arguments(overrides: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}:"):
        run_image_demo(**{**TINY, **overrides}, executor=Executor.cpu(), out=io.StringIO())
