"""`uform.cli.main(argv)` in-process, and `python -m uform` as a process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import uform
from uform.cli import main

torch.set_num_threads(2)

TINY = ["--steps", "3", "--depth", "1", "--hidden", "128", "--rows", "16", "--columns", "64", "--segments", "8"]
TEXT = [*TINY, "--part", "text"]  # the text part alone, where the image part would only add time


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"uform {uform.__version__}"


def test_demo_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY, "--image-steps", "2", "--seed", "5", "--max-paragraphs", "120", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "before training: recall@1 " in out and "after training : recall@1 " in out
    assert "] 3/3 loss " in out and "Executor(cpu)" in out
    # The default runs both parts: the image part's lines both ways, then the summary beside chance.
    assert "uform demo (images): " in out and "] 2/2 loss " in out
    for direction in ("text->image", "image->text"):
        assert f"after training , {direction}: recall@1 " in out
    summary = out[out.index("held-out retrieval after training (chance in brackets):") :]
    assert "text, sentence -> rest of paragraph: recall@1 " in summary
    assert "images, text->image" in summary and "images, image->text" in summary


def test_demo_image_part_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--part", "image", "--image-steps", "2", "--depth", "1", "--cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "image->text: recall@1 " in out and "chance: recall@1 0.031  recall@5 0.156" in out
    assert "before training: recall@1 " not in out and "pydoc" not in out and "summary" not in out


def test_demo_save_needs_the_text_part(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--part", "image", "--save", "x.safetensors"]) == 2
    assert "--save" in capsys.readouterr().err


def test_demo_save_loads_and_evaluates_the_checkpoint(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.safetensors"
    assert main(["demo", *TEXT, "--max-paragraphs", "120", "--cpu", "--quiet", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"loaded {path}: recall@1 " in out and path.is_file()
    assert uform.load(path).step == 3


def test_demo_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TEXT, "--max-paragraphs", "120", "--cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "steps/s" not in out and "after training" in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nonsense"],
        ["demo", "--steps", "0"],
        ["demo", "--steps", "many"],
        ["demo", "--seed", "-1"],
        ["demo", "--bogus"],
        ["demo", "--part", "audio"],
        ["demo", "--image-steps", "0"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage: uform" in capsys.readouterr().err


def test_library_refusal_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY, "--max-paragraphs", "2", "--cpu"]) == 2
    assert "max_paragraphs:" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "--steps" in capsys.readouterr().out


def test_python_dash_m() -> None:
    result = subprocess.run([sys.executable, "-m", "uform", "version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"uform {uform.__version__}"
