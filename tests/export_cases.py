"""A small trained run for the export, encode, ONNX and vector-index tests: the image-text example trained three
steps through `uform train` (depth 2, hidden 128), with an eval record appended to its metrics, and a JSONL
manifest of text and image records that includes an undecodable image and a missing one."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

from uform.cli import main
from uform.run_dir import MetricsWriter

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "image_text.toml"
IMAGES = ROOT / "examples" / "image_text" / "images"
CAPTIONS = ROOT / "examples" / "image_text" / "captions.jsonl"
EVAL = {"recall@1": 0.25, "mrr": 0.4375}


@functools.cache
def _shared() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="uform-export-cases-"))
    atexit.register(shutil.rmtree, folder, True)
    return _train(folder / "run")


def trained_run(folder: Path) -> Path:
    """The checkpoint of the image-text example after three steps, its run folder's metrics holding an eval
    record; trained once per test session (the callers only read it) and copied under `folder`."""
    shutil.copytree(_shared().parents[1], folder)
    return folder / "checkpoints" / "step-00000003.safetensors"


def _train(folder: Path) -> Path:
    status = main(
        ["train", str(EXAMPLE), "--output", str(folder), "--set", "trainer.schedule.steps=3", "--devices", "cpu"]
    )
    assert status == 0
    with MetricsWriter(folder / "metrics.jsonl") as metrics:
        metrics.eval(3, EVAL)
    return folder / "checkpoints" / "step-00000003.safetensors"


def manifest(folder: Path, images: int = 4) -> tuple[Path, list[dict]]:
    """A JSONL of text records and image records (paths relative to it), then a record whose image is not an
    image and one whose file is missing; answers its path and its records."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    captions = [json.loads(line) for line in CAPTIONS.read_text().splitlines()]
    records: list[dict] = []
    for k, caption in enumerate(captions[:images]):
        name = Path(caption["image"]).name
        shutil.copy(IMAGES / name, folder / "images" / name)
        records.append({"id": f"text-{k}", "text": caption["caption"]})
        records.append({"id": f"image-{k}", "image": f"images/{name}"})
    (folder / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a picture" * 8)
    records.append({"id": "broken", "image": "images/broken.png"})
    records.append({"id": "missing", "image": "images/nowhere.png"})
    records.append({"id": "last", "text": "a large green square"})
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records
