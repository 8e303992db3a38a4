"""The code stays as the project's linters and type checker want it (ruff and mypy, pyproject settings)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import MYPY_RUN, mypy_command

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize(
    "command", [["ruff", "check", "."], ["ruff", "format", "--check", "."]], ids=["lint", "format"]
)
def test_ruff(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy(request: pytest.FixtureRequest) -> None:
    """mypy over the package. tests/conftest.py starts the run once the session has collected this test, so
    that it runs beside the tests before it; where the session has not started it, the test runs it here."""
    pytest.importorskip("mypy")
    started = request.config.stash.get(MYPY_RUN, None)
    if started is None:
        result = subprocess.run(mypy_command(), cwd=ROOT, capture_output=True, text=True)
        code, out, err = result.returncode, result.stdout, result.stderr
    else:
        out, err = started.communicate()
        code = started.returncode
    assert code == 0, out + err
