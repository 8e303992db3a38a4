"""The loader in a process of its own (`uform.runtime.loading.LoaderProcess`): the very steps and positions of
the in-process `Loader`, resumable from a state, its refusals raised in the loop, and `fit` bitwise the same
either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import uform
from uform.replica.checkpoint import read_checkpoint
from uform.run_config import read_run_config
from uform.runtime.loading import AHEAD, LoaderProcess, by_path
from uform.sources import Loader, open_source

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "examples" / "image_text.toml"
PAIRS = ROOT / "examples" / "text_pairs.toml"


def same_steps(a: Loader, b: LoaderProcess, steps: int) -> None:
    for _ in range(steps):
        x, y = a.next_step(), b.next_step()
        assert (x.step, x.records, x.modalities, x.contents) == (y.step, y.records, y.modalities, y.contents)
        assert list(x.config.bags) == list(y.config.bags)
        for name in ("attract", "repel"):
            ex, ey = getattr(x.config.relations, name), getattr(y.config.relations, name)
            assert list(ex.offsets) == list(ey.offsets) and list(ex.ids) == list(ey.ids)
        assert a.state() == b.state() and a.step == b.step


@pytest.mark.parametrize("example", [IMAGES, PAIRS])
def test_a_loader_process_answers_the_steps_and_positions_of_the_loader(example: Path) -> None:
    run = read_run_config(example)
    assert run.data is not None
    spec, fields = list(run.data.train), dict(run.data.fields)
    with LoaderProcess(spec, fields, run.trainer, devices=2) as process:
        same_steps(Loader(open_source(spec, fields=fields), run.trainer, devices=2), process, 2 * AHEAD)
        state = process.state()
    # Resumed from a position, over one rank of two: what that rank's own loader reads.
    with LoaderProcess(spec, fields, run.trainer, rank=1, world=2, devices=2, state=state) as process:
        loader = Loader(open_source(spec, fields=fields), run.trainer, rank=1, world=2, devices=2, state=state)
        same_steps(loader, process, 4)


def test_a_refused_record_raises_in_the_loop_and_a_bad_state_at_once(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"q": "a", "a": "b", "surprise": "c"}) + "\n")
    run = read_run_config(PAIRS)
    with (
        LoaderProcess([str(data)], {"q": "text", "a": "text"}, run.trainer) as process,
        pytest.raises(ValueError, match="surprise"),
    ):
        process.next_step()
    with pytest.raises(ValueError, match="loader state"):
        LoaderProcess([str(data)], {"q": "text", "a": "text"}, run.trainer, state={"version": 99})
    with pytest.raises(TypeError, match="path"):
        LoaderProcess([{"q": "a"}], {"q": "text"}, run.trainer)
    assert by_path("x.jsonl") and by_path(["a", tmp_path]) and not by_path([]) and not by_path([{"q": "a"}])


def test_fit_is_bitwise_the_same_with_the_loader_in_a_process(tmp_path: Path) -> None:
    overrides = ["trainer.schedule.steps=4"]
    inline = uform.fit(IMAGES, tmp_path / "inline", overrides=overrides, loader_process=False, log=None)
    split = uform.fit(IMAGES, tmp_path / "p", overrides=overrides, loader_process=True, stop_after=2, log=None)
    assert split.step == 2
    rest = uform.fit(IMAGES, tmp_path / "p", overrides=overrides, loader_process=True, resume="latest", log=None)
    assert rest.checkpoint is not None and inline.checkpoint is not None
    a = read_checkpoint(rest.checkpoint, None, 10, "cpu")[0]
    b = read_checkpoint(inline.checkpoint, None, 10, "cpu")[0]
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="loader_process"):
        uform.fit(IMAGES, tmp_path / "q", data=[{"id": "x", "image": b"", "caption": "c"}], loader_process=True)
