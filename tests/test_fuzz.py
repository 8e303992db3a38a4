"""The fuzz campaign at CI size (issue 10): step calls, valid and not, drawn by Hypothesis and by a seeded
random source, each checked against the model of the rules (tests/fuzz_calls.py): a call the model finds
broken is refused with a ValueError / TypeError naming one of the fields it breaks and changes nothing (the
trainer still equals its twin, which never saw the call); a call it finds sound steps, and the twin's same
step leaves both equal, bitwise. bench/fuzz.py runs the large campaign."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from fuzz_calls import Call, Campaign, HypothesisSource, RandomSource, draw_call, fuzz_run, violations
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uform import Executor, Trainer


@pytest.fixture(scope="module")
def campaign(executor: Executor) -> Iterator[Campaign]:
    trainer, twin = (Trainer.init_vram(executor, fuzz_run()) for _ in range(2))
    try:
        yield Campaign(trainer, twin)
    finally:
        trainer.close()
        twin.close()


def _check(campaign: Campaign, calls: list[Call]) -> None:
    seen = len(campaign.problems), len(campaign.unnamed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # items dropped or cut for room are expected here
        for call in calls:
            campaign.run(call)
    assert campaign.unnamed[seen[1] :] == [], "refusals that name no field"
    assert campaign.problems[seen[0] :] == []


@settings(
    derandomize=True,
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_hypothesis_calls_follow_the_model(campaign: Campaign, data: st.DataObject) -> None:
    source = HypothesisSource(data)
    _check(campaign, [draw_call(source, p_bad=0.1) for _ in range(2)])


def test_random_calls_follow_the_model(campaign: Campaign) -> None:
    source = RandomSource(2026)
    before = dict(campaign.tally)
    _check(campaign, [draw_call(source) for _ in range(200)])
    accepted = campaign.tally["accepted"] - before.get("accepted", 0)
    refused = campaign.tally["refused"] - before.get("refused", 0)
    assert accepted >= 40 and refused >= 40, (accepted, refused)  # the campaign exercises both verdicts


# --------------------------------------------------------------------------------------------------
# The model itself: it must tell the cases apart, or the campaign above proves nothing.


def _call(**config: object) -> Call:
    from uform import TrainerStepConfig

    return Call("on", ["text"] * 3, ["a", "b", "c"], TrainerStepConfig(**config), 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, set()),
        ({"bags": [0, 1, 2**32 - 1]}, set()),
        ({"bags": 5}, {"bags"}),
        ({"bags": [0, 1, 2**63]}, {"bags"}),
        ({"temperature_groups": np.array([0, 1, 2])}, set()),
        ({"temperature_groups": [0, 1, 3]}, {"temperature_groups"}),
        ({"sides": ["query", np.int64(2), 0]}, set()),
        ({"sides": ["query", "sideways", 0]}, {"sides"}),
        ({"choices": [b"ab", b"", b""], "choice_targets": [[0.5, 0.5], [], []]}, set()),
        ({"choices": [b"aa", b"", b""], "choice_targets": [[0.5, 0.5], [], []]}, {"choices"}),
        ({"choices": [b"ab", b"", b""]}, {"choice_targets"}),
        ({"outputs_scalar": "f64"}, {"outputs_scalar"}),
    ],
)
def test_the_model_judges_fields(config: dict, expected: set[str]) -> None:
    assert violations(_call(**config)) == expected


def test_the_model_judges_relations_and_items() -> None:
    from uform import Edges, Relations

    good = Relations(attract=Edges(offsets=[0, 1, 2, 2], ids=[1, 0]))
    assert violations(_call(relations=good)) == set()
    selfish = Relations(attract=Edges(offsets=[0, 1, 1, 1], ids=[0]))
    assert violations(_call(relations=selfish)) == {"relations"}
    assert violations(Call("on", ["text"] * 2, ["a", "\ud800"], None, 2)) == {"contents"}
    assert violations(Call("on", ["text", "image"], ["a", "b"], None, 2)) == {"modalities"}


def test_the_bench_runs_a_small_campaign(tmp_path) -> None:
    """bench/fuzz.py, the large campaign, at a size of twenty calls (its numbers are BENCHMARKS' business)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("bench_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--calls", "20", "--seed", "3", "--out", str(tmp_path)])
    assert results["accepted"] + results["refused"] == 20
    assert results["refused_naming_no_field"] == 0 and results["problems"] == 0, results
    assert json.loads((tmp_path / "bench-fuzz.json").read_text())["calls"] == 20
