"""Plain scripts decode media, start preparer processes and workers (issue 10, item 4), whatever their form.

A user's script runs in a fresh interpreter in each form users write: a file with the main guard, one without
it, the same guarded file fed on standard input (``python - < script.py``), ``python -c``, and a notebook's
shape (a fresh ``__main__`` without ``__file__`` running the code with `exec`; and IPython's shell, when it is
installed, which is what a Jupyter kernel runs). Each script decodes a PNG it makes through a `DecodePool`, then
trains a step with an image in process and through a preparer process (``host_processes=1``), strictly (a decode
failure raises); the unguarded file also trains on an executor of two CPU devices (the workers's workers). Pins:
each succeeds, prints what it computed (the preparer process's loss bitwise the in-process one), its decoder has
not loaded torch (which the script's process has), and its body runs once: no process of uform's imports the
script again (before, each decoder re-ran it: a guarded file ran its body once per decoder, an unguarded one
failed with a DecodePool hint, and stdin failed even with the guard).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "SCRIPT-BODY-RAN"

BODY = """
import io
import math

import numpy as np
from PIL import Image

from uform import (
    BatchShape, Executor, ImageShape, Objective, Schedule, Trainer, TrainerInitVramConfig, TrainerStepConfig,
    TrainerStepStats,
)
from uform.media import image_units
from uform.media.decode import MediaPolicy
from uform.runtime.decoders import DecodePool

print("{marker}", flush=True)
FLEET = {fleet}


def png(seed):
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def main():
    with DecodePool(1) as pool:
        (outcome,) = pool.map(image_units, [((png(0),), dict(patch_side=8, channels=3, max_units=64))])
        (worker,) = pool.processes
        with open(f"/proc/{{worker.pid}}/maps") as maps:  # this process has loaded torch (uform.Trainer)
            torch = "torch" if "libtorch" in maps.read() else "no-torch"
    print("POOL", outcome.error, outcome.value.values.shape, torch, flush=True)
    config = TrainerInitVramConfig(
        depth=1, hidden=128, objective=Objective.Masked, seed=3,
        batch=BatchShape(max_rows_per_device=2, max_segments_per_device=4, max_columns_per_row=64,
                         image=ImageShape(patch_side=16)),
        schedule=Schedule(steps=4, warmup_steps=1),
    )
    strict = MediaPolicy(strict=True, workers=1)
    for hosts in (0, 1):
        trainer = Trainer.init_vram(Executor.cpu(), config, media=strict, host_processes=hosts)
        stats = TrainerStepStats()
        trainer.step(["image", "text"], [png(1), "a test pattern"], TrainerStepConfig(stats=stats))
        trainer.close()
        print(f"TRAINED hosts={{hosts}} skipped={{stats.skipped}} loss={{stats.loss!r}}", flush=True)
    if FLEET:
        two = Executor.cpu(workers=2)
        trainer = Trainer.init_vram(two, config, media=strict, host_processes=0)
        stats = TrainerStepStats()
        modalities = ["image", "text", "image", "text"]
        contents = [png(1), "a test pattern", png(2), "another"]
        trainer.step(modalities, contents, TrainerStepConfig(bags=[0, 0, 1, 1], stats=stats))
        trainer.close()
        two.close()
        print(f"FLEET skipped={{stats.skipped}} finite={{math.isfinite(stats.loss)}}", flush=True)
"""


def script(guarded: bool, fleet: bool) -> str:
    tail = 'if __name__ == "__main__":\n    main()\n' if guarded else "main()\n"
    return BODY.format(marker=MARKER, fleet=fleet) + "\n" + tail


def run(command: list[str], cwd: Path, stdin: str | None = None) -> str:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, input=stdin, capture_output=True, text=True, env=env, cwd=cwd, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout


def check(out: str, fleet: bool) -> None:
    assert out.count(MARKER) == 1, out  # the body ran once: no child imported the script
    # 40x24 pixels: 5x3 patches of 8x8x3; the decoder never loaded torch, which the script's process did
    assert re.search(r"^POOL None \(15, 192\) no-torch$", out, re.M), out
    losses = dict(re.findall(r"^TRAINED hosts=(\d) skipped=0 loss=(\S+)$", out, re.M))
    assert set(losses) == {"0", "1"}, out
    assert losses["0"] == losses["1"], out  # the preparer process's step is bitwise the in-process one
    assert ("FLEET skipped=0 finite=True" in out) == fleet, out


@pytest.mark.parametrize(
    ("form", "guarded", "fleet"),
    [("file", True, False), ("file", False, True), ("stdin", True, False), ("-c", False, False)],
)
def test_a_script_in_each_form_decodes_and_trains(tmp_path: Path, form: str, guarded: bool, fleet: bool) -> None:
    source = script(guarded, fleet)
    if form == "file":
        path = tmp_path / "train.py"
        path.write_text(source)
        out = run([sys.executable, str(path)], tmp_path)
    elif form == "stdin":
        out = run([sys.executable, "-"], tmp_path, stdin=source)
    else:
        out = run([sys.executable, "-c", source], tmp_path)
    check(out, fleet)


def test_a_notebook_cell_decodes_and_trains(tmp_path: Path) -> None:
    """A cell's code run with `exec` in a fresh ``__main__`` that has no file (as a kernel runs it)."""
    cell = tmp_path / "cell.py"
    cell.write_text(script(guarded=False, fleet=False))
    runner = (
        "import sys, types\n"
        "main = types.ModuleType('__main__')\n"
        "sys.modules['__main__'] = main\n"
        f"exec(compile(open({str(cell)!r}).read(), '<cell 1>', 'exec'), main.__dict__)\n"
    )
    check(run([sys.executable, "-c", runner], tmp_path), fleet=False)


@pytest.mark.skipif(importlib.util.find_spec("IPython") is None, reason="IPython is not installed")
def test_an_ipython_shell_decodes_and_trains(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "IPython",
        "--quick",
        "--no-banner",
        "--colors=NoColor",
        "-c",
        script(False, False),
    ]
    out = run(command, tmp_path)
    check(out, fleet=False)
