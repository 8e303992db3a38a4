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


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"uform {uform.__version__}"


def test_demo_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY, "--seed", "5", "--max-paragraphs", "120", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "before training: recall@1 " in out and "after training : recall@1 " in out
    assert "] 3/3 loss " in out and "Executor(cpu)" in out


def test_demo_save_loads_and_evaluates_the_checkpoint(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.safetensors"
    assert main(["demo", *TINY, "--max-paragraphs", "120", "--cpu", "--quiet", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"loaded {path}: recall@1 " in out and path.is_file()
    assert uform.load(path).step == 3


def test_demo_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY, "--max-paragraphs", "120", "--cpu", "--quiet"]) == 0
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
