"""Capacity notices (issue 10, item 10): items cut or dropped for lack of room reach the user as one
`CapacityWarning` per trainer / model and kind, shown again whenever the share lost has doubled, naming the
config field whose room ran out; every such item is counted in `notices` (and, in training, the stats).

Pins: the packer knows which limit dropped each item (rows, segments, bags, late-interaction rooms); a run
whose steps keep cutting items hears of it once, and again at twice the share; drops name
`batch.max_segments_per_device`, `batch.max_rows_per_device` or `batch.max_bags_per_device`, whichever ran out;
serving names the run's `batch.max_columns_per_row`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
from conftest import COLUMNS, make_config, overfull_texts, step_with

from uform import BatchShape, Contrastive, Executor, Objective, Trainer, TrainerStepConfig
from uform.data.pack import LIMITS, LateRoom, plan
from uform.evaluate import encode_texts
from uform.notices import CapacityWarning
from uform.serve import load


def capacity_warnings(call: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, CapacityWarning)]


def test_the_packer_names_the_limit_that_dropped_each_item() -> None:
    rng = np.random.default_rng(0)
    # Segments: three slots for five short items.
    layout = plan(np.full(5, 4), np.arange(5), rows=2, columns=16, segments=3, max_bags=0, rng=rng)
    assert layout.drops() == {"batch.max_segments_per_device": 2} and layout.dropped == 2
    # Rows: each item fills a row.
    layout = plan(np.full(4, 16), np.arange(4), rows=2, columns=16, segments=8, max_bags=0, rng=rng)
    assert layout.drops() == {"batch.max_rows_per_device": 2}
    # Bags: two bags of the four are taken, whole.
    layout = plan(np.full(6, 2), np.array([0, 0, 1, 2, 3, 3]), rows=2, columns=16, segments=8, max_bags=2, rng=rng)
    assert layout.drops() == {"batch.max_bags_per_device": layout.dropped} and layout.dropped >= 2
    # Late interaction: one document column for two documents.
    late = LateRoom(
        query=np.zeros(2, dtype=bool),
        document=np.ones(2, dtype=bool),
        prefix=np.full(2, 2),
        span=4,
        query_tokens=8,
        documents=1,
        document_tokens=64,
    )
    layout = plan(np.full(2, 6), np.arange(2), rows=2, columns=16, segments=8, max_bags=0, rng=rng, late=late)
    assert layout.drops() == {"late_interaction.max_documents_per_device": 1}
    # A skipped item is no drop; nothing lost, nothing named.
    layout = plan(
        np.full(3, 4),
        np.arange(3),
        skip=np.array([True, False, False]),
        rows=1,
        columns=16,
        segments=8,
        max_bags=0,
        rng=rng,
    )
    assert layout.drops() == {} and set(LIMITS) >= set(layout.drops())


def test_persistent_truncation_warns_once_and_again_when_the_share_doubles(make_trainer: Any) -> None:
    trainer = make_trainer(
        batch=BatchShape(max_rows_per_device=8, max_segments_per_device=8, max_columns_per_row=COLUMNS)
    )
    short = [f"item {i}" for i in range(8)]
    long = "x" * (2 * COLUMNS)

    def step(cut: int) -> list[str]:
        texts = [long] * cut + short[cut:]
        return capacity_warnings(lambda: step_with(trainer, texts))

    assert step(0) == []
    first = step(1)
    assert len(first) == 1, first
    assert first[0].startswith("uform: a step cut 1 of 8 items (12%) at the row's width")
    assert f"raise batch.max_columns_per_row (now {COLUMNS})" in first[0]
    assert step(1) == [] and step(1) == []  # the same share again: nothing more
    again = step(2)  # twice the share: shown again
    assert len(again) == 1 and "cut 2 of 8 items (25%)" in again[0]
    assert step(3) == []
    assert trainer.notices.count("capacity.truncated") == 1 + 1 + 1 + 2 + 3
    assert "capacity.dropped" not in trainer.notices.counts()


def test_drops_warn_once_naming_the_limit_that_ran_out(make_trainer: Any) -> None:
    roomy = BatchShape(max_rows_per_device=8, max_segments_per_device=8, max_columns_per_row=COLUMNS)
    trainer = make_trainer(batch=roomy)  # rows enough: only the eight segments run out
    shown = capacity_warnings(lambda: step_with(trainer, overfull_texts(12)))
    assert len(shown) == 1, shown
    assert shown[0].startswith("uform: a step dropped 4 of 12 items (33%) whole for lack of room")
    assert "batch.max_segments_per_device (4 items)" in shown[0] and "TrainerStepStats.dropped" in shown[0]
    assert capacity_warnings(lambda: step_with(trainer, overfull_texts(10))) == []  # 20%: less than twice
    answers: list[Any] = []
    shown = capacity_warnings(lambda: answers.append(step_with(trainer, overfull_texts(40))))  # 80%: over twice 33%
    assert len(shown) == 1 and "dropped 32 of 40 items (80%)" in shown[0]
    assert answers[0][0].dropped == 32
    assert trainer.notices.count("capacity.dropped") == 4 + 2 + 32

    rows = make_trainer()  # two rows of 64
    shown = capacity_warnings(lambda: step_with(rows, ["y" * 100] * 4))  # each fills one of the two rows
    assert any("dropped 2 of 4 items" in m and "batch.max_rows_per_device (2 items)" in m for m in shown), shown
    assert any("cut 2 of 4 items" in m and "batch.max_columns_per_row" in m for m in shown), shown

    bags = make_trainer(
        batch=BatchShape(
            max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=64, max_bags_per_device=1
        )
    )
    shown = capacity_warnings(
        lambda: bags.step(["text"] * 4, ["a", "b", "c", "d"], TrainerStepConfig(bags=[0, 0, 1, 1]))
    )
    assert len(shown) == 1 and "dropped 2 of 4 items" in shown[0] and "batch.max_bags_per_device (2 items)" in shown[0]


def test_serving_warns_once_about_items_cut_at_the_rows_width(tmp_path: Path) -> None:
    config = make_config(objective=Objective.Contrastive, contrastive=Contrastive(matryoshka_dimensions=(64,)))
    trainer = Trainer.init_vram(Executor.cpu(), config)
    path = tmp_path / "run.safetensors"
    trainer.save(path)
    trainer.close()
    model = load(path)
    try:
        long, short = b"z" * 200, b"short"
        shown = capacity_warnings(lambda: model.encode(["text"] * 4, [long, short, short, short]))
        assert len(shown) == 1, shown
        assert shown[0].startswith("uform: encode cut 1 of 4 items (25%) at the row's width")
        assert f"batch.max_columns_per_row ({COLUMNS} positions a row" in shown[0]
        assert capacity_warnings(lambda: model.encode(["text"] * 4, [long, short, short, short])) == []
        assert capacity_warnings(lambda: model.encode(["text"] * 2, [short, short])) == []
        again = capacity_warnings(lambda: model.encode(["text"] * 2, [long, short]))  # 50%: twice 25%
        assert len(again) == 1 and "cut 1 of 2 items (50%)" in again[0]
        assert model.notices.counts() == {"capacity.truncated": 3}
    finally:
        model.close()


def test_no_capacity_warning_when_nothing_is_lost(make_trainer: Any) -> None:
    trainer = make_trainer()
    assert capacity_warnings(lambda: step_with(trainer)) == []
    assert trainer.notices.counts() == {}


def test_evaluation_during_training_warns_through_the_trainer_once(make_trainer: Any) -> None:
    trainer = make_trainer()
    texts = ["w" * 200, "short", "x" * 300, "short too"]
    assert len(capacity_warnings(lambda: encode_texts(trainer, texts))) == 1
    assert capacity_warnings(lambda: encode_texts(trainer, texts)) == []  # a new served view, the same owner
    assert trainer.notices.count("capacity.truncated") == 4


def test_a_renumbered_step_is_counted_once(make_trainer: Any) -> None:
    """After an earlier queued step failed, a step whose prepare stage already ran is prepared anew under its new
    number (`_apply_step`); its losses are still counted once."""
    trainer = make_trainer()
    texts = ["v" * 200, "short"]
    checked = trainer.replica.check_step(["text"] * 2, texts, TrainerStepConfig(), copy_buffers=True)
    host: Future = Future()
    capacity_warnings(lambda: host.set_result(trainer.replica.prepare(checked, 2)))  # as if queued behind step 1
    assert trainer.notices.count("capacity.truncated") == 1
    capacity_warnings(lambda: trainer.replica._apply_step(checked, host, 2)())  # step 1 failed: this one becomes step 1
    assert trainer.steps_taken == 1 and trainer.notices.count("capacity.truncated") == 1
