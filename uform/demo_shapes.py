"""The demo's image-text part: pictures of shapes drawn with Pillow at run time, and captions saying what is where.

A scene is one shape (circle, square or triangle) of one of six colours, small or large, centred in one of
the nine cells of a 3 x 3 grid ("top left" ... "bottom right"), on a dark background; its caption says all
four ("a small red circle at the top left"). That makes 3 x 6 x 2 x 9 = 324 captions. Every picture is
drawn afresh from a keyed generator: the centre jitters within its cell, the size within its class, the
background's shade varies, so no two pictures are the same bytes. The pictures go to the trainer as PNG
bytes, decoded by its own decoders, as a user's files would be.

Held out: a keyed tenth of the 324 captions (the *combinations*, e.g. "a large blue triangle at the centre")
is never drawn for training; training sees every colour, shape, size and place, only never together in the
held-out ways. Evaluation draws one picture per held-out caption and asks both ways, caption -> picture
and picture -> caption, for recall@1 and recall@5 among the held-out ones, against chance (k / held-out).

Training: each step draws `segments // 2` training scenes in a keyed order, item 2k the picture, item 2k + 1
its caption, attract edges both ways, every other pair of the step repelling under `Negatives.Ambient`,
scored by the pooled sigmoid loss under `Objective.Contrastive`, as the text part.
"""

from __future__ import annotations

import io
import itertools
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
from PIL import Image, ImageDraw

from .config import (
    BatchShape,
    Contrastive,
    ImageShape,
    Schedule,
    TrainerInitVramConfig,
)
from .demo import default_executor, train_pairs
from .enums import Modality, Objective, PairLossForm
from .evaluate import evaluate_retrieval
from .runtime.executor import Executor
from .serve import Model
from .trainer import Trainer

__all__ = ["COLOURS", "PLACES", "SHAPES", "SIZES", "Scene", "draw_scene", "run_image_demo", "scenes", "split_scenes"]

SHAPES = ("circle", "square", "triangle")
"""The shapes a scene draws."""
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 50, 200),
    "white": (245, 245, 245),
}
"""Colour names and the RGB they are drawn in."""
SIZES: dict[str, tuple[float, float]] = {"small": (0.07, 0.10), "large": (0.14, 0.17)}
"""Size names and the bounds of the shape's half-side, as a fraction of the picture's side."""
PLACES = (
    "top left",
    "top centre",
    "top right",
    "centre left",
    "centre",
    "centre right",
    "bottom left",
    "bottom centre",
    "bottom right",
)
"""Cell names of the 3 x 3 grid, row-major: index // 3 is the row, index % 3 the column."""

IMAGE_DEFAULTS: dict[str, Any] = {
    "steps": 200,
    "side": 48,
    "patch_side": 8,
    "rows": 32,
    "columns": 96,
    "segments": 64,
    "learning_rate": 1e-3,
}
"""The defaults of `run_image_demo` (beside `DEFAULTS` of the text part: depth, hidden and seed are shared)."""


@dataclass(frozen=True)
class Scene:
    """What one picture shows: indices into `SHAPES`, `COLOURS`, `SIZES` and `PLACES`."""

    shape: int
    colour: int
    size: int
    place: int

    @property
    def caption(self) -> str:
        """What is where, in words: "a small red circle at the top left"."""
        colour, size = list(COLOURS)[self.colour], list(SIZES)[self.size]
        return f"a {size} {colour} {SHAPES[self.shape]} at the {PLACES[self.place]}"


def scenes() -> list[Scene]:
    """Every scene (one per caption), in a fixed order."""
    ranges = (range(len(SHAPES)), range(len(COLOURS)), range(len(SIZES)), range(len(PLACES)))
    return [Scene(*combo) for combo in itertools.product(*ranges)]


def split_scenes(seed: int, fraction: float = 0.1) -> tuple[list[Scene], list[Scene]]:
    """(training, held-out) scenes: a keyed-random `fraction` of the captions held out (at least two)."""
    every = scenes()
    order = np.random.default_rng([seed, 0x5CE7E]).permutation(len(every))
    held = max(2, round(fraction * len(every)))
    return [every[i] for i in sorted(order[held:])], [every[i] for i in sorted(order[:held])]


def draw_scene(scene: Scene, side: int, rng: np.random.Generator) -> bytes:
    """A `side` x `side` RGB PNG of `scene`: the centre jittered within its cell (the shape stays inside
    the picture), the half-side drawn within its size's bounds, a dark background of a random shade."""
    low, high = SIZES[list(SIZES)[scene.size]]
    half = side * float(rng.uniform(low, high))  # the shape's half-side in pixels
    cell = side / 3
    row, column = divmod(scene.place, 3)
    jitter = 0.25 * cell
    cx = (column + 0.5) * cell + float(rng.uniform(-jitter, jitter))
    cy = (row + 0.5) * cell + float(rng.uniform(-jitter, jitter))
    cx, cy = min(max(cx, half), side - half), min(max(cy, half), side - half)
    shade = int(rng.integers(0, 60))
    picture = Image.new("RGB", (side, side), (shade, shade, shade))
    pen = ImageDraw.Draw(picture)
    colour = COLOURS[list(COLOURS)[scene.colour]]
    box = (cx - half, cy - half, cx + half, cy + half)
    if SHAPES[scene.shape] == "circle":
        pen.ellipse(box, fill=colour)
    elif SHAPES[scene.shape] == "square":
        pen.rectangle(box, fill=colour)
    else:
        pen.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=colour)
    data = io.BytesIO()
    picture.save(data, "PNG")
    return data.getvalue()


def _line(label: str, metrics: dict[str, float]) -> str:
    return f"{label}: recall@1 {metrics['recall@1']:.3f}  recall@5 {metrics['recall@5']:.3f}  mrr {metrics['mrr']:.3f}"


def run_image_demo(
    *,
    steps: int = IMAGE_DEFAULTS["steps"],
    depth: int = 2,
    hidden: int = 128,
    side: int = IMAGE_DEFAULTS["side"],
    patch_side: int = IMAGE_DEFAULTS["patch_side"],
    rows: int = IMAGE_DEFAULTS["rows"],
    columns: int = IMAGE_DEFAULTS["columns"],
    segments: int = IMAGE_DEFAULTS["segments"],
    seed: int = 0,
    learning_rate: float = IMAGE_DEFAULTS["learning_rate"],
    executor: Executor | None = None,
    progress: bool = True,
    out: TextIO | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """Trains a `depth` x `hidden` tower for `steps` steps on drawn pictures and their captions (see the
    module's docstring) and answers the held-out retrieval metrics in both directions,
    `{"before": {"text->image": {...}, "image->text": {...}}, "after": {...}}`, each with `recall@1`,
    `recall@5`, `mrr`, and `chance@1` / `chance@5` (k over the held-out count).

    Pictures are `side` pixels square in `patch_side` patches; each step packs `segments // 2` pairs into
    `rows` rows of `columns` positions, at peak `learning_rate` over a warmup and cosine `Schedule`. Runs on
    `executor` (by default the first GPU when there is one, else the CPU); writes a progress bar (when
    `progress`) and the before / after lines to `out` (default `sys.stdout`).
    """
    out = sys.stdout if out is None else out
    if steps < 1:
        raise ValueError(f"steps: must be at least 1, got {steps}")
    if segments < 2:
        raise ValueError(f"segments: a step needs at least one pair (two segments), got {segments}")
    if side < 3 * patch_side:
        raise ValueError(f"side: a picture needs at least three patches a side ({3 * patch_side}), got {side}")
    executor = default_executor() if executor is None else executor
    train, held = split_scenes(seed)
    per_step = segments // 2
    config = TrainerInitVramConfig(
        depth=depth,
        hidden=hidden,
        batch=BatchShape(
            max_rows_per_device=rows,
            max_segments_per_device=2 * per_step,
            max_columns_per_row=columns,
            image=ImageShape(patch_side=patch_side, channels=3),
        ),
        objective=Objective.Contrastive,
        contrastive=Contrastive(pair_loss=PairLossForm.Sigmoid),
        schedule=Schedule(steps=steps, learning_rate=learning_rate),
        seed=seed,
    )
    draw_rng = np.random.default_rng([seed, 0xD2A3])
    pictures = [draw_scene(scene, side, draw_rng) for scene in held]
    captions = [scene.caption for scene in held]
    relevant = list(range(len(held)))
    chance = {"chance@1": 1 / len(held), "chance@5": min(1.0, 5 / len(held))}

    trainer = Trainer.init_vram(executor, config)
    try:
        live = Model.from_trainer(trainer, segments=2 * per_step)
        image_side = ([Modality.Image] * len(held), pictures)

        def evaluate() -> dict[str, dict[str, float]]:
            return {
                "text->image": {**evaluate_retrieval(live, captions, image_side, relevant, ks=(1, 5)), **chance},
                "image->text": {**evaluate_retrieval(live, image_side, captions, relevant, ks=(1, 5)), **chance},
            }

        out.write(
            f"uform demo (images): {len(train)} training captions, {len(held)} held-out captions, "
            f"{side} x {side} pictures in {patch_side}-pixel patches, {depth} x {hidden} tower, "
            f"{steps} steps of {per_step} pairs on {executor}\n"
        )
        before = evaluate()
        for direction, metrics in before.items():
            out.write(_line(f"before training, {direction}", metrics) + "\n")
        out.flush()

        def scene(i: int, rng: np.random.Generator) -> tuple[list[Modality], list[Any]]:
            return [Modality.Image, Modality.Text], [draw_scene(train[i], side, rng), train[i].caption]

        rng = np.random.default_rng([seed, 0x1A6E])
        train_pairs(
            trainer,
            executor,
            steps=steps,
            per_step=per_step,
            count=len(train),
            pair=scene,
            rng=rng,
            out=out,
            progress=progress,
            what="items",
        )
        after = evaluate()
        for direction, metrics in after.items():
            out.write(_line(f"after training , {direction}", metrics) + "\n")
        out.write(f"chance: recall@1 {chance['chance@1']:.3f}  recall@5 {chance['chance@5']:.3f}\n")
        out.flush()
    finally:
        trainer.close()
    return {"before": before, "after": after}
