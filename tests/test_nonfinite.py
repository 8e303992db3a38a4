"""Non-finite values never reach the weights (issue 10, items 1, 2, 9b, 9c).

The loss terms score every accepted weight without a NaN or infinity of their own making; a step whose loss or
gradients are not finite anyway (a weight of 3e38 overflows a sum honestly), or whose learning rate would
carry the update out of float32, is skipped whole: weights, moments, Adam's step counters and `steps_taken`
unchanged, the gradients cleared, counted in `TrainerStepStats.nonfinite` and warned about once. `save`
refuses non-finite weights. Parameters no gradient reached (a media modality's modules in a step without its
units) are left alone. The multi-process case (one rank's gradient non-finite, every rank skips) is
test_world.py's `nonfinite` world; the CUDA one is test_cuda.py's.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TEXTS, make_config, pair_relations, snapshot, step_with

import uform
from uform import (
    BatchShape,
    Contrastive,
    ImageShape,
    LateInteraction,
    Masking,
    NonFiniteWarning,
    PairLossForm,
    Schedule,
    TrainerInitVramConfig,
    TrainerStepConfig,
    TrainerStepStats,
)
from uform.losses.contrastive import pair_loss
from uform.media.decode import MediaPolicy
from uform.replica.optim import BETAS, EPSILON

SIDES = ["query", "query", "query", "document", "document", "document"]
"""Items 0-2 ask, 3-5 answer: pair_relations(3)'s pairs are (query, document) pairs."""


def weighted(weight: float) -> uform.Relations:
    """TEXTS' three pairs, every edge at `weight`."""
    relations = pair_relations(3)
    relations.attract.weights = [weight] * len(relations.attract.ids)
    return relations


def finite(trainer: uform.Trainer) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in snapshot(trainer).values())


def bad_step(trainer: uform.Trainer, relations: uform.Relations | None = None, **config: Any) -> TrainerStepStats:
    """A step that must be skipped: answers its stats after checking the skip changed nothing and warned."""
    before = snapshot(trainer)
    taken = trainer.steps_taken
    with pytest.warns(NonFiniteWarning, match="skipped on every process"):
        stats, _ = step_with(trainer, relations=relations if relations is not None else pair_relations(3), **config)
    assert stats is not None
    assert stats.nonfinite == 1
    assert trainer.steps_taken == taken
    after = snapshot(trainer)
    assert sorted(after) == sorted(before)
    assert all(torch.equal(before[k], after[k]) for k in before), [
        k for k in before if not torch.equal(before[k], after[k])
    ]
    assert all(p.grad is None for p in trainer.network.parameters())  # cleared: the next step adds onto nothing
    return stats


# ---- the loss terms: no non-finite value of their own making --------------------------------------------


@pytest.mark.parametrize("form", [PairLossForm.Balanced, PairLossForm.Ranked])
@pytest.mark.parametrize("weight", [1e-41, 1e38, 3.4e38])
def test_pair_loss_gradients_stay_finite_at_any_accepted_weight(form: PairLossForm, weight: float) -> None:
    """A ratio of weight sums is invariant to the weights' scale: at a subnormal 1e-41 (whose sum's reciprocal
    overflowed in the gradient) or at float32's largest (whose sums and products overflowed) it is the loss
    and gradient of weight 1."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, generator=generator)
    z = torch.tensor([[1, -1, -1, 0, -1, 1]] * 4, dtype=torch.float32)
    ones = (z != 0).float()

    def loss_and_grad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.clone().requires_grad_(True)
        total, _ = pair_loss(x, z, w, form)
        total.backward()
        assert x.grad is not None
        return total.detach(), x.grad

    reference = loss_and_grad(ones)
    scaled = loss_and_grad(ones * torch.tensor(weight, dtype=torch.float32))
    assert torch.isfinite(scaled[0]) and torch.isfinite(scaled[1]).all()
    torch.testing.assert_close(scaled[0], reference[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(scaled[1], reference[1], rtol=1e-6, atol=1e-9)


def test_softplus_is_exact_in_float64_past_the_threshold() -> None:
    """F.softplus answers x itself past its threshold of 20, off by log1p(exp(-x)) (2e-9 at 20); the loss's is
    exact in float64, value and gradient, at every scale (also far past it, and far below it)."""
    from uform.losses.contrastive import softplus

    x = torch.tensor([-800.0, -30.0, 0.0, 19.0, 20.0, 20.5, 25.0, 40.0, 800.0], dtype=torch.float64)
    x.requires_grad_(True)
    value = softplus(x)
    value.sum().backward()
    expected = x.detach().clamp_min(0) + torch.log1p(torch.exp(-x.detach().abs()))
    assert torch.equal(value.detach(), expected) or torch.allclose(value.detach(), expected, rtol=1e-15, atol=0)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.sigmoid(x.detach()), rtol=1e-15, atol=0)


def test_the_pair_loss_matches_the_exact_reference_past_logits_of_twenty() -> None:
    """A float64 Balanced and Sigmoid term over logits beyond 20 against the sum written out with the exact
    softplus: equal to float64 rounding (F.softplus's threshold was off by about 1e-9 per cell)."""
    logits = torch.tensor([[20.5, 21.0, 22.0], [-20.5, 20.2, 23.0]], dtype=torch.float64)
    z = torch.tensor([[-1.0, -1.0, 1.0], [1.0, -1.0, -1.0]], dtype=torch.float64)
    w = torch.ones_like(logits)

    def sp(v: torch.Tensor) -> torch.Tensor:
        return v.clamp_min(0) + torch.log1p(torch.exp(-v.abs()))

    margin = -z * logits
    sigmoid, _ = pair_loss(logits, z, w, PairLossForm.Sigmoid)
    torch.testing.assert_close(sigmoid, sp(margin).sum(), rtol=1e-15, atol=0)
    balanced, _ = pair_loss(logits, z, w, PairLossForm.Balanced)
    rows = [sp(margin[i][z[i] > 0]).mean() + sp(margin[i][z[i] < 0]).mean() for i in range(2)]
    torch.testing.assert_close(balanced, sum(rows), rtol=1e-15, atol=0)


# ---- the trainer: finite where the maths is, skipped where it is not ----------------------------------


@pytest.mark.parametrize("form", [PairLossForm.Balanced, PairLossForm.Ranked])
def test_subnormal_relation_weights_train_finite(make_trainer, form: PairLossForm) -> None:
    """Relation weights of 1e-41 (accepted) under Balanced or Ranked turned 11 of 13 weights into NaN in one
    step while the loss stayed finite. Now the step is the step of weight 1."""
    tiny = make_trainer(contrastive=Contrastive(pair_loss=form))
    one = make_trainer(contrastive=Contrastive(pair_loss=form))
    stats, _ = step_with(tiny, relations=weighted(1e-41))
    reference, _ = step_with(one, relations=weighted(1.0))
    assert stats is not None and reference is not None
    assert stats.nonfinite == 0 and tiny.steps_taken == 1
    assert finite(tiny)
    assert math.isclose(stats.contrastive_loss, reference.contrastive_loss, rel_tol=1e-5)


def test_subnormal_relation_weights_under_late_interaction_train_finite(make_trainer) -> None:
    """The same under late interaction (its Ranked pair loss): 11 of 16 weights were NaN after one step."""
    trainer = make_trainer(late_interaction=LateInteraction(weight=1.0, width=16))
    stats, _ = step_with(trainer, relations=weighted(1e-41), sides=SIDES)
    assert stats is not None and stats.nonfinite == 0 and trainer.steps_taken == 1
    assert stats.late_interaction_loss > 0 and math.isfinite(stats.loss)
    assert finite(trainer)


def test_a_huge_relation_weight_is_finite_under_ratios_and_skipped_under_sigmoid(make_trainer) -> None:
    """A relation weight of 1e38: Balanced normalises it away; the Sigmoid form's weighted sum really
    overflows, so that step is skipped (the stats still report its loss, not finite), and the run goes on."""
    balanced = make_trainer(contrastive=Contrastive(pair_loss=PairLossForm.Balanced))
    stats, _ = step_with(balanced, relations=weighted(1e38))
    assert stats is not None and stats.nonfinite == 0 and finite(balanced) and balanced.steps_taken == 1

    sigmoid = make_trainer(contrastive=Contrastive(pair_loss=PairLossForm.Sigmoid))
    step_with(sigmoid)
    skipped = bad_step(sigmoid, weighted(1e38))
    assert not math.isfinite(skipped.loss)
    assert skipped.step == 2  # the step keeps its number (the schedule and the draws move on)
    after, _ = step_with(sigmoid)
    assert after is not None and after.nonfinite == 0 and after.step == 3
    assert sigmoid.steps_taken == 2 and finite(sigmoid)
    assert sigmoid.notices.count("non-finite") == 1


@pytest.mark.parametrize(
    "overrides",
    [
        {"masking": Masking(text_weight=3e38)},
        {"contrastive": Contrastive(inverse_temperature=3e38)},
        {"late_interaction": LateInteraction(weight=3e38, width=16)},
    ],
    ids=["masking.text_weight", "contrastive.inverse_temperature", "late_interaction.weight"],
)
def test_a_weight_of_3e38_skips_every_step_and_is_warned_once(make_trainer, overrides: dict[str, Any]) -> None:
    trainer = make_trainer(**overrides)
    sides = SIDES if "late_interaction" in overrides else None
    extra = {"sides": sides} if sides else {}
    bad_step(trainer, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)  # shown once: the second skip is only counted
        stats, _ = step_with(trainer, **extra)
    assert stats is not None and stats.nonfinite == 1
    assert trainer.steps_taken == 0 and trainer.notices.count("non-finite") == 2
    assert finite(trainer)


def test_a_learning_rate_of_1e3_never_makes_a_weight_non_finite(make_trainer) -> None:
    """At 1e3 the first update is finite but wild; the forwards after it overflow, and those steps skip
    instead of writing NaN."""
    trainer = make_trainer(schedule=Schedule(steps=10, warmup_steps=0, learning_rate=1e3))
    with pytest.warns(NonFiniteWarning):
        for _ in range(4):
            step_with(trainer)
            assert finite(trainer)
    assert 1 <= trainer.steps_taken < 4
    assert trainer.steps_taken + trainer.notices.count("non-finite") == 4


def test_a_learning_rate_that_overflows_the_update_leaves_the_trainer_whole(make_trainer, tmp_path) -> None:
    """Resumed at a learning rate of 3e38, the for-each AdamW raised part-way: Adam's step counters split
    between 3 and 4, the trainer's step stayed 3 and the gradients were never cleared. Now the update is
    skipped whole; a resume at a sane rate then goes on as if the bad run had never been."""
    trainer = make_trainer()
    for _ in range(3):
        step_with(trainer)
    path = tmp_path / "three.safetensors"
    trainer.save(path)
    wild = make_trainer(TrainerInitVramConfig(resume=path, schedule=Schedule(steps=10, learning_rate=3e38)))
    stats = bad_step(wild)
    assert stats.step == 4 and wild.steps_taken == 3
    steps = {float(wild.optimizer.state[p]["step"]) for p in wild.network.parameters() if p in wild.optimizer.state}
    assert steps == {3.0}


def test_save_refuses_non_finite_weights(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    step_with(trainer)
    with torch.no_grad():
        trainer.network.pooled.projection.weight[0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    with pytest.raises(ValueError, match=r"save: the weights \['pooled\.projection\.weight'\] hold NaN"):
        trainer.save(path)
    assert not path.exists()


def test_a_resumed_run_continues_bitwise_across_a_skipped_step(make_trainer, tmp_path) -> None:
    """A skipped step keeps its number: the checkpoint stores the skips, so the resumed run's next step has
    the same number, rate and draws as the uninterrupted run's."""
    config = make_config(contrastive=Contrastive(pair_loss=PairLossForm.Sigmoid))
    trainer = make_trainer(config)
    step_with(trainer)
    bad_step(trainer, weighted(1e38))
    path = tmp_path / "skipped.safetensors"
    trainer.save(path)
    ours, _ = step_with(trainer)
    resumed = make_trainer(TrainerInitVramConfig(resume=path))
    assert resumed.steps_taken == 1
    theirs, _ = step_with(resumed)
    assert ours is not None and theirs is not None
    assert theirs.step == ours.step == 3 and theirs.loss == ours.loss
    a, b = snapshot(trainer), snapshot(resumed)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- parameters no gradient reached -------------------------------------------------------------------


def image_bytes(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def test_a_text_only_step_leaves_the_image_modules_alone(executor) -> None:
    """In a run with images a text-only step runs the image modules over inert padding units only: their
    gradients are exact zeros, which AdamW turned into decay and moving moments. Now they are untouched,
    bitwise (weights, moments, step counters), while every other parameter steps."""
    config = make_config(
        batch=BatchShape(
            max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=64, image=ImageShape(patch_side=16)
        ),
    )
    trainer = uform.Trainer.init_vram(executor, config, media=MediaPolicy(workers=1))
    try:
        image_steps(trainer)
    finally:
        trainer.close()


def image_steps(trainer: uform.Trainer) -> None:
    images = ["image", "text", "image", "text"]
    contents = [image_bytes(0), "a red square", image_bytes(1), "a blue square"]
    relations = pair_relations(2)
    trainer.step(images, contents, TrainerStepConfig(relations=relations))
    before = snapshot(trainer)
    step_with(trainer)  # text only
    after = snapshot(trainer)
    image = [
        k
        for k in before
        if ".media.image." in f".{k.split('.', 1)[1]}" or ".reconstruct.image." in f".{k.split('.', 1)[1]}"
    ]
    assert image and any("moments.exp_avg." in k for k in image)
    changed = [k for k in image if not torch.equal(before[k], after[k])]
    assert not changed, changed
    others = [k for k in before if k not in image and k.startswith("weights.tower.")]
    assert all(not torch.equal(before[k], after[k]) for k in others)
    # the next step with images moves them again
    trainer.step(images, contents, TrainerStepConfig(relations=relations))
    assert not torch.equal(
        snapshot(trainer)["weights.media.image.embedding.weight"], after["weights.media.image.embedding.weight"]
    )


# ---- the device-decided skip (CUDA's path), through torch's fused AdamW on the CPU --------------------------


def fused(trainer: uform.Trainer) -> None:
    """Gives `trainer` the fused AdamW (CUDA's; torch has it on the CPU too), so that its step takes the path
    where the device decides the skip: the flag goes to the kernel as `found_inf` and is read afterwards."""
    from uform.replica.optim import Optimizer

    groups = [{k: g[k] for k in ("params", "weight_decay", "reach")} for g in trainer.optimizer.param_groups]
    trainer.replica.optimizer = Optimizer(groups, lr=0.0, betas=BETAS, eps=EPSILON, fused=True)


def test_step_unless_skips_each_group_on_its_own_flag() -> None:
    """A group whose flag is 1 is not written (weights, moments, step counter bitwise); a group whose flag is 0
    steps exactly as a plain fused step does."""
    from uform.replica.optim import Optimizer

    generator = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(4, 4, generator=generator)) for _ in range(2)]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def make(params: list[torch.nn.Parameter]) -> Any:
        groups = [
            {"params": [params[0]], "weight_decay": 0.01, "reach": None},
            {"params": [params[1]], "weight_decay": 0.0, "reach": "media.image"},
        ]
        return Optimizer(groups, lr=1e-2, betas=BETAS, eps=EPSILON, fused=True)

    mine, reference = make(ours), make(plain)
    for step in range(3):
        for p, q in zip(ours, plain, strict=True):
            p.grad = torch.randn(4, 4, generator=generator)
            q.grad = p.grad.clone()
        skipped = step == 2
        if skipped:  # the reference leaves it as torch.optim leaves a parameter without a gradient
            plain[1].grad = None
        mine.step_unless([torch.zeros(()), torch.tensor(float(skipped))])
        reference.step()
        for p, q in zip(ours, plain, strict=True):
            assert torch.equal(p, q)
            assert mine.state[p].keys() == reference.state[q].keys()
            assert all(torch.equal(v, reference.state[q][k]) for k, v in mine.state[p].items())
    assert float(mine.state[ours[1]]["step"]) == 2.0 and float(mine.state[ours[0]]["step"]) == 3.0


def test_the_device_decided_skip_changes_nothing_and_is_counted(make_trainer, tmp_path) -> None:
    """The CUDA path of the update on the CPU: the fused AdamW reads the flag, the host reads it after (the
    completion thread, a save, `steps_taken`). The skipped step is bitwise nothing, counted, warned, stored."""
    trainer = make_trainer(contrastive=Contrastive(pair_loss=PairLossForm.Sigmoid))
    fused(trainer)
    step_with(trainer)
    stats = bad_step(trainer, weighted(1e38))
    assert stats.step == 2 and not math.isfinite(stats.loss)
    deferred = trainer.deferred(trainer.executor).step(
        ["text"] * len(TEXTS), TEXTS, TrainerStepConfig(relations=weighted(1e38))
    )
    deferred.result(timeout=60)
    assert trainer.steps_taken == 1 and trainer.notices.count("non-finite") == 2
    path = tmp_path / "fused.safetensors"
    trainer.save(path)
    after, _ = step_with(trainer)
    assert after is not None and after.step == 4 and after.nonfinite == 1  # the deferred step's skip, unread till now
    assert trainer.steps_taken == 2 and finite(trainer)
    resumed = make_trainer(TrainerInitVramConfig(resume=path))
    assert resumed.steps_taken == 1


def test_a_step_without_sides_leaves_the_late_interaction_head_alone(make_trainer) -> None:
    """A step with no query or document tokens runs the token head over padding only (exact-zero
    gradients): its weights, moments and step counters stay bitwise as they were, while the tower steps."""
    trainer = make_trainer(late_interaction=LateInteraction(weight=1.0, width=16))
    step_with(trainer, sides=SIDES)
    before = snapshot(trainer)
    step_with(trainer)  # no sides: no late-interaction tokens
    after = snapshot(trainer)
    late = [k for k in before if ".token_head." in f".{k}" or ".late_temperatures." in f".{k}"]
    assert late and any(k.startswith("moments.exp_avg.") for k in late)
    changed = [k for k in late if not torch.equal(before[k], after[k])]
    assert not changed, changed
    tower = [k for k in before if k.startswith("weights.tower.")]
    assert tower and all(not torch.equal(before[k], after[k]) for k in tower)
    step_with(trainer, sides=SIDES)  # sides again: the head moves again
    moved = snapshot(trainer)
    assert not torch.equal(moved["weights.token_head.projection.weight"], after["weights.token_head.projection.weight"])
