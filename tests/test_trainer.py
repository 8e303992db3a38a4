"""The trainer's behaviour: gradients, determinism, refused calls, the verbs, stats, arenas, and learning."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
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
    direct_terms,
    make_config,
    overfull_texts,
    pair_relations,
    snapshot,
    step_with,
    two_good_steps,
)

import uform
from uform import (
    Arena,
    BatchShape,
    Edges,
    Executor,
    ImageShape,
    LateInteraction,
    Masking,
    Objective,
    Relations,
    Scalar,
    Schedule,
    Trainer,
    TrainerSaveConfig,
    TrainerStepConfig,
    TrainerStepStats,
)

# --------------------------------------------------------------------------------------------------
# 2. Gradients


def test_every_parameter_gets_a_finite_nonzero_gradient(make_trainer) -> None:
    """Joint, a step with relations: network.losses + network.total, backward, every parameter is reached."""
    trainer = make_trainer(
        batch=BatchShape(max_rows_per_device=2, max_segments_per_device=SEGMENTS, max_columns_per_row=128)
    )
    network = trainer.network
    network.zero_grad(set_to_none=True)
    batch, (terms, _) = direct_terms(trainer, TEXTS, pair_relations(3))
    assert batch.dropped == 0
    totals = network.total(terms)
    assert totals["masked_text_loss"] > 0 and totals["contrastive_loss"] > 0
    totals["loss"].backward()
    missing, infinite, zero = [], [], []
    for name, p in network.named_parameters():
        if p.grad is None:
            missing.append(name)
        elif not torch.isfinite(p.grad).all():
            infinite.append(name)
        elif not p.grad.abs().sum() > 0:
            zero.append(name)
    assert not (missing or infinite or zero), f"no gradient: {missing}; not finite: {infinite}; zero: {zero}"


def test_a_real_step_reaches_every_parameter(make_trainer) -> None:
    """The same through the trainer's own step: a gradient hook on every parameter sees a finite, nonzero one."""
    trainer = make_trainer()
    seen: dict[str, torch.Tensor] = {}
    handles = [
        p.register_hook(lambda g, name=name: seen.__setitem__(name, g.detach().clone()))
        for name, p in trainer.network.named_parameters()
    ]
    try:
        step_with(trainer)
    finally:
        for h in handles:
            h.remove()
    names = [n for n, _ in trainer.network.named_parameters()]
    assert sorted(seen) == sorted(names), f"no gradient: {sorted(set(names) - set(seen))}"
    bad = [n for n, g in seen.items() if not torch.isfinite(g).all() or not g.abs().sum() > 0]
    assert not bad, f"zero or non-finite gradients: {bad}"


# --------------------------------------------------------------------------------------------------
# 3. Determinism


def _run(trainer: Trainer, steps: int = 3) -> list[tuple[TrainerStepStats, torch.Tensor]]:
    return [step_with(trainer) for _ in range(steps)]


def test_same_seed_same_run_bitwise(make_trainer) -> None:
    a, b = make_trainer(), make_trainer()
    assert_same(snapshot(a), snapshot(b))
    ra, rb = _run(a), _run(b)
    for (sa, ea), (sb, eb) in zip(ra, rb, strict=True):
        assert sa == sb
        assert_same_output(ea, eb)
    assert_same(snapshot(a), snapshot(b))
    assert a.steps_taken == b.steps_taken == 3
    moments = [k for k in snapshot(a) if k.startswith("moments.")]
    assert moments, "the optimizer holds moments after a step"


def test_different_seed_different_run(make_trainer) -> None:
    a, b = make_trainer(seed=7), make_trainer(seed=8)
    _run(a), _run(b)
    sa, sb = snapshot(a), snapshot(b)
    weights = [k for k in sa if k.startswith("weights.") and "temperatures" not in k and "norm" not in k]
    assert weights
    same = [k for k in weights if torch.equal(sa[k], sb[k])]
    assert not same, f"identical under different seeds: {same}"


def test_strided_and_tape_contents_train_as_their_bytes(make_trainer) -> None:
    """A non-contiguous uint8 view, a bytearray and a (data, offsets) tape are the same items as bytes."""
    texts = [f"item {i} says hello" for i in range(4)]
    spaced = [np.frombuffer(bytes(b for c in t.encode() for b in (c, 0)), dtype=np.uint8)[::2] for t in texts]
    forms = [[t.encode() for t in texts], spaced, [bytearray(t.encode()) for t in texts], _tape(texts)]
    results = []
    for contents in forms:
        trainer = make_trainer()
        stats = TrainerStepStats()
        trainer.on(trainer.executor).step(["text"] * 4, contents, TrainerStepConfig(stats=stats))
        results.append((stats, snapshot(trainer)))
    for stats, weights in results[1:]:
        assert stats == results[0][0]
        assert_same(weights, results[0][1])


# --------------------------------------------------------------------------------------------------
# 6. Refused calls change nothing


def _tape(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    data = np.frombuffer("".join(texts).encode(), dtype=np.uint8).copy()
    offsets = np.cumsum([0] + [len(t.encode()) for t in texts]).astype(np.int64)
    return data, offsets


def _attract(offsets: Any, ids: Any, weights: Any = ()) -> Relations:
    return Relations(attract=Edges(offsets=offsets, ids=ids, weights=weights))


N = len(TEXTS)
MODS = ["text"] * N
OK_OFFSETS = [0, 1, 2, 3, 4, 5, 6]
OK_IDS = [3, 4, 5, 0, 1, 2]
DATA, TAPE_OFFSETS = _tape(TEXTS)

# (label, modalities, contents, config, error type, what the message must name)
# fmt: off
BAD_CALLS: list[tuple[str, Any, Any, Any, type[Exception], str]] = [
    ("contents shorter", MODS, TEXTS[:-1], None, ValueError, "contents"),
    ("contents longer", MODS[:-1], TEXTS, None, ValueError, "contents"),
    ("unknown modality word", ["text", "smell", *MODS[2:]], TEXTS, None, ValueError, "modalities[1]"),
    ("modality out of range", [*MODS[:-1], 9], TEXTS, None, ValueError, "modalities[5]"),
    ("media in a text-only run", ["image", *MODS[1:]], TEXTS, None, ValueError, "modalities[0]"),
    ("modalities a string", "text", TEXTS[:1], None, TypeError, "modalities"),
    ("no items", [], [], None, ValueError, "modalities"),
    ("content of a wrong type", MODS, [*TEXTS[:2], 42, *TEXTS[3:]], None, TypeError, "contents[2]"),
    ("bags too short", MODS, TEXTS, TrainerStepConfig(bags=[0, 1]), ValueError, "bags"),
    ("bags too long", MODS, TEXTS, TrainerStepConfig(bags=list(range(N + 1))), ValueError, "bags"),
    ("bags negative", MODS, TEXTS, TrainerStepConfig(bags=[0, 1, 2, -1, 4, 5]), ValueError, "bags"),
    ("bags not integers", MODS, TEXTS, TrainerStepConfig(bags=[0.5] * N), TypeError, "bags"),
    ("temperature group out of range", MODS, TEXTS, TrainerStepConfig(temperature_groups=[0] * 5 + [1]), ValueError, "temperature_groups"),
    ("temperature groups too short", MODS, TEXTS, TrainerStepConfig(temperature_groups=[0]), ValueError, "temperature_groups"),
    ("sides too short", MODS, TEXTS, TrainerStepConfig(sides=["query"]), ValueError, "sides"),
    ("sides unknown word", MODS, TEXTS, TrainerStepConfig(sides=["query"] * 5 + ["judge"]), ValueError, "sides[5]"),
    ("offsets too short", MODS, TEXTS, TrainerStepConfig(relations=_attract([0, 1, 2], [3, 4])), ValueError, "relations.attract.offsets"),
    ("offsets not from zero", MODS, TEXTS, TrainerStepConfig(relations=_attract([1, 1, 2, 3, 4, 5, 6], OK_IDS)), ValueError, "relations.attract.offsets"),
    ("offsets decreasing", MODS, TEXTS, TrainerStepConfig(relations=_attract([0, 2, 1, 3, 4, 5, 6], OK_IDS)), ValueError, "relations.attract.offsets"),
    ("offsets past ids", MODS, TEXTS, TrainerStepConfig(relations=_attract([0, 1, 2, 3, 4, 5, 7], OK_IDS)), ValueError, "relations.attract.offsets"),
    ("ids out of range", MODS, TEXTS, TrainerStepConfig(relations=_attract(OK_OFFSETS, [3, 4, 5, 0, 1, N])), ValueError, "relations.attract.ids"),
    ("ids negative", MODS, TEXTS, TrainerStepConfig(relations=_attract(OK_OFFSETS, [3, 4, 5, 0, 1, -1])), ValueError, "relations.attract.ids"),
    ("ids unsorted", MODS, TEXTS, TrainerStepConfig(relations=Relations(repel=Edges(offsets=[0, 2, 2, 2, 2, 2, 2], ids=[5, 4]))), ValueError, "relations.repel.ids"),
    ("ids repeated", MODS, TEXTS, TrainerStepConfig(relations=Relations(ignore=Edges(offsets=[0, 2, 2, 2, 2, 2, 2], ids=[4, 4]))), ValueError, "relations.ignore.ids"),
    ("self edge", MODS, TEXTS, TrainerStepConfig(relations=_attract(OK_OFFSETS, [3, 4, 5, 0, 1, 5])), ValueError, "relations.attract.ids"),
    ("weights wrong length", MODS, TEXTS, TrainerStepConfig(relations=_attract(OK_OFFSETS, OK_IDS, [1.0, 2.0])), ValueError, "relations.attract.weights"),
    ("weights negative", MODS, TEXTS, TrainerStepConfig(relations=_attract(OK_OFFSETS, OK_IDS, [1.0] * 5 + [-1.0])), ValueError, "relations.attract.weights"),
    ("weights not finite", MODS, TEXTS, TrainerStepConfig(relations=_attract(OK_OFFSETS, OK_IDS, [1.0] * 5 + [float("nan")])), ValueError, "relations.attract.weights"),
    ("relations of a wrong type", MODS, TEXTS, TrainerStepConfig(relations={"attract": []}), TypeError, "relations"),
    ("edges of a wrong type", MODS, TEXTS, TrainerStepConfig(relations=Relations(repel=[0, 1])), TypeError, "relations.repel"),
    ("config of a wrong type", MODS, TEXTS, {"bags": []}, TypeError, "config"),
    ("arena of a wrong type", MODS, TEXTS, TrainerStepConfig(arena=[]), TypeError, "arena"),
    ("stats of a wrong type", MODS, TEXTS, TrainerStepConfig(stats={}), TypeError, "stats"),
    ("unknown outputs scalar", MODS, TEXTS, TrainerStepConfig(outputs_scalar="f64"), ValueError, "outputs_scalar"),
    ("tape offsets past the data", MODS, (DATA, TAPE_OFFSETS + 1), None, ValueError, "contents"),
    ("tape offsets short of the data", MODS, (DATA, np.append(TAPE_OFFSETS[:-1], len(DATA) - 1)), None, ValueError, "contents"),
    ("tape offsets decreasing", MODS, (DATA, TAPE_OFFSETS[[0, 2, 1, 3, 4, 5, 6]]), None, ValueError, "contents"),
    ("tape with too few items", MODS, (DATA, TAPE_OFFSETS[[0, 1, 2, 3, 4, 6]]), None, ValueError, "contents"),
    ("tape data not bytes", MODS, (DATA.astype(np.int32), TAPE_OFFSETS), None, TypeError, "contents"),
    ("tape offsets not integers", MODS, (DATA, TAPE_OFFSETS.astype(np.float64)), None, TypeError, "contents"),
    ("content a 2-D array", MODS, [np.zeros((2, 2), dtype=np.uint8), *TEXTS[1:]], None, TypeError, "contents[0]"),
    ("weights beyond float32", MODS, TEXTS, TrainerStepConfig(relations=_attract(OK_OFFSETS, OK_IDS, [1e39] * 6)), ValueError, "relations.attract.weights"),
]
# fmt: on

# Cases the library gets wrong today (see the report); strict, so a fix turns them into failures to unmark.
KNOWN_BUGS: dict[str, str] = {}


def _bad_call_params() -> list[Any]:
    return [
        pytest.param(
            *case[1:],
            id=case[0],
            marks=[
                pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[case[0]]),
                pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
            ]
            if case[0] in KNOWN_BUGS
            else [],
        )
        for case in BAD_CALLS
    ]


def _good_config() -> tuple[TrainerStepConfig, TrainerStepStats, Arena]:
    stats, arena = TrainerStepStats(), Arena()
    return TrainerStepConfig(relations=pair_relations(3), stats=stats, arena=arena), stats, arena


def _good_step(trainer: Trainer) -> tuple[TrainerStepStats, torch.Tensor]:
    config, stats, _ = _good_config()
    return stats, trainer.on(trainer.executor).step(MODS, TEXTS, config)


@pytest.fixture(scope="module")
def reference(executor: Executor):
    """One good step, a snapshot, a second good step: what a trainer that got a refused call between them
    must match."""
    trainer = Trainer.init_vram(executor, make_config())
    try:
        yield two_good_steps(trainer, _good_step)
    finally:
        trainer.close()


def test_the_good_call_is_good(make_trainer) -> None:
    trainer = make_trainer()
    _good_step(trainer)
    assert trainer.steps_taken == 1
    # The tape form of the same items is the same step.
    twin = make_trainer()
    config, _, _ = _good_config()
    twin.on(twin.executor).step(MODS, (DATA, TAPE_OFFSETS), config)
    assert_same(snapshot(trainer), snapshot(twin))


@pytest.mark.parametrize("verb", ["on", "deferred"])
@pytest.mark.parametrize(
    ("modalities", "contents", "config", "error", "field"),
    _bad_call_params(),
)
def test_a_refused_call_changes_nothing(
    make_trainer, reference, verb: str, modalities, contents, config, error, field: str
) -> None:
    assert_refusal_changes_nothing(
        make_trainer(), reference, _good_step, verb, modalities, contents, config, error, field
    )


def test_a_refused_call_does_not_touch_the_callers_stats_or_arena(make_trainer) -> None:
    trainer = make_trainer()
    stats, arena = TrainerStepStats(loss=123.0, step=99), Arena()
    bad = TrainerStepConfig(relations=_attract(OK_OFFSETS, [3, 4, 5, 0, 1, N]), stats=stats, arena=arena)
    with pytest.raises(ValueError, match=r"relations\.attract\.ids"):
        trainer.step(MODS, TEXTS, bad)
    assert stats == TrainerStepStats(loss=123.0, step=99)
    assert arena.embeddings is None


def test_a_step_failing_after_its_checks_changes_nothing(make_trainer, reference, monkeypatch) -> None:
    """A step that fails past the checks (here: its prepare stage, made to fail on purpose) is not taken: the
    steps queued behind it keep the numbering and the draws of a run that never saw it."""
    import uform.trainer as trainer_module

    if not hasattr(trainer_module, "prepare"):
        pytest.skip("the trainer no longer prepares its batches through uform.trainer.prepare")
    original = trainer_module.prepare

    def failing(config, modalities, contents, **kwargs):
        if bytes(contents[0]) == b"fail here":
            raise RuntimeError("the prepare stage failed")
        return original(config, modalities, contents, **kwargs)

    monkeypatch.setattr(trainer_module, "prepare", failing)
    first, second, reference_stats, reference_out = reference
    trainer = make_trainer()
    _good_step(trainer)
    with pytest.raises(RuntimeError, match="prepare stage"):
        trainer.step(["text"], ["fail here"])
    assert trainer.steps_taken == 1
    assert_same(snapshot(trainer), first)
    # Deferred: the failing step sits between two good ones in the queue.
    bad = trainer.deferred(trainer.executor).step(["text"], ["fail here"])
    config, stats, _ = _good_config()
    good = trainer.deferred(trainer.executor).step(MODS, TEXTS, config)
    assert isinstance(bad.exception(timeout=60), RuntimeError)
    assert_same_output(good.result(timeout=60), reference_out)
    assert stats == reference_stats
    assert trainer.steps_taken == 2
    assert_same(snapshot(trainer), second)
    stats, _ = step_with(trainer)
    assert stats.step == 3


def test_steps_and_saves_apply_in_call_order(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    verbs = trainer.deferred(trainer.executor)
    futures = [verbs.step(MODS, TEXTS), verbs.save(tmp_path / "one.safetensors"), verbs.step(MODS, TEXTS)]
    futures.append(verbs.save(tmp_path / "two.safetensors"))
    for f in futures:
        f.result(timeout=60)
    from uform.replica.checkpoint import read_metadata

    assert read_metadata(tmp_path / "one.safetensors")["uform.step"] == "1"
    assert read_metadata(tmp_path / "two.safetensors")["uform.step"] == "2"
    assert trainer.steps_taken == 2


@pytest.mark.parametrize(
    ("form", "scale", "bias"),
    [
        (uform.PairLossForm.Derived, 10.0, -10.0),
        (uform.PairLossForm.Sigmoid, 10.0, -10.0),
        (uform.PairLossForm.Balanced, 1.0, 0.0),
        (uform.PairLossForm.Ranked, 1.0, 0.0),
    ],
)
def test_temperatures_start_as_the_seed_says(make_trainer, form, scale: float, bias: float) -> None:
    trainer = make_trainer(contrastive=uform.Contrastive(pair_loss=form, temperature_groups=3))
    t = trainer.network.temperatures
    assert torch.allclose(t.log_inverse_temperature.exp(), torch.full((3,), scale))
    assert torch.equal(t.bias.detach(), torch.full((3,), bias))


def test_temperature_groups_train_their_own_pair(make_trainer) -> None:
    trainer = make_trainer(contrastive=uform.Contrastive(temperature_groups=3))
    stats = TrainerStepStats()
    trainer.step(
        MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3), temperature_groups=[0, 1, 0, 1, 0, 1], stats=stats)
    )
    bias = trainer.network.temperatures.bias.detach()
    assert bias[0] != -10.0 and bias[1] != -10.0
    assert bias[2] == -10.0, "a group no item selects gets no update"
    assert stats.contrastive_loss > 0


BAD_CONFIGS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("hidden not a multiple of 128", {"hidden": 100}, ValueError, "hidden"),
    ("hidden zero with depth", {"hidden": 0}, ValueError, "hidden"),
    ("depth zero", {"depth": 0}, ValueError, "depth"),
    ("depth not an int", {"depth": "2"}, TypeError, "depth"),
    ("seed negative", {"seed": -1}, ValueError, "seed"),
    ("unknown objective", {"objective": "dreaming"}, ValueError, "objective"),
    ("no steps", {"schedule": Schedule(steps=0)}, ValueError, "schedule.steps"),
    ("warmup past steps", {"schedule": Schedule(steps=10, warmup_steps=11)}, ValueError, "schedule.warmup_steps"),
    (
        "floor above peak",
        {"schedule": Schedule(steps=10, learning_rate=1e-4, min_learning_rate=1e-3)},
        ValueError,
        "schedule.min_learning_rate",
    ),
    (
        "no rows",
        {"batch": BatchShape(max_segments_per_device=8, max_columns_per_row=64)},
        ValueError,
        "batch.max_rows_per_device",
    ),
    (
        "rows too narrow",
        {"batch": BatchShape(max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=2)},
        ValueError,
        "batch.max_columns_per_row",
    ),
    ("batch of a wrong type", {"batch": {"max_rows_per_device": 2}}, TypeError, "batch"),
    (
        "image channels out of range",
        {
            "batch": BatchShape(
                max_rows_per_device=2,
                max_segments_per_device=8,
                max_columns_per_row=64,
                image=ImageShape(patch_side=16, channels=2),
            )
        },
        ValueError,
        "batch.image.channels",
    ),
    (
        "late interaction width not a multiple of 8",
        {"late_interaction": LateInteraction(weight=1.0, width=12)},
        ValueError,
        "late_interaction.width",
    ),
    ("choices without legal bytes", {"choices": uform.Choices(weight=1.0)}, ValueError, "choices.weight"),
    (
        "mask probability above one",
        {"masking": Masking(token_mask_probability=1.5)},
        ValueError,
        "masking.token_mask_probability",
    ),
    (
        "matryoshka width not a multiple of 8",
        {"contrastive": uform.Contrastive(matryoshka_dimensions=(12,))},
        ValueError,
        "contrastive.matryoshka_dimensions",
    ),
    ("progress_steps negative", {"progress_steps": -1}, ValueError, "progress_steps"),
    ("a mesh of a wrong type", {"mesh": object()}, TypeError, "mesh"),
]


@pytest.mark.parametrize(("overrides", "error", "field"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_init_config_raises_before_any_trainer_exists(
    monkeypatch, executor: Executor, overrides: dict[str, Any], error: type[Exception], field: str
) -> None:
    made: list[Trainer] = []
    original = Trainer.__init__

    def counting(self, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", counting)
    config = make_config(**overrides)
    before = repr(config)
    with pytest.raises(error) as caught:
        Trainer.init_vram(executor, config)
    assert field in str(caught.value), f"{caught.value!r} does not name {field}"
    assert made == [], "a trainer was built before the refusal"
    assert repr(config) == before, "the caller's config changed"


def test_init_refuses_wrong_argument_types(executor: Executor) -> None:
    with pytest.raises(TypeError, match="executor"):
        Trainer.init_vram("cpu", make_config())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        Trainer.init_vram(executor, dataclasses.asdict(make_config()))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Trainer(executor, make_config())


def test_world_compile_is_whole_or_blocks(executor: Executor) -> None:
    trainer = Trainer.init_vram(executor, make_config())
    assert trainer.world_compile == "whole"  # the default: one graph per step (BENCHMARKS.md, weak scaling)
    trainer.close()
    trainer = Trainer.init_vram(executor, make_config(), world_compile="blocks")
    assert trainer.world_compile == "blocks"
    trainer.close()
    for bad, error in (("block", ValueError), ("", ValueError), (None, TypeError), (1, TypeError)):
        with pytest.raises(error, match="world_compile: expected 'whole' or 'blocks'"):
            Trainer.init_vram(executor, make_config(), world_compile=bad)  # type: ignore[arg-type]


def test_init_refuses_a_file_that_is_no_checkpoint(executor: Executor, tmp_path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14)
    with pytest.raises(ValueError):
        Trainer.init_vram(executor, make_config(resume=junk))


# --------------------------------------------------------------------------------------------------
# 7. Verbs


def test_blocking_verbs_agree(make_trainer) -> None:
    a, b, c = make_trainer(), make_trainer(), make_trainer()
    config_a, stats_a, _ = _good_config()
    config_b, stats_b, _ = _good_config()
    config_c, stats_c, _ = _good_config()
    out_a = a.on(a.executor).step(MODS, TEXTS, config_a)
    out_b = b.step(MODS, TEXTS, config_b)
    out_c = c.on(c.executor).step([uform.Modality.Text] * N, [t.encode() for t in TEXTS], config_c)
    assert stats_a == stats_b == stats_c
    assert_same_output(out_a, out_b)
    assert_same_output(out_a, out_c)
    assert_same(snapshot(a), snapshot(b))
    assert_same(snapshot(a), snapshot(c))


def test_deferred_answers_a_future_equal_to_the_blocking_path(make_trainer) -> None:
    deferred, blocking = make_trainer(), make_trainer()
    futures, stats = [], []
    for _ in range(3):  # queued back to back, before any is awaited
        config, st, _ = _good_config()
        futures.append(deferred.deferred(deferred.executor).step(MODS, TEXTS, config))
        stats.append(st)
    assert all(isinstance(f, Future) for f in futures)
    outs = [f.result(timeout=60) for f in futures]
    for k in range(3):
        st, out = _good_step(blocking)
        assert stats[k] == st
        assert stats[k].step == k + 1
        assert_same_output(outs[k], out)
    assert deferred.steps_taken == blocking.steps_taken == 3
    assert_same(snapshot(deferred), snapshot(blocking))


def test_deferred_save_answers_a_future(make_trainer, tmp_path) -> None:
    trainer = make_trainer()
    _good_step(trainer)
    future = trainer.deferred(trainer.executor).save(tmp_path / "c.safetensors")
    assert isinstance(future, Future)
    assert future.result(timeout=60) is None
    assert (tmp_path / "c.safetensors").is_file()


def test_deferred_copies_its_arguments(make_trainer, tmp_path) -> None:
    """The caller may reuse its buffers as soon as the deferred call returns."""
    deferred, blocking = make_trainer(), make_trainer()
    _good_step(deferred), _good_step(blocking)

    # Hold the trainer's queue inside a save until the buffers have been overwritten, so the step cannot
    # have run before the caller reuses them.
    release = threading.Event()

    def hold(done: int, total: int) -> bool:
        release.wait(timeout=30)
        return True

    saved = deferred.deferred(deferred.executor).save(
        TrainerSaveConfig(path=tmp_path / "hold.safetensors", progress=hold)
    )
    contents = [bytearray(t.encode()) for t in TEXTS]
    modalities = list(MODS)
    ids = list(OK_IDS)
    bags = [0, 1, 2, 0, 1, 2]
    relations = _attract(list(OK_OFFSETS), ids)
    stats, arena = TrainerStepStats(), Arena()
    future = deferred.deferred(deferred.executor).step(
        modalities, contents, TrainerStepConfig(relations=relations, bags=bags, stats=stats, arena=arena)
    )
    for c in contents:
        c[:] = b"z" * len(c)
    modalities[0] = "image"
    ids[:] = [1, 2, 3, 4, 5, 0]
    bags[:] = [5, 4, 3, 2, 1, 0]
    relations.attract = Edges()
    release.set()
    saved.result(timeout=60)
    out = future.result(timeout=60)

    expected_stats = TrainerStepStats()
    expected = blocking.step(
        MODS,
        TEXTS,
        TrainerStepConfig(
            relations=_attract(OK_OFFSETS, OK_IDS), bags=[0, 1, 2, 0, 1, 2], stats=expected_stats, arena=Arena()
        ),
    )
    assert stats == expected_stats
    assert_same_output(out, expected)
    assert_same(snapshot(deferred), snapshot(blocking))


def test_receivers_refuse_another_executor(make_trainer) -> None:
    trainer = make_trainer()
    other = Executor.cpu()
    with pytest.raises(ValueError, match="executor"):
        trainer.on(other)
    with pytest.raises(ValueError, match="executor"):
        trainer.deferred(other)
    assert trainer.steps_taken == 0


def test_arena_rows_are_unit_float32_and_zero_for_dropped_items(make_trainer) -> None:
    trainer = make_trainer()
    twin = make_trainer()
    texts = overfull_texts(12)
    stats, arena = TrainerStepStats(), Arena()
    out = trainer.step(["text"] * 12, texts, TrainerStepConfig(stats=stats, arena=arena))
    assert out is not None
    assert out.dtype == torch.float32
    assert tuple(out.shape) == (12, 128)
    assert arena.embeddings is out or torch.equal(arena.embeddings, out)
    present = arena.present
    assert present is not None and present.dtype == torch.bool and tuple(present.shape) == (12,)
    assert 0 < int((~present).sum()) == stats.dropped
    assert int(present.sum()) <= SEGMENTS
    norms = out.norm(dim=1)
    assert torch.allclose(norms[present], torch.ones(int(present.sum())), atol=1e-5)
    assert torch.equal(out[~present], torch.zeros(int((~present).sum()), 128))

    # The rows are the pooled embeddings the loss scored, before the update, item by item.
    batch, (_, embeddings) = direct_terms(twin, texts, None)
    expected = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    slots = torch.from_numpy(batch.layout.slot)
    assert torch.equal(slots >= 0, present)
    assert torch.allclose(out[present], expected[slots[present]], atol=1e-6)


@pytest.mark.parametrize(
    ("scalar", "dtype"),
    [(Scalar.I8, torch.int8), (Scalar.F16, torch.float16), (Scalar.BF16, torch.bfloat16), ("f16", torch.float16)],
)
def test_outputs_scalar_sets_the_arena_dtype(make_trainer, scalar, dtype) -> None:
    f32_trainer, other = make_trainer(), make_trainer()
    _, f32 = step_with(f32_trainer)
    stats, arena = TrainerStepStats(), Arena()
    out = other.step(
        MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3), stats=stats, arena=arena, outputs_scalar=scalar)
    )
    assert out.dtype == dtype
    assert tuple(out.shape) == (N, 128)
    if dtype == torch.int8:
        assert torch.equal(out, (f32 * 127).round().clamp(-127, 127).to(torch.int8))
    else:
        assert torch.equal(out, f32.to(dtype))
    assert_same(snapshot(f32_trainer), snapshot(other))  # the landing type changes nothing else


def test_no_arena_answers_none(make_trainer) -> None:
    trainer = make_trainer()
    assert trainer.step(MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3))) is None
    assert trainer.step(MODS, TEXTS) is None
    assert trainer.steps_taken == 2


def test_stats_step_counts_from_one_and_every_field_is_overwritten(make_trainer) -> None:
    trainer = make_trainer()
    for k in range(1, 4):
        stats = TrainerStepStats(
            masked_image_loss=5.0, late_interaction_loss=6.0, choices_loss=7.0, truncated=99, dropped=99
        )
        trainer.step(MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3), stats=stats))
        assert stats.step == k == trainer.steps_taken
        assert isinstance(stats.step, int) and isinstance(stats.truncated, int) and isinstance(stats.dropped, int)
        assert stats.masked_image_loss == stats.masked_video_loss == stats.masked_audio_loss == 0.0
        assert stats.late_interaction_loss == stats.choices_loss == 0.0
        assert stats.truncated == stats.dropped == 0
        assert all(
            isinstance(getattr(stats, f), float)
            for f in ("loss", "contrastive_loss", "masked_text_loss", "learning_rate")
        )


def test_truncated_counts_items_longer_than_a_row(make_trainer) -> None:
    trainer = make_trainer()
    texts = ["x" * (COLUMNS + 10), "short one", "y" * (3 * COLUMNS), "z" * (COLUMNS - 1)]
    stats, arena = TrainerStepStats(), Arena()
    trainer.step(["text"] * 4, texts, TrainerStepConfig(stats=stats, arena=arena))
    # The prefix takes a column: only the first and third items are cut, and both were placed.
    placed = arena.present.tolist()
    assert stats.truncated == sum(placed[i] for i in (0, 2))
    assert stats.truncated >= 1


def test_dropped_accumulates_until_stats_are_read(make_trainer) -> None:
    trainer = make_trainer()
    texts = overfull_texts(12)

    def step(stats: TrainerStepStats | None) -> int:
        arena = Arena()
        trainer.step(["text"] * 12, texts, TrainerStepConfig(stats=stats, arena=arena))
        return int((~arena.present).sum())

    first = step(None)
    second = step(None)
    stats = TrainerStepStats()
    third = step(stats)
    assert first > 0 and second > 0 and third > 0
    assert stats.dropped == first + second + third
    stats = TrainerStepStats()
    fourth = step(stats)
    assert stats.dropped == fourth
    stats = TrainerStepStats()
    trainer.step(MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3), stats=stats))
    assert stats.dropped == 0
    assert stats.step == 5


@pytest.mark.parametrize("objective", [Objective.Masked, Objective.Contrastive, Objective.Joint])
def test_loss_terms_per_objective(make_trainer, objective: Objective) -> None:
    trainer = make_trainer(objective=objective, masking=Masking(text_weight=0.5))
    stats, _ = step_with(trainer)
    if objective == Objective.Contrastive:
        assert stats.masked_text_loss == 0.0
    else:
        assert stats.masked_text_loss > 0
    if objective == Objective.Masked:
        assert stats.contrastive_loss == 0.0
    else:
        assert stats.contrastive_loss > 0
    assert stats.loss == pytest.approx(stats.contrastive_loss + 0.5 * stats.masked_text_loss, rel=1e-6, abs=1e-7)
    assert np.isfinite([stats.loss, stats.contrastive_loss, stats.masked_text_loss]).all()


def test_masked_run_ignores_relations(make_trainer) -> None:
    """Relations are read unless the objective is masked alone: a masked run takes any."""
    a, b = make_trainer(objective=Objective.Masked), make_trainer(objective=Objective.Masked)
    a.step(MODS, TEXTS, TrainerStepConfig(relations=pair_relations(3)))
    b.step(MODS, TEXTS)
    assert_same(snapshot(a), snapshot(b))


# --------------------------------------------------------------------------------------------------
# 8. Learning


def test_a_short_run_decreases_the_loss(make_trainer) -> None:
    trainer = make_trainer(schedule=Schedule(steps=30, warmup_steps=3, learning_rate=2e-3), seed=11)
    losses = []
    for _ in range(30):
        stats, _ = step_with(trainer, arena=False)
        losses.append(stats.loss)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < losses[0], losses


def test_weights_come_after_the_answers_of_the_steps_they_include(make_trainer, monkeypatch) -> None:
    """The steps' futures resolve on the completion thread, the copy on the device thread: `weights()` must not
    answer before the steps it includes are answered, however late the completion thread runs."""
    import uform.replica.replica as replica_module

    complete = replica_module._complete

    def late(finish, done) -> None:
        time.sleep(0.3)
        complete(finish, done)

    monkeypatch.setattr(replica_module, "_complete", late)
    trainer = make_trainer()
    futures = [trainer.deferred(trainer.executor).step(["text"] * 2, ["a deferred", "pair"]) for _ in range(2)]
    weights = trainer.weights()
    assert all(f.done() for f in futures) and weights.step == 2
    trainer.close()


def test_weights_are_a_copy_after_every_step_called(make_trainer) -> None:
    """`Trainer.weights()` on one device: the network's state after the steps called before it (deferred ones
    included), a copy that later steps leave alone, and the network it builds serves those weights."""
    trainer = make_trainer()
    futures = [trainer.deferred(trainer.executor).step(["text"] * 2, ["a deferred", "pair"]) for _ in range(2)]
    weights = trainer.weights()
    assert all(f.done() for f in futures) and weights.step == 2 == trainer.steps_taken
    live = trainer.network.state_dict()
    assert sorted(weights.tensors) == sorted(live)
    assert all(torch.equal(weights.tensors[k], live[k]) and weights.tensors[k].device.type == "cpu" for k in live)
    step_with(trainer)
    assert any(not torch.equal(weights.tensors[k], trainer.network.state_dict()[k]) for k in live)
    rebuilt = weights.network(torch.device("cpu")).state_dict()
    assert all(torch.equal(rebuilt[k], weights.tensors[k]) for k in live)
    trainer.close()
    with pytest.raises(ValueError, match="closed"):
        trainer.weights()
