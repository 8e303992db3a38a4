"""Calibrated choices: the KL term against a naive reference, the state a choice reads, the step's tapes
checked (a refused call changes nothing), learning to target distributions, every objective with both
new terms on, and a bitwise resume."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    COLUMNS,
    SEGMENTS,
    TEXTS,
    assert_refusal_changes_nothing,
    assert_same,
    assert_same_output,
    make_config,
    pair_relations,
    snapshot,
    two_good_steps,
)

import uform
from uform import (
    Arena,
    BatchShape,
    Choices,
    ImageShape,
    LateInteraction,
    LateInteractionSide,
    Masking,
    Modality,
    Objective,
    Schedule,
    Trainer,
    TrainerStepConfig,
    TrainerStepStats,
    vocab,
)
from uform.config import resolve
from uform.data.batch import prepare
from uform.data.items import parse_choices
from uform.losses.choices import choice_probabilities, choices_sum
from uform.serve import Model

K = 4
N = len(TEXTS)
MODS = ["text"] * N
SIDES = ["query", "query", "query", "document", "document", "document"]
CHOICES = [b"yn", b"", b"abc", b"", b"0123", b""]
TARGETS = [[0.25, 0.75], [], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]


def choice_config(**overrides: Any) -> uform.TrainerInitVramConfig:
    """A tiny Joint run with late interaction and choices on (and images live, so that a media item can be
    refused for offering choices)."""
    fields: dict[str, Any] = dict(
        batch=BatchShape(
            max_rows_per_device=2,
            max_segments_per_device=SEGMENTS,
            max_columns_per_row=COLUMNS,
            max_choices_per_item=K,
            image=ImageShape(patch_side=8),
        ),
        late_interaction=LateInteraction(weight=0.5, width=16),
        choices=Choices(weight=2.0),
    )
    fields.update(overrides)
    return make_config(**fields)


def _tape(entries: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    data = np.frombuffer(b"".join(entries), dtype=np.uint8).copy()
    return data, np.cumsum([0] + [len(e) for e in entries]).astype(np.int64)


def _target_tape(entries: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    data = np.array([v for e in entries for v in e], dtype=np.float32)
    return data, np.cumsum([0] + [len(e) for e in entries]).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# The term


def reference_kl(logits: torch.Tensor, legal: list[bytes], targets: list[list[float]]) -> tuple[torch.Tensor, int]:
    total = logits.new_zeros(())
    count = 0
    for i, (choices, q) in enumerate(zip(legal, targets, strict=True)):
        if not choices:
            continue
        count += 1
        chosen = torch.stack([logits[i, byte] for byte in choices])
        log_p = chosen - torch.logsumexp(chosen, dim=0)
        for k, qk in enumerate(q):
            if qk > 0:
                total = total + qk * (np.log(qk) - log_p[k])
    return total, count


def test_choices_sum_matches_the_naive_kl_forward_and_backward() -> None:
    g = torch.Generator().manual_seed(0)
    legal = [b"yn", b"", b"abc", b"\x00\xff", b"0123"]
    targets = [[0.25, 0.75], [], [0.0, 0.3, 0.7], [1.0, 0.0], [0.1, 0.2, 0.3, 0.4]]
    base = torch.randn(len(legal), 256, generator=g) * 3
    legal_bytes = torch.zeros(len(legal), K, dtype=torch.long)
    is_legal = torch.zeros(len(legal), K, dtype=torch.bool)
    q = torch.zeros(len(legal), K)
    for i, (c, t) in enumerate(zip(legal, targets, strict=True)):
        legal_bytes[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        is_legal[i, : len(c)] = True
        q[i, : len(t)] = torch.tensor(t)
    valid = is_legal.any(dim=1).float()
    mine = base.clone().requires_grad_(True)
    total, count = choices_sum(mine, legal_bytes, is_legal, q, valid)
    total.backward()
    theirs = base.clone().requires_grad_(True)
    expected, expected_count = reference_kl(theirs, legal, targets)
    expected.backward()
    assert int(count) == expected_count == 4
    torch.testing.assert_close(total.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)
    assert mine.grad is not None and torch.equal(mine.grad[1], torch.zeros(256)), "no choice, no gradient"
    p = choice_probabilities(base, legal_bytes, is_legal)
    assert torch.allclose(p.sum(dim=1), valid, atol=1e-6)
    assert torch.equal(p[~is_legal], torch.zeros(int((~is_legal).sum())))


# --------------------------------------------------------------------------------------------------
# The state


def _prepare(config, texts, choices, targets, objective=Objective.Masked):
    resolved = dataclasses.replace(resolve(config), objective=objective)
    mods = [Modality.Text] * len(texts)
    return prepare(
        resolved,
        mods,
        [t.encode() for t in texts],
        bags=None,
        groups=None,
        sides=None,
        relations=None,
        step=3,
        choices=parse_choices(choices, targets, mods, K),
    )


def test_the_state_is_the_text_with_a_mask_appended_uncorrupted_and_cut_at_its_head() -> None:
    long = "".join(chr(ord("a") + i % 26) for i in range(3 * COLUMNS))
    texts = ["is this so? ", long, "plain text to corrupt", "another plain one"]
    choices = [b"yn", b"xyz", b"", b""]
    targets = [[0.5, 0.5], [0.2, 0.2, 0.6], [], []]
    batch = _prepare(choice_config(), texts, choices, targets)
    layout = batch.layout
    assert batch.dropped == 0
    assert batch.truncated == 1, "the long state was cut"
    flat = batch.tokens.reshape(-1)
    covered = set(batch.target_index[batch.target_weight > 0].tolist())
    assert covered, "the plain items are corrupted (the masked objective)"
    for item, text in enumerate(texts[:2]):
        r, c0, n = int(layout.row[item]), int(layout.column[item]), int(layout.length[item])
        ids = batch.tokens[r, c0 : c0 + n].tolist()
        keep = n - 2 - 1
        assert ids[:2] == vocab.prefix(Modality.Text, LateInteractionSide.None_)
        assert ids[-1] == vocab.MASK
        assert bytes(ids[2:-1]) == text.encode()[len(text) - keep :], "the head is cut, the tail kept, uncorrupted"
        positions = set(range(r * COLUMNS + c0, r * COLUMNS + c0 + n))
        assert not positions & covered, "a state is never corrupted"
        slot = int(layout.slot[item])
        assert batch.choice["index"][slot] == r * COLUMNS + c0 + n - 1
        assert flat[batch.choice["index"][slot]] == vocab.MASK
        assert batch.choice["bytes"][slot, : len(choices[item])].tolist() == list(choices[item])
        assert batch.choice["legal"][slot].sum() == len(choices[item])
        assert np.allclose(batch.choice["targets"][slot, : len(targets[item])], targets[item])
        assert batch.choice["valid"][slot] == 1.0
    assert batch.choice["valid"].sum() == 2
    assert len(texts[1]) + 2 > COLUMNS and layout.length[1] == COLUMNS


def test_targets_are_renormalised_to_sum_to_one() -> None:
    parsed = parse_choices([b"ab"], [[0.3, 0.6995]], [Modality.Text], K)
    assert parsed is not None
    assert parsed.targets.dtype == np.float32
    assert parsed.targets.sum() == pytest.approx(1.0, abs=1e-7)


# --------------------------------------------------------------------------------------------------
# Refused calls change nothing


def _good_config() -> tuple[TrainerStepConfig, TrainerStepStats, Arena]:
    stats, arena = TrainerStepStats(), Arena()
    config = TrainerStepConfig(
        relations=pair_relations(3),
        sides=SIDES,
        choices=CHOICES,
        choice_targets=TARGETS,
        stats=stats,
        arena=arena,
    )
    return config, stats, arena


def _good_step(trainer: Trainer) -> tuple[TrainerStepStats, torch.Tensor]:
    config, stats, _ = _good_config()
    return stats, trainer.on(trainer.executor).step(MODS, TEXTS, config)


@pytest.fixture(scope="module")
def reference(executor):
    trainer = Trainer.init_vram(executor, choice_config())
    try:
        yield two_good_steps(trainer, _good_step)
    finally:
        trainer.close()


def _with(**fields: Any) -> TrainerStepConfig:
    values: dict[str, Any] = dict(relations=pair_relations(3), sides=SIDES, choices=CHOICES, choice_targets=TARGETS)
    values.update(fields)
    return TrainerStepConfig(**values)


DATA, OFFSETS = _tape(CHOICES)
T_DATA, T_OFFSETS = _target_tape(TARGETS)

# (label, modalities, config, error type, what the message must name)
# fmt: off
BAD_CALLS: list[tuple[str, Any, TrainerStepConfig, type[Exception], str]] = [
    ("choices offsets too short", MODS, _with(choices=(DATA, OFFSETS[:-1])), ValueError, "choices"),
    ("choices offsets too long", MODS, _with(choices=(DATA, np.append(OFFSETS, OFFSETS[-1]))), ValueError, "choices"),
    ("choices offsets not from zero", MODS, _with(choices=(DATA, OFFSETS + 1)), ValueError, "choices"),
    ("choices offsets decreasing", MODS, _with(choices=(DATA, np.array([0, 2, 1, 5, 5, 9, 9]))), ValueError, "choices"),
    ("choices offsets short of the data", MODS, _with(choices=(DATA, np.append(OFFSETS[:-1], OFFSETS[-1] - 1))), ValueError, "choices"),
    ("choices tape data not bytes", MODS, _with(choices=(DATA.astype(np.int32), OFFSETS)), TypeError, "choices"),
    ("choices tape offsets not integers", MODS, _with(choices=(DATA, OFFSETS.astype(np.float64))), TypeError, "choices"),
    ("choices too few entries", MODS, _with(choices=CHOICES[:-1]), ValueError, "choices"),
    ("choices entry of a wrong type", MODS, _with(choices=[b"yn", 7, b"abc", b"", b"0123", b""]), TypeError, "choices[1]"),
    ("choices a bare string", MODS, _with(choices="yn"), TypeError, "choices"),
    ("choices repeat a byte", MODS, _with(choices=[b"yy", b"", b"abc", b"", b"0123", b""]), ValueError, "choices[0]"),
    ("choices past max_choices_per_item", MODS, _with(choices=[b"yn", b"", b"abcde", b"", b"0123", b""], choice_targets=[[0.5, 0.5], [], [0.2] * 5, [], [0.25] * 4, []]), ValueError, "choices[2]"),
    ("an image offering choices", ["image", *MODS[1:]], _with(), ValueError, "choices[0]"),
    ("targets missing", MODS, _with(choice_targets=((), ())), ValueError, "choice_targets"),
    ("targets without choices", MODS, _with(choices=((), ())), ValueError, "choice_targets"),
    ("targets too few entries", MODS, _with(choice_targets=TARGETS[:-1]), ValueError, "choice_targets"),
    ("targets shorter than their choices", MODS, _with(choice_targets=[[1.0], [], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]), ValueError, "choice_targets[0]"),
    ("targets for an item without choices", MODS, _with(choice_targets=[[0.25, 0.75], [1.0], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]), ValueError, "choice_targets[1]"),
    ("targets negative", MODS, _with(choice_targets=[[-0.25, 1.25], [], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]), ValueError, "choice_targets"),
    ("targets not finite", MODS, _with(choice_targets=[[float("nan"), 0.75], [], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]), ValueError, "choice_targets"),
    ("targets not summing to one", MODS, _with(choice_targets=[[0.25, 0.74], [], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]), ValueError, "choice_targets[0]"),
    ("targets of a wrong type", MODS, _with(choice_targets=[["a", "b"], [], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]), TypeError, "choice_targets[0]"),
    ("targets of bools", MODS, _with(choice_targets=[[False, True], [], [0.2, 0.3, 0.5], [], [0.1, 0.2, 0.3, 0.4], []]), TypeError, "choice_targets[0]"),
    ("targets tape offsets off", MODS, _with(choice_targets=(T_DATA, np.array([0, 1, 2, 5, 5, 9, 9]))), ValueError, "choice_targets"),
    ("targets tape of strings", MODS, _with(choice_targets=(T_DATA.astype(str), T_OFFSETS)), TypeError, "choice_targets"),
    ("sides unknown word", MODS, _with(sides=[*SIDES[:-1], "judge"]), ValueError, "sides[5]"),
    ("sides too short", MODS, _with(sides=SIDES[:2]), ValueError, "sides"),
    ("relations checked for late pairs", MODS, _with(relations=uform.Relations(attract=uform.Edges(offsets=[0, 1], ids=[1]))), ValueError, "relations.attract.offsets"),
]
# fmt: on


@pytest.mark.parametrize("verb", ["on", "deferred"])
@pytest.mark.parametrize(
    ("modalities", "config", "error", "field"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_a_refused_call_changes_nothing(make_trainer, reference, verb, modalities, config, error, field) -> None:
    trainer = make_trainer(choice_config())
    assert_refusal_changes_nothing(trainer, reference, _good_step, verb, modalities, TEXTS, config, error, field)


def test_every_tape_form_is_the_same_step(make_trainer, reference) -> None:
    """Sequences of bytes / str and of float lists, and (data, offsets) numpy tapes, are the same step."""
    first, _, _, _ = reference
    forms = [
        (CHOICES, TARGETS),
        ((DATA, OFFSETS), (T_DATA, T_OFFSETS)),
        ([c.decode() for c in CHOICES], [np.array(t) for t in TARGETS]),
        ([np.frombuffer(c, dtype=np.uint8) for c in CHOICES], (T_DATA.astype(np.float64), T_OFFSETS.astype(np.int32))),
    ]
    for choices, targets in forms:
        trainer = make_trainer(choice_config())
        trainer.step(MODS, TEXTS, _with(choices=choices, choice_targets=targets))
        assert_same(snapshot(trainer), first)


def test_a_run_without_choices_reads_none(make_trainer) -> None:
    """choices and choice_targets are read only where the run trains them: elsewhere even bad ones pass."""
    a, b = make_trainer(), make_trainer()
    a.step(MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3), choices=[b"yy"], choice_targets=[[2.0]]))
    b.step(MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3)))
    assert_same(snapshot(a), snapshot(b))


# --------------------------------------------------------------------------------------------------
# Learning, stats, objectives, resume

STATES = ["is the sky blue? ", "pick a digit: ", "coin flip: ", "which vowel? "]
LEGAL = [b"yn", b"0123", b"ht", b"aeiou"]
GOAL = [[0.8, 0.2], [0.1, 0.2, 0.3, 0.4], [0.5, 0.5], [0.05, 0.15, 0.2, 0.25, 0.35]]


def choose_texts(trainer: Any, states: list[str], legal: list[bytes]) -> list[np.ndarray]:
    """The served answer (`Model.text_choose` over the trainer's live network), one array per state."""
    model = Model.from_trainer(trainer)
    try:
        data, offsets = model.text_choose(states, legal)
    finally:
        model.close()
    return [np.asarray(data[offsets[i] : offsets[i + 1]]) for i in range(len(states))]


def _kl(q: list[float], p: np.ndarray) -> float:
    q_ = np.asarray(q, dtype=np.float64)
    return float(np.sum(q_ * (np.log(q_) - np.log(p.astype(np.float64)))))


def test_a_tiny_model_learns_the_target_distributions(make_trainer) -> None:
    steps = 60
    trainer = make_trainer(
        objective=Objective.Contrastive,
        batch=BatchShape(
            max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=64, max_choices_per_item=5
        ),
        choices=Choices(weight=1.0),
        schedule=Schedule(steps=steps, warmup_steps=5, learning_rate=3e-3),
        seed=5,
    )
    before = choose_texts(trainer, STATES, LEGAL)
    first = last = None
    for _ in range(steps):
        stats = TrainerStepStats()
        trainer.step(["text"] * 4, STATES, TrainerStepConfig(choices=LEGAL, choice_targets=GOAL, stats=stats))
        first = stats.choices_loss if first is None else first
        last = stats.choices_loss
    after = choose_texts(trainer, STATES, LEGAL)
    gaps = [_kl(q, p) for q, p in zip(GOAL, after, strict=True)]
    assert max(_kl(q, p) for q, p in zip(GOAL, before, strict=True)) > 0.1, "the untrained model is far off"
    assert max(gaps) < 0.02, gaps
    assert last is not None and first is not None and last < first
    # The trainer's own report is the mean KL over the states, as the evaluation reads it.
    assert last == pytest.approx(np.mean(gaps), abs=0.02)
    for p, legal in zip(after, LEGAL, strict=True):
        assert p.dtype == np.float32 and p.shape == (len(legal),)
        assert p.sum() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("objective", [Objective.Masked, Objective.Contrastive, Objective.Joint])
def test_every_objective_trains_with_both_terms_on(make_trainer, objective: Objective) -> None:
    trainer = make_trainer(choice_config(objective=objective, masking=Masking(text_weight=0.5)))
    losses = []
    for _ in range(3):
        stats, _ = _good_step(trainer)
        losses.append(stats.loss)
        assert stats.late_interaction_loss > 0
        assert stats.choices_loss > 0
        assert (stats.masked_text_loss > 0) == (objective != Objective.Contrastive)
        assert (stats.contrastive_loss > 0) == (objective != Objective.Masked)
        expected = (
            stats.contrastive_loss
            + 0.5 * stats.masked_text_loss
            + stats.late_interaction_loss
            + 2.0 * stats.choices_loss
        )
        assert stats.loss == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert np.isfinite(losses).all()


def test_stats_report_choices_before_their_weight(make_trainer) -> None:
    reports = []
    for weight in (2.0, 0.5):
        trainer = make_trainer(choice_config(choices=Choices(weight=weight)))
        stats, _ = _good_step(trainer)
        reports.append(stats)
    assert reports[0].choices_loss == reports[1].choices_loss > 0
    assert reports[0].late_interaction_loss == reports[1].late_interaction_loss > 0
    assert reports[0].loss - reports[1].loss == pytest.approx(1.5 * reports[0].choices_loss, rel=1e-5)


def test_resume_stays_bitwise_with_the_new_terms(make_trainer, tmp_path) -> None:
    straight = make_trainer(choice_config())
    results = [_good_step(straight) for _ in range(4)]
    first = make_trainer(choice_config())
    for _ in range(2):
        _good_step(first)
    path = tmp_path / "choices.safetensors"
    first.save(path)
    resumed = make_trainer(uform.TrainerInitVramConfig(resume=path))
    assert dataclasses.replace(resumed.config, resume=None) == resolve(choice_config())
    for k in (2, 3):
        stats, out = _good_step(resumed)
        assert stats == results[k][0]
        assert_same_output(out, results[k][1])
    assert_same(snapshot(resumed), snapshot(straight))
