"""The learning-rate schedule (warmup, cosine, floor) and the optimizer's parameter groups."""

from __future__ import annotations

import itertools
import math

import pytest
from conftest import make_config, step_with
from torch import nn

from uform import Schedule, resolve
from uform.model.heads import Temperatures
from uform.replica.optim import decays, learning_rate

PEAK, FLOOR = 1e-3, 1e-5


def test_warmup_is_linear_from_zero_to_the_peak() -> None:
    s = Schedule(learning_rate=PEAK, min_learning_rate=FLOOR, warmup_steps=10, steps=100)
    assert learning_rate(s, 1) == pytest.approx(PEAK / 10, rel=1e-12)
    for k in range(1, 11):
        assert learning_rate(s, k) == pytest.approx(PEAK * k / 10, rel=1e-12)
    assert learning_rate(s, 10) == PEAK
    rates = [learning_rate(s, k) for k in range(1, 11)]
    assert all(a < b for a, b in itertools.pairwise(rates))


def test_cosine_from_the_peak_to_the_floor() -> None:
    s = Schedule(learning_rate=PEAK, min_learning_rate=FLOOR, warmup_steps=10, steps=110)
    # The half cosine spans steps 10..110: its midpoint is step 60, a quarter in is step 35.
    assert learning_rate(s, 60) == pytest.approx(FLOOR + (PEAK - FLOOR) / 2, rel=1e-12)
    quarter = FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi / 4))
    assert learning_rate(s, 35) == pytest.approx(quarter, rel=1e-12)
    rates = [learning_rate(s, k) for k in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(rates))
    assert all(FLOOR <= r <= PEAK for r in rates)


@pytest.mark.parametrize("warmup", [0, 10])
def test_floor_at_and_after_the_last_step(warmup: int) -> None:
    s = Schedule(learning_rate=PEAK, min_learning_rate=FLOOR, warmup_steps=warmup, steps=100)
    assert learning_rate(s, 100) == pytest.approx(FLOOR, rel=1e-12)
    for k in (101, 150, 10_000):
        assert learning_rate(s, k) == FLOOR
    assert learning_rate(s, 99) > FLOOR


def test_no_warmup_starts_the_cosine_at_once() -> None:
    s = Schedule(learning_rate=PEAK, min_learning_rate=FLOOR, warmup_steps=0, steps=100)
    first = FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi / 100))
    assert learning_rate(s, 1) == pytest.approx(first, rel=1e-12)
    assert learning_rate(s, 50) == pytest.approx(FLOOR + (PEAK - FLOOR) / 2, rel=1e-12)
    rates = [learning_rate(s, k) for k in range(1, 101)]
    assert all(a > b for a, b in itertools.pairwise(rates))
    assert max(rates) <= PEAK


def test_warmup_fills_the_whole_run() -> None:
    s = Schedule(learning_rate=PEAK, min_learning_rate=FLOOR, warmup_steps=20, steps=20)
    assert learning_rate(s, 20) == PEAK
    assert learning_rate(s, 21) == FLOOR


@pytest.mark.parametrize(("steps", "warmup"), [(5, 0), (9, 0), (100, 10), (4000, 400), (100_000, 400)])
def test_zero_warmup_derives_a_tenth_of_steps_at_most_400(steps: int, warmup: int) -> None:
    resolved = resolve(make_config(schedule=Schedule(steps=steps))).schedule
    assert resolved.warmup_steps == warmup
    assert resolved.learning_rate == 5e-4
    assert resolved.min_learning_rate == 1e-5
    assert resolved.steps == steps


def test_stats_report_the_scheduled_rate(make_trainer) -> None:
    config = make_config(schedule=Schedule(steps=5, warmup_steps=2, learning_rate=PEAK, min_learning_rate=FLOOR))
    trainer = make_trainer(config)
    schedule = resolve(config).schedule
    for k in range(1, 8):  # past `steps`: the floor
        stats, _ = step_with(trainer, arena=False)
        assert stats.step == k
        assert stats.learning_rate == learning_rate(schedule, k)
        assert all(group["lr"] == stats.learning_rate for group in trainer.optimizer.param_groups)
    assert stats.learning_rate == FLOOR


# --------------------------------------------------------------------------------------------------
# Parameter groups


def _expected_decay(network: nn.Module) -> dict[str, bool]:
    """Each parameter's decay by what holds it: Linear weights decay; embeddings, norms, biases and
    temperatures do not."""
    expected: dict[str, bool] = {}
    for module_name, module in network.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if isinstance(module, nn.Linear):
                expected[full] = name == "weight"
            elif isinstance(module, (nn.Embedding, nn.RMSNorm, nn.LayerNorm, Temperatures)):
                expected[full] = False
            else:
                raise AssertionError(f"{full}: a parameter of an unexpected {type(module).__name__}")
    return expected


def test_decays_matrices_only(make_trainer) -> None:
    network = make_trainer().network
    expected = _expected_decay(network)
    named = dict(network.named_parameters())
    assert set(expected) == set(named)
    assert {n: decays(n, p) for n, p in named.items()} == expected
    # Each kind is represented, so the rule is exercised both ways.
    assert expected["embed.table.weight"] is False
    assert expected["temperatures.log_inverse_temperature"] is False
    assert expected["temperatures.bias"] is False
    assert expected["text_head.classifier.bias"] is False
    assert expected["tower.norm.weight"] is False
    assert expected["pooled.projection.weight"] is True
    assert any(v for k, v in expected.items() if k.startswith("tower.blocks."))


def test_optimizer_groups_follow_decays(make_trainer) -> None:
    trainer = make_trainer()
    named = dict(trainer.network.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    expected = _expected_decay(trainer.network)
    seen: list[str] = []
    for group in trainer.optimizer.param_groups:
        names = [by_id[id(p)] for p in group["params"]]
        seen += names
        for n in names:
            assert (group["weight_decay"] > 0) == expected[n], n
            if expected[n]:
                assert group["weight_decay"] == 0.01
        assert group["betas"] == (0.9, 0.98)
        assert group["eps"] == 1e-6
    assert sorted(seen) == sorted(named), "every parameter sits in exactly one group"
