"""Draws this example's images with Pillow and writes their captions (`captions.jsonl`), the data
`examples/image_text.toml` trains on: shapes of several colours, sizes and places, each caption saying what
is where; and eight scenes none of those shows (`held_out.jsonl`, `images/held-NN.png`), which the run
evaluates on. Run it again to redraw them (`python examples/image_text/draw.py`); the tests check the committed
images are what it draws.
"""

from __future__ import annotations

import json
import os
import sys

from PIL import Image, ImageDraw

SIDE = 64
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")
PLACES = {"top left": (0.3, 0.3), "bottom right": (0.7, 0.7), "centre": (0.5, 0.5)}
SIZES = {"small": 0.18, "large": 0.34}


def scenes() -> list[tuple[str, str, str, str]]:
    """(colour, shape, place, size) of every image, a fixed list of 24 that covers each word several times."""
    out = []
    for i in range(24):
        colour = list(COLOURS)[i % 4]
        shape = SHAPES[(i // 4) % 3]
        place = list(PLACES)[(i + i // 3) % 3]
        size = list(SIZES)[(i // 2) % 2]
        out.append((colour, shape, place, size))
    return out


def held_out_scenes() -> list[tuple[str, str, str, str]]:
    """Eight scenes of the same words that `scenes()` never draws, two of each colour."""
    seen = set(scenes())
    out: list[tuple[str, str, str, str]] = []
    for i in range(len(COLOURS) * len(SHAPES) * len(PLACES) * len(SIZES)):
        scene = (
            list(COLOURS)[i % 4],
            SHAPES[(i // 4) % 3],
            list(PLACES)[(i // 12) % 3],
            list(SIZES)[(i // 36 + i) % 2],
        )
        if scene not in seen and sum(c == scene[0] for c, *_ in out) < 2:
            out.append(scene)
    return out[:8]


def draw(colour: str, shape: str, place: str, size: str) -> Image.Image:
    """One scene on a light grey ground."""
    image = Image.new("RGB", (SIDE, SIDE), (235, 235, 235))
    pen = ImageDraw.Draw(image)
    cx, cy = (SIDE * c for c in PLACES[place])
    r = SIDE * SIZES[size]
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=COLOURS[colour])
    return image


def main(folder: str) -> None:
    """Writes `folder/images/NN.png` and `folder/captions.jsonl`, `folder/images/held-NN.png` and
    `folder/held_out.jsonl`."""
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    write(folder, "captions.jsonl", "", "shape", scenes())
    write(folder, "held_out.jsonl", "held-", "held", held_out_scenes())


def write(folder: str, manifest: str, prefix: str, key: str, drawn: list[tuple[str, str, str, str]]) -> None:
    with open(os.path.join(folder, manifest), "w", encoding="utf-8") as f:
        for i, (colour, shape, place, size) in enumerate(drawn):
            name = f"images/{prefix}{i:02d}.png"
            draw(colour, shape, place, size).save(os.path.join(folder, name), optimize=True)
            caption = (
                f"a {size} {colour} {shape} at the {place}"
                if place != "centre"
                else (f"a {size} {colour} {shape} in the centre")
            )
            f.write(json.dumps({"id": f"{key}-{i:02d}", "image": name, "caption": caption}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
