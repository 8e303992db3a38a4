"""ONNX export of `encode` (issue 15, item 3): `uform export --onnx` writes `model.onnx`; onnxruntime's vectors
match `Model.encode`'s within 1e-4 of cosine on the CPU, for text and images, at the full and a Matryoshka width;
a swapped graph is refused; the folder still serves through `uform.load`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from export_cases import IMAGES, trained_run

import uform
from uform import CheckpointError
from uform.cli import main
from uform.media.decode import MediaPolicy
from uform.media.limits import MediaError

onnxruntime = pytest.importorskip("onnxruntime")
from uform.onnx_encoder import OnnxEncoder  # noqa: E402

torch.set_num_threads(2)
ONE = MediaPolicy(workers=1)  # one decoder process: the tests' images are few and small

TEXTS = ["a small red circle at the top left", "a large blue square in the centre", "", "y" * 300, "ok"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("onnx")
    out = base / "model"
    assert main(["export", str(trained_run(base / "run")), str(out), "--onnx"]) == 0
    return out


def test_onnxruntime_matches_encode_for_text_and_images(folder: Path) -> None:
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.onnx", "model.safetensors"]
    images = [p.read_bytes() for p in sorted(IMAGES.iterdir())[:6]]
    mods = ["text"] * len(TEXTS) + ["image"] * len(images)
    contents = [t.encode() for t in TEXTS] + images
    with uform.load(folder, media=ONE) as model, OnnxEncoder(folder, threads=2, media=ONE) as graph:
        for width in (None, 32):
            want = model.encode(mods, contents, width)
            got = graph.encode(mods, contents, width)
            assert got.shape == want.shape
            cosine = (want * got).sum(dim=1)
            assert cosine.min() > 1 - 1e-4, cosine
        assert graph.notices.count("capacity.truncated") == 2  # the long text, cut as Model cuts it, both calls
        with pytest.raises(MediaError, match=r"contents\[1\]"):
            graph.encode(["text", "image"], [b"fine", b"not an image"])
    assert "model.onnx" in (folder / "README.md").read_text()


def test_a_swapped_graph_is_refused(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(folder):
        (copy / name).write_bytes((folder / name).read_bytes())
    raw = bytearray((copy / "model.onnx").read_bytes())
    raw[len(raw) // 2] ^= 1
    (copy / "model.onnx").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.onnx: changed since the export"):
        OnnxEncoder(copy)
    with uform.load(copy) as model:  # the weights and config are intact: the torch path serves
        assert model.encode(["text"], [b"fine"]).shape == (1, 128)


def test_a_folder_without_a_graph_says_so(tmp_path: Path, folder: Path) -> None:
    plain = tmp_path / "plain"
    checkpoint = next((folder.parent / "run" / "checkpoints").iterdir())
    uform.export(checkpoint, plain)
    with pytest.raises(CheckpointError, match="exported without --onnx"):
        OnnxEncoder(plain)


def test_encode_inputs_are_checked(folder: Path) -> Any:
    with OnnxEncoder(folder) as graph:
        with pytest.raises(ValueError, match=r"^width: must lie in \[1, hidden = \d+\], got 0$"):
            graph.encode(["text"], [b"x"], 0)
        with pytest.raises(TypeError, match=r"^width: expected an int or None, got bool$"):  # as Model.encode says it
            graph.encode(["text"], [b"x"], True)
