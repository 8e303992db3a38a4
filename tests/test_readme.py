"""The README's code blocks, extracted and run, so they cannot drift from the library.

Python blocks run each in a fresh interpreter, in one shared temporary folder (the serving, export and HTTP
blocks read the checkpoint the training block wrote): the training block first, beside the blocks that read no
checkpoint, then the blocks that read it, side by side (each is mostly one core's worth of imports). Each runs as a plain script file, `python block_N.py`,
with no main guard, exactly as a user saves and runs it (tests/test_script_forms.py covers stdin, `-c` and
notebook cells); a uform warning (a media item skipped,
items dropped for room, a memory overshoot) is an error, so a block cannot pass by quietly doing less than it
says. The bash commands are not run here (CI runs the test command itself, from `.ci/run`); they are held to
what `.ci/run` runs, to the console script and defaults `uform demo` runs, and to the example `uform train`
runs (tests/test_fit.py runs it shortened, and reads the README's toml/jsonl record examples).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

DEMO_COMMAND = "python -m pip install torch==2.13.0 . && uform demo"
TRAIN_COMMAND = "uform train examples/text_pairs.toml --output runs/text_pairs"


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks of `language`, in order."""
    text = README.read_text(encoding="utf-8")
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M) if m.group(1) == language]


def test_bash_blocks_are_the_three_commands() -> None:
    commands = [block.strip() for block in blocks("bash")]
    assert len(commands) == 3, commands
    demo, tests, train = commands
    assert train == TRAIN_COMMAND
    from uform.cli import build_parser

    args = build_parser().parse_args(train.split()[1:])
    assert args.command == "train" and (ROOT / args.config).is_file()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert tests in ci, f"the README's test command {tests!r} is not what .ci/run runs"
    assert tests.endswith('-e ".[test]" && python -m pytest')
    assert demo == DEMO_COMMAND


def test_uform_demo_is_the_cli_demo_on_its_defaults() -> None:
    """`uform demo` runs `uform.cli.main(["demo"])`: the console script, and the demo's defaults (which
    tests/test_demo.py and tests/test_cli.py run shortened; the full run takes minutes)."""
    from uform.cli import build_parser
    from uform.demo import DEFAULTS

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"uform": "uform.cli:main"}
    args = build_parser().parse_args(["demo"])
    assert args.command == "demo" and not args.cpu and args.max_paragraphs is None
    for name, value in DEFAULTS.items():
        assert getattr(args, name) == value, name


def test_python_blocks_run_as_written(tmp_path: Path) -> None:
    code = blocks("python")
    assert len(code) == 5, "the training, serving, export, HTTP serving and several-hosts blocks"
    assert 'save("checkpoint.safetensors")' in code[0] and 'load("checkpoint.safetensors"' in code[1]
    assert 'export("checkpoint.safetensors"' in code[2]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    environment["OMP_NUM_THREADS"] = "2"
    readers = [i for i, block in enumerate(code) if i > 0 and "checkpoint.safetensors" in block]
    assert readers == [1, 2, 3], "the serving, export and HTTP blocks read the training block's checkpoint"

    def run(indices: list[int]) -> None:
        """Runs the blocks at these indices side by side; each must exit 0 and print."""
        started = []
        for i in indices:
            script = tmp_path / f"block_{i + 1}.py"
            script.write_text(code[i])
            command = [sys.executable, "-W", "error::uform.notices.UformWarning", script.name]
            pipe = subprocess.PIPE
            started.append(
                (i, subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=pipe, stderr=pipe, text=True))
            )
        finished = []
        for i, process in started:  # every block is waited for (or killed at its timeout) before any is judged
            try:
                stdout, stderr = process.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            finished.append((i, process.returncode, stdout, stderr))
        for i, status, stdout, stderr in finished:
            assert status == 0, f"README python block {i + 1}:\n{code[i]}\n{stderr[-4000:]}"
            assert stdout.strip(), f"README python block {i + 1} printed nothing"

    run([i for i in range(len(code)) if i not in readers])  # the training block, beside the several-hosts block
    assert (tmp_path / "checkpoint.safetensors").is_file()
    run(readers)


def layout_paths() -> set[str]:
    text = README.read_text(encoding="utf-8")
    table = text[text.index("## Layout") :]
    return set(re.findall(r"`(uform/[\w/.]*|bench/)`", table))


@pytest.mark.parametrize(
    "path",
    sorted(
        f"uform/{p.name}/" if p.is_dir() else f"uform/{p.name}"
        for p in (ROOT / "uform").iterdir()
        if (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
        or (p.is_dir() and (p / "__init__.py").is_file())
    ),
)
def test_layout_table_lists_every_module(path: str) -> None:
    assert path in layout_paths(), f"README's layout table does not list {path}"
