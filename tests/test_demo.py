"""`uform.demo`: the pairs it builds from CPython's documentation, its split, and a shortened run end to end."""

from __future__ import annotations

import io
import math

import pytest
import torch

from uform import Executor
from uform.demo import DEFAULTS, held_out_split, load_pairs, load_paragraphs, run_demo

torch.set_num_threads(2)

TINY = dict(steps=12, depth=1, hidden=128, rows=16, columns=64, segments=16, max_paragraphs=200)


def test_pairs_are_real_prose() -> None:
    paragraphs = load_paragraphs()
    pairs = load_pairs()
    assert len(paragraphs) > 500 and len(pairs) > 300
    assert len(set(paragraphs)) == len(paragraphs)
    openings = [q for q, _ in pairs]
    assert len(set(openings)) == len(openings)
    for query, document in pairs:
        assert len(query) >= 20 and len(document) >= 60
        assert query.endswith((".", "!", "?")) and "\n" not in query + document
        assert f"{query} {document}" in paragraphs
        assert "::=" not in document and ">>>" not in document


def test_held_out_split_is_keyed_and_disjoint() -> None:
    train, held = held_out_split(500, seed=3)
    assert len(held) == 50 and len(train) == 450
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(range(500))
    again = held_out_split(500, seed=3)
    assert (again[0] == train).all() and (again[1] == held).all()
    assert set(held_out_split(500, seed=4)[1]) != set(held)


def test_run_demo_shortened_end_to_end() -> None:
    out = io.StringIO()
    metrics = run_demo(**TINY, seed=1, executor=Executor.cpu(), out=out)
    assert set(metrics) == {"before", "after"}
    for phase in metrics.values():
        assert set(phase) == {"recall@1", "recall@10", "mrr"}
        for value in phase.values():
            assert math.isfinite(value) and 0.0 <= value <= 1.0
        assert phase["recall@1"] <= phase["recall@10"]
    text = out.getvalue()
    lines = text.splitlines()
    assert any(line.startswith("before training: recall@1 ") for line in lines)
    assert any(line.startswith("after training : recall@1 ") for line in lines)
    assert f"] {TINY['steps']}/{TINY['steps']} loss " in text and "steps/s" in text
    assert "no room" not in text
    before = text.index("before training")
    assert before < text.index(f"{TINY['steps']}/{TINY['steps']}") < text.index("after training")


def test_run_demo_closes_the_loop_through_a_checkpoint(tmp_path) -> None:
    """train -> save -> load -> encode -> evaluate: the loaded model scores what the live network scored."""
    out = io.StringIO()
    path = tmp_path / "demo.safetensors"
    metrics = run_demo(
        **{**TINY, "steps": 4}, seed=3, executor=Executor.cpu(), progress=False, out=out, checkpoint=path
    )
    assert set(metrics) == {"before", "after", "loaded"}
    for key, value in metrics["after"].items():
        assert metrics["loaded"][key] == pytest.approx(value, abs=1e-6), key
    assert f"loaded {path}: recall@1 " in out.getvalue()


def test_run_demo_is_reproducible_and_quiet_without_progress() -> None:
    first, second = io.StringIO(), io.StringIO()
    a = run_demo(**{**TINY, "steps": 4}, seed=2, executor=Executor.cpu(), progress=False, out=first)
    b = run_demo(**{**TINY, "steps": 4}, seed=2, executor=Executor.cpu(), progress=False, out=second)
    assert a == b
    assert "steps/s" not in first.getvalue() and first.getvalue() == second.getvalue()


@pytest.mark.parametrize(
    ("overrides", "name"),
    [({"steps": 0}, "steps"), ({"segments": 1}, "segments"), ({"max_paragraphs": 2}, "max_paragraphs")],
)
def test_run_demo_refuses_bad_arguments(overrides: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}:"):
        run_demo(**{**TINY, **overrides}, executor=Executor.cpu(), out=io.StringIO())


def test_defaults_are_the_documented_ones() -> None:
    import inspect

    parameters = inspect.signature(run_demo).parameters
    for name, value in DEFAULTS.items():
        assert parameters[name].default == value
