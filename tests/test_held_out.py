"""Evaluation on a schedule (issue 14, item 1; issue 13's `[data] held_out`): the figures against hand-computed
values, `fit` writing them at the scheduled steps and at the end, training bitwise unchanged by them, and two CPU
devices scoring what one scores."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import uform
from uform import BatchShape, Choices, Executor, LateInteraction, Objective, Schedule, Trainer, TrainerInitVramConfig
from uform.enums import LateInteractionSide, Modality
from uform.evaluate import ranking_metrics
from uform.held_out import HeldOut
from uform.replica.checkpoint import read_checkpoint
from uform.run_config import EvalConfig, read_run_config
from uform.run_dir import read_metrics
from uform.serve import Model

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parents[1]
PAIRS = str(ROOT / "examples" / "text_pairs.toml")
WORDS = ["red circle", "blue square", "green triangle", "small star", "large moon", "pale sun"]


def config(**overrides: Any) -> TrainerInitVramConfig:
    fields: dict[str, Any] = dict(
        depth=1,
        hidden=128,
        objective=Objective.Joint,
        batch=BatchShape(
            max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=64, max_choices_per_item=4
        ),
        schedule=Schedule(steps=10, warmup_steps=2, learning_rate=1e-3),
        seed=11,
    )
    fields.update(overrides)
    return TrainerInitVramConfig(**fields)


def pairs(count: int = 6) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "q": f"what is {WORDS[i]}?", "a": f"it is a {WORDS[i]}"} for i in range(count)]


def test_ranking_metrics_against_a_matrix_worked_by_hand() -> None:
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.7, 0.1]])
    # Query 0 leaves document 0 (itself) out: it ranks 2, 3, 1; both its relevant ones first.
    # Query 1 ranks 1, 2, 0, 3: its one relevant document (0) third.
    got = ranking_metrics(scores, [[2, 3], [0]], (1, 2), ndcg=(2,), exclude=[0, -1])
    assert got == {"recall@1": 0.25, "recall@2": 0.5, "mrr": pytest.approx((1 + 1 / 3) / 2), "ndcg@2": 0.5}
    # Without the exclusion document 0 takes query 0's first place: recall@1 0, nDCG@2 = (1/log2 3) / (1 + 1/log2 3).
    plain = ranking_metrics(scores, [[2, 3], [0]], (1, 2), ndcg=(2,))
    assert plain["recall@1"] == 0.0 and plain["mrr"] == pytest.approx((0.5 + 1 / 3) / 2)
    assert plain["ndcg@2"] == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)) / 2)
    with pytest.raises(ValueError, match=r"exclude\[0\]: document 2 is one of the query's relevant"):
        ranking_metrics(scores, [[2, 3], [0]], exclude=[2, -1])


def by_hand(q: torch.Tensor, d: torch.Tensor, relevant: list[list[int]], exclude: list[int]) -> dict[str, float]:
    """Each query's ranking written out one by one (ties to the lower index), itself left out."""
    out = {"recall@1": 0.0, "recall@5": 0.0, "recall@10": 0.0, "mrr": 0.0}
    for i, rel in enumerate(relevant):
        scores = [float(q[i].double() @ d[j].double()) for j in range(len(d))]
        ranking = [j for j in sorted(range(len(d)), key=lambda j: (-scores[j], j)) if j != exclude[i]]
        for k in (1, 5, 10):
            out[f"recall@{k}"] += len(set(ranking[:k]) & set(rel)) / len(rel) / len(relevant)
        out["mrr"] += 1 / (min(ranking.index(j) for j in rel) + 1) / len(relevant)
    return out


def test_a_fixed_model_scores_what_its_embeddings_give_by_hand(make_trainer: Any) -> None:
    run = config(contrastive=uform.Contrastive(matryoshka_dimensions=(32, 128)))
    held = HeldOut.read(pairs(), {"id": "id", "q": "text", "a": "text"}, run)
    trainer = make_trainer(run)
    try:
        got = held.evaluate(trainer)
    finally:
        held.close()
    texts = [t for r in pairs() for t in (r["q"], r["a"])]
    with Model.from_trainer(trainer) as model:
        full = model.encode([Modality.Text] * len(texts), texts)
    # Item 2r is record r's question, 2r + 1 its answer: each is the other's one relevant document.
    relevant = [[i ^ 1] for i in range(len(texts))]
    exclude = list(range(len(texts)))
    for width, name in ((128, "eval/text->text"), (32, "eval/text->text@32")):
        vectors = F.normalize(full[:, :width], dim=-1)
        want = by_hand(vectors, vectors, relevant, exclude)
        for metric, value in want.items():
            assert got[f"{name}/{metric}"] == pytest.approx(value, abs=1e-9), (name, metric)
    assert f"{name}/ndcg@10" not in got  # one relevant document a query: nothing graded
    assert got["eval/loss/masked_text"] > 0 and math.isfinite(got["eval/loss/masked_text"])
    assert sorted(k.rsplit("/", 1)[0] for k in got if k.endswith("mrr")) == ["eval/text->text", "eval/text->text@32"]


def rich_run() -> TrainerInitVramConfig:
    return config(late_interaction=LateInteraction(weight=0.5, width=16), choices=Choices(weight=1.0))


def rich_records() -> list[dict[str, Any]]:
    """Late-interaction sides, two answers for some questions (graded), a named negative; then records that make
    a choice each (a choice is made by a record's one text positive)."""
    out: list[dict[str, Any]] = []
    for i in range(5):
        answers = [f"it is a {WORDS[i]}"] + ([f"a {WORDS[i]}, yes"] if i % 2 == 0 else [])
        out.append({"id": f"r{i}", "q": f"what is {WORDS[i]}?", "a": answers, "n": f"not a {WORDS[(i + 1) % 6]}"})
    for i in range(4):
        out.append({"id": f"c{i}", "p": f"is it a {WORDS[i]}?", "c": "yn", "t": [0.8, 0.2] if i % 2 else [0.1, 0.9]})
    return out


RICH_FIELDS = {
    "id": "id",
    "q": "query:text",
    "a": "document:text",
    "n": "negative:text",
    "p": "text",
    "c": "choices",
    "t": "targets",
}


def test_maxsim_graded_relevance_choices_and_masked_terms(make_trainer: Any) -> None:
    run = rich_run()
    held = HeldOut.read(rich_records(), RICH_FIELDS, run)
    trainer = make_trainer(run)
    try:
        got = held.evaluate(trainer)
    finally:
        held.close()
    for name in ("eval/text->text", "eval/text->text@maxsim"):
        assert {f"{name}/{m}" for m in ("recall@1", "recall@5", "recall@10", "mrr", "ndcg@10")} <= set(got)
    # MaxSim by hand: the questions' Query tokens against the answers' Document tokens.
    records = rich_records()
    questions = [r["q"] for r in records[:5]]
    answers = [a for r in records[:5] for a in r["a"]]
    owner = [k for k, r in enumerate(records[:5]) for _ in r["a"]]
    with Model.from_trainer(trainer) as model:
        q = model.tokens([Modality.Text] * 5, questions, LateInteractionSide.Query)
        d = model.tokens([Modality.Text] * len(answers), answers, LateInteractionSide.Document)
        scores = model.maxsim(q, d)
        probabilities, _ = model.text_choose([r["p"] for r in records[5:]], ["yn"] * 4)
    relevant = [[j for j, k in enumerate(owner) if k == i] for i in range(5)]
    want = ranking_metrics(scores, relevant, (1, 5, 10), ndcg=(10,))
    for metric, value in want.items():
        assert got[f"eval/text->text@maxsim/{metric}"] == pytest.approx(value, abs=1e-9), metric
    p = probabilities.reshape(4, 2).astype(np.float64)
    targets = np.array([r["t"] for r in records[5:]])
    kl = np.sum(targets * (np.log(targets) - np.log(p)), axis=1).mean()
    assert got["eval/choices/kl"] == pytest.approx(kl, rel=1e-6)
    assert got["eval/choices/accuracy"] == np.mean(p.argmax(1) == targets.argmax(1))
    assert got["eval/loss/masked_text"] > 0


def test_an_evaluation_changes_nothing_of_the_training_that_follows(make_trainer: Any) -> None:
    run = rich_run()
    records = rich_records()
    held = HeldOut.read(records, RICH_FIELDS, run)
    step_items = [f"what is {w}?" for w in WORDS]

    def train(evaluate: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        trainer = make_trainer(run)
        losses = []
        for _ in range(3):
            if evaluate:
                held.evaluate(trainer)
            stats = uform.TrainerStepStats()
            trainer.step([Modality.Text] * len(step_items), step_items, uform.TrainerStepConfig(stats=stats))
            losses.append(stats.loss)
        return losses, {k: v.clone() for k, v in trainer.network.state_dict().items()}

    try:
        plain_losses, plain = train(False)
        evaluated_losses, evaluated = train(True)
    finally:
        held.close()
    assert evaluated_losses == plain_losses
    assert all(torch.equal(plain[k], evaluated[k]) for k in plain)


def test_two_cpu_devices_evaluate_what_one_does_and_train_on_unchanged() -> None:
    run = rich_run()
    one, two = Executor.cpu(), Executor.cpu(workers=2)
    texts = [f"what is {w}?" for w in WORDS]
    results = []

    def train(trainer: Trainer, held: HeldOut | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        losses = []
        for _ in range(2):
            if held is not None:
                held.evaluate(trainer)
            stats = uform.TrainerStepStats()
            trainer.step([Modality.Text] * len(texts), texts, uform.TrainerStepConfig(stats=stats))
            losses.append(stats.loss)
        return losses, trainer.weights().tensors

    try:
        for executor in (one, two):
            held = HeldOut.read(rich_records(), RICH_FIELDS, run)
            trainer = Trainer.init_vram(executor, run)
            try:
                first = held.evaluate(trainer)
                again = held.evaluate(trainer)  # the second from what the first built (the workers keep it)
                results.append((first, again))
            finally:
                held.close()
                trainer.close()
        # Through the fleet too, steps after evaluations are the steps without them.
        runs = []
        for evaluator in (HeldOut.read(rich_records(), RICH_FIELDS, run), None):
            trainer = Trainer.init_vram(two, run)  # one trainer at a time on an executor's mesh
            try:
                runs.append(train(trainer, evaluator))
            finally:
                if evaluator is not None:
                    evaluator.close()
                trainer.close()
        evaluated, plain = runs
    finally:
        two.close()
    assert evaluated[0] == plain[0]
    assert all(torch.equal(evaluated[1][k], plain[1][k]) for k in plain[1])
    (a, a_again), (b, b_again) = results
    names = sorted(k for k in a if k != "eval/seconds")
    assert names == sorted(k for k in b if k != "eval/seconds")
    assert any("@maxsim" in k for k in names) and "eval/choices/kl" in names and "eval/loss/masked_text" in names
    for k in names:
        assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k
        assert a_again[k] == a[k] and b_again[k] == b[k], k


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    return read_checkpoint(path, None, 10, "cpu")[0]


def test_fit_evaluates_on_schedule_and_at_the_end_and_trains_the_same(tmp_path: Path) -> None:
    steps = ["trainer.schedule.steps=5", "trainer.objective=joint", "eval.every=2", "eval.widths=[64, 128]"]
    summary = uform.fit(PAIRS, tmp_path / "held", overrides=steps, log=None)
    records = read_metrics(tmp_path / "held" / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 5]
    assert summary.eval is not None and summary.eval == {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
    assert {"eval/text->text/recall@10", "eval/text->text@64/mrr", "eval/loss/masked_text"} <= set(summary.eval)
    assert json.loads(json.dumps(summary.eval)) == summary.eval

    # The same run without its held-out records: the same steps, the same weights.
    plain = dataclasses.replace(read_run_config(PAIRS, [*steps[:2], "data.held_out=[]"]), eval=EvalConfig())
    assert plain.data is not None and not plain.data.held_out
    bare = uform.fit(plain, tmp_path / "bare", log=None)
    assert bare.eval is None
    loss = [(r["step"], r["loss"]) for r in records if r["kind"] == "step"]
    assert loss == [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "bare" / "metrics.jsonl")]
    assert summary.checkpoint is not None and bare.checkpoint is not None
    a, b = checkpoint_tensors(summary.checkpoint), checkpoint_tensors(bare.checkpoint)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    # A call stopped early evaluates its own last step (3 here), and its resume goes on by the schedule.
    uform.fit(PAIRS, tmp_path / "split", overrides=steps, stop_after=3, log=None)
    uform.fit(PAIRS, tmp_path / "split", overrides=steps, resume="latest", log=None)
    split = [r for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in split] == [2, 3, 4, 5]
    # A call's last step is evaluated with nothing read past it: at step 2 that is a reference for the scheduled
    # evaluation of the straight run, which the loop reads ahead of (two steps in flight) but must not past.
    first = uform.fit(PAIRS, tmp_path / "two", overrides=steps, stop_after=2, log=None)
    assert first.eval is not None

    def figures(results: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in results.items() if k.startswith("eval/") and k != "eval/seconds"}

    assert figures(evals[0]) == figures(first.eval)
    assert [figures(r) for r in split if r["step"] != 3] == [figures(r) for r in evals]


def test_eval_settings_without_held_out_records_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    run = read_run_config(PAIRS, ["data.held_out=[]", "eval.every=5"])
    with pytest.raises(ValueError, match=r"^eval: the run sets \[eval\], but holds no records out"):
        uform.fit(run, tmp_path / "run", log=None)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"^data\.held_out: names no record"):
        HeldOut.read([{"q": []}], {"q": "text"}, config(), EvalConfig())
    with pytest.raises(ValueError, match=r"^data\.held_out: no record holds two positives"):
        HeldOut.read([{"q": "alone"}], {"q": "text"}, config(objective=Objective.Contrastive))


def test_the_readmes_eval_table_is_the_example_runs() -> None:
    from test_readme import blocks

    (table,) = [b for b in blocks("toml") if "[eval]" in b]
    example = Path(PAIRS).read_text().split("[data]")[0]
    run = uform.run_config.load_run_config(example + table, base=str(ROOT / "examples"))
    assert run == read_run_config(PAIRS)


def test_media_are_decoded_once_across_evaluations(make_trainer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import uform.serve_stage

    run = read_run_config(str(ROOT / "examples" / "image_text.toml"))
    assert run.data is not None
    held = HeldOut.read(list(run.data.train), dict(run.data.fields), run.trainer, EvalConfig(records=4))
    decoded: list[int] = []
    real = uform.serve_stage.decode_items

    def counted(*args: Any) -> Any:
        decoded.append(len(args[5]))  # the items it was asked to decode
        return real(*args)

    monkeypatch.setattr(uform.serve_stage, "decode_items", counted)
    trainer = make_trainer(run.trainer)
    try:
        first = held.evaluate(trainer)
        assert sum(decoded) == 4  # the four images, once
        again = held.evaluate(trainer)
    finally:
        held.close()
    assert sum(decoded) == 4
    assert {"eval/text->image/recall@1", "eval/image->text/mrr"} <= set(first)
    assert all(again[k] == first[k] for k in first if k != "eval/seconds")
