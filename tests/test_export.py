"""`uform.export` / `uform export` (issue 15, item 1): the model folder serves the checkpoint's vectors bit for bit
on the CPU, is smaller by the optimizer moments, holds the hub's layout and a model card derived from the run,
and a tampered folder (weights, config, a cut file, a companion missing) is refused by `uform.load`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_config
from export_cases import EVAL, IMAGES, trained_run
from safetensors import safe_open

import uform
from uform import CheckpointError, LateInteraction
from uform.cli import main
from uform.config import resolve, to_json
from uform.media.decode import MediaPolicy
from uform.model.network import Network
from uform.replica.checkpoint import read_layout, write_checkpoint
from uform.replica.run_schema import MOMENTS
from uform.replica.stored_model import MODEL_FILE

torch.set_num_threads(2)
ONE = MediaPolicy(workers=1)  # one decoder process: the tests' images are few and small

TEXTS = ["a small red circle at the top left", "a large blue square", "", "x" * 40]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("export")
    checkpoint = trained_run(base / "run")
    folder = base / "model"
    assert uform.export(checkpoint, folder) == str(folder)
    return {"base": base, "checkpoint": checkpoint, "folder": folder}


def items() -> tuple[list[str], list[bytes]]:
    images = [p.read_bytes() for p in sorted(IMAGES.iterdir())[:3]]
    return ["text"] * len(TEXTS) + ["image"] * len(images), [t.encode() for t in TEXTS] + images


def data_bytes(path: Path) -> int:
    """The bytes of a safetensors file's tensors (past its 8-byte length and JSON header)."""
    raw = path.read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def test_the_folder_serves_the_checkpoints_vectors_bitwise(run: dict[str, Any]) -> None:
    mods, contents = items()
    with uform.load(run["checkpoint"], media=ONE) as trained, uform.load(run["folder"], media=ONE) as exported:
        assert exported.step == trained.step == 3
        assert to_json(exported.config) == to_json(trained.config)
        for width in (64, None):
            a, b = trained.encode(mods, contents, width), exported.encode(mods, contents, width)
            assert torch.equal(a, b)
        assert torch.isfinite(a).all() and a.shape == (len(mods), 128)
    with uform.load(run["folder"] / MODEL_FILE, media=ONE) as direct:  # its model.safetensors, beside config.json
        assert torch.equal(direct.encode(mods, contents), b)


def test_the_folder_is_smaller_than_the_checkpoint_by_the_moments(run: dict[str, Any]) -> None:
    _, layout = read_layout(run["checkpoint"])
    moments = sum(
        torch.empty(shape, dtype=dtype, device="meta").nbytes
        for name, (dtype, shape) in layout.items()
        if name.startswith(MOMENTS)
    )
    assert moments > 0  # a trained checkpoint holds them
    model = run["folder"] / MODEL_FILE
    assert data_bytes(run["checkpoint"]) - data_bytes(model) == moments
    assert os.path.getsize(model) < os.path.getsize(run["checkpoint"]) - 0.9 * moments


def test_the_folder_has_the_hub_layout_and_a_card_from_the_run(run: dict[str, Any]) -> None:
    folder = run["folder"]
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    stored = uform.load(run["checkpoint"]).config
    assert json.loads((folder / "config.json").read_text()) == json.loads(to_json(stored))
    with safe_open(str(folder / MODEL_FILE), "pt") as f:  # the reference reader: plain names, hub metadata
        assert f.metadata()["format"] == "pt"
        names = set(f.keys())
        assert "tower.blocks.0.qkv.weight" in names and not any(k.startswith("moments.") for k in names)
    card = (folder / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "library_name: uform" in front and "pipeline_tag: feature-extraction" in front
    assert "- image" in front and "- text" in front
    assert "trained for 3 optimizer steps" in card
    assert "| recall@1 | 0.2500 |" in card and "| mrr | 0.4375 |" in card and "at step 3" in card
    assert f"{stored.depth} pre-norm blocks of hidden width {stored.hidden}" in card
    assert "16x16 patches" in card and "Objective `Contrastive`" in card
    assert 'uform.load("path/to/this/folder")' in card
    assert set(EVAL) <= set(card.replace("|", " ").split())


def tampered(run: dict[str, Any], name: str) -> Path:
    copy = run["base"] / name
    uform.export(run["checkpoint"], copy)
    return copy


def test_a_changed_weight_is_refused(run: dict[str, Any]) -> None:
    folder = tampered(run, "weights")
    path = folder / MODEL_FILE
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # a bit of the last tensor's data
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        uform.load(folder)


def test_a_changed_config_is_refused(run: dict[str, Any]) -> None:
    folder = tampered(run, "config")
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["batch"]["max_columns_per_row"] = 128
    path.write_text(json.dumps(config, indent=2) + "\n")
    with pytest.raises(CheckpointError, match=r"config\.json: changed since the export"):
        uform.load(folder)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: cannot be read"):
        uform.load(folder)


def test_a_cut_file_is_refused(run: dict[str, Any]) -> None:
    folder = tampered(run, "cut")
    path = folder / MODEL_FILE
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        uform.load(folder)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"holds model\.safetensors; this one does not"):
        uform.load(folder)


def test_a_refused_export_writes_nothing(run: dict[str, Any], tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        uform.export(run["checkpoint"], busy)
    assert os.listdir(busy) == ["keep.txt"]
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(run["checkpoint"].read_bytes()[:-10])
    with pytest.raises(CheckpointError):
        uform.export(broken, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["broken.safetensors", "busy"]  # no folder, no temporary left
    with pytest.raises(TypeError, match="onnx: expected a bool"):
        uform.export(run["checkpoint"], tmp_path / "out", onnx="yes")  # type: ignore[arg-type]


def test_the_cli_exports_and_reports_a_refusal(run: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "cli-model"
    assert main(["export", str(run["checkpoint"]), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    assert main(["export", str(run["checkpoint"]), str(out)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing.safetensors"), str(tmp_path / "other")]) == 2
    assert "uform export:" in capsys.readouterr().err


def test_a_late_interaction_run_exports_its_token_head(tmp_path: Path) -> None:
    """A Joint run with late interaction (written from fresh weights, as the serving tests write one): the
    folder serves the same token vectors and text choices, and its card names every term."""
    config = resolve(make_config(late_interaction=LateInteraction(weight=0.5)))
    network = Network(config)
    network.initialize(config.seed)
    checkpoint = tmp_path / "late.safetensors"
    tensors = {f"weights.{k}": v for k, v in network.state_dict().items()}
    write_checkpoint(checkpoint, tensors, {"uform.format": "uform.trainer.1", "uform.config": to_json(config)})
    folder = tmp_path / "late"
    uform.export(checkpoint, folder)
    texts = ["what is a tower", "a tower is tall"]
    with uform.load(checkpoint) as trained, uform.load(folder) as exported:
        for side in ("query", "document"):
            a, b = trained.tokens(["text"] * 2, texts, side), exported.tokens(["text"] * 2, texts, side)
            assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all()
        p, q = trained.text_choose(texts, [b"AB", b"xyz"]), exported.text_choose(texts, [b"AB", b"xyz"])
        assert (p[0] == q[0]).all() and len(p[0]) == 5
    card = (folder / "README.md").read_text()
    assert "- late-interaction" in card and "late interaction: weight 0.5" in card and "masked text: weight" in card
    assert "The run logged no evaluation" in card  # not in a run folder
