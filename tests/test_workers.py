"""An executor of several devices: routing by bag, the worker processes, merged stats and arenas.

CI has no GPUs, so the workers are CPU "devices" (`Executor.cpu(workers=2)`); the path is the one an
executor of several CUDA devices takes (one worker process per device, each a rank of a gloo world here).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import world_cases as wc
from safetensors import safe_open

from uform import (
    Arena,
    Edges,
    Executor,
    Mesh,
    MeshError,
    MeshOptions,
    Relations,
    Stopped,
    Trainer,
    TrainerInitVramConfig,
    TrainerSaveConfig,
    TrainerStepStats,
)
from uform.enums import Modality
from uform.notices import CapacityWarning
from uform.relations import first_crossing, restrict
from uform.replica.checkpoint import CheckpointError, read_metadata
from uform.runtime.workers import ProgressRelay, item_sizes, route

# --------------------------------------------------------------------------------------------------
# Routing


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
def test_a_bag_never_splits_and_bags_balance(seed: int, devices: int) -> None:
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 60))
    bags = rng.integers(0, max(1, count // 2), size=count)
    sizes = rng.integers(1, 200, size=count)
    plan = route(sizes, bags, devices)
    assert len(plan) == devices
    everything = np.sort(np.concatenate(plan))
    assert np.array_equal(everything, np.arange(count)), "every item lands exactly once"
    for items in plan:
        assert np.all(np.diff(items) > 0), "a device's items keep the caller's order"
    home = {}
    for d, items in enumerate(plan):
        for i in items:
            assert home.setdefault(int(bags[i]), d) == d, "a bag split across devices"
    loads = np.array([sizes[items].sum() for items in plan])
    biggest = max(int(sizes[bags == b].sum()) for b in np.unique(bags))
    assert loads.max() - loads.min() <= biggest, (loads, biggest)  # greedy, largest first
    again = route(sizes, bags, devices)
    assert all(np.array_equal(a, b) for a, b in zip(plan, again, strict=True))


def test_route_without_bags_balances_items() -> None:
    plan = route(np.array([5, 5, 5, 5, 1, 1]), None, 2)
    assert sorted(len(p) for p in plan) == [3, 3]
    assert sorted(int(np.array([5, 5, 5, 5, 1, 1])[p].sum()) for p in plan) == [11, 11]


def test_item_sizes_read_text_bytes_and_give_media_a_row() -> None:
    sizes = item_sizes([Modality.Text, Modality.Text, Modality.Image], [b"abc", b"x" * 500, b"\xff" * 9], 64)
    assert sizes.tolist() == [4, 64, 64]


def test_relations_restrict_to_a_devices_items() -> None:
    relations = Relations(
        attract=Edges(offsets=[0, 1, 2, 3, 4], ids=[1, 0, 3, 2], weights=[1.0, 2.0, 3.0, 4.0]),
        repel=Edges(offsets=[0, 1, 1, 1, 1], ids=[3]),
    )
    assert first_crossing(relations, 4, np.array([0, 0, 1, 1])) == ("repel", 0, 3)
    assert first_crossing(relations, 4, np.array([0, 0, 0, 0])) is None
    share = restrict(relations, np.array([2, 3]), 4)
    assert list(share.attract.offsets) == [0, 1, 2] and list(share.attract.ids) == [1, 0]
    assert list(share.attract.weights) == [3.0, 4.0]
    assert list(share.repel.offsets) == [0, 0, 0] and list(share.repel.ids) == []
    assert list(share.ignore.offsets) == []


# --------------------------------------------------------------------------------------------------
# Two CPU workers


@pytest.fixture(scope="module")
def two() -> Executor:
    executor = Executor.cpu(workers=2)
    yield executor
    executor.close()


def reference(case: int, steps: list[int], bags: list[int] | None = None) -> tuple[list, torch.Tensor]:
    trainer = Trainer.init_vram(Executor.cpu(), wc.config(*wc.CASES[case][1:]))
    out = wc.run_steps(trainer, list(range(wc.BAGS)) if bags is None else bags, steps)
    arena = Arena()
    texts, config = wc.step_inputs(list(range(wc.BAGS)) if bags is None else bags, steps[-1] + 1)
    config.arena = arena
    trainer.step(["text"] * len(texts), texts, config)
    trainer.close()
    return out, arena.embeddings


def test_a_mesh_over_the_workers_describes_them(two: Executor) -> None:
    with Mesh.bootstrap(two, MeshOptions(job="fleet", timeout_seconds=60)) as mesh:
        d = mesh.describe()
        assert (d.host_count, d.devices_per_host, d.world_size, d.ranks) == (1, 2, 2, (0, 1))
        with pytest.raises(MeshError, match="already belong"):
            Mesh.bootstrap(two, MeshOptions(job="again", timeout_seconds=60))
        trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:], mesh=mesh))
        texts, config = wc.step_inputs([0, 1], 1)
        trainer.step(["text"] * len(texts), texts, config)
        with pytest.raises(ValueError, match="still open"):
            mesh.close()
        trainer.close()


@pytest.mark.parametrize("case", [0, 5, 6], ids=[wc.CASES[c][0] for c in (0, 5, 6)])
def test_the_workers_step_as_one_process_alone(two: Executor, case: int) -> None:
    """Bags of unequal sizes (routed largest first, so not in the caller's order): the same stats and the
    same embeddings, in the caller's order, as one process stepping every item."""
    ours, embeddings = reference(case, [1, 2])
    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[case][1:]))
    theirs = wc.run_steps(trainer, list(range(wc.BAGS)), [1, 2])
    arena = Arena()
    texts, config = wc.step_inputs(list(range(wc.BAGS)), 3)
    config.arena = arena
    answered = trainer.on(two).step(["text"] * len(texts), texts, config)
    trainer.close()
    for a, b in zip(theirs, ours, strict=True):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
    assert answered is arena.embeddings and arena.present is not None and bool(arena.present.all())
    assert torch.allclose(answered, embeddings, atol=1e-5)


def test_deferred_save_and_resume(two: Executor, tmp_path: Path) -> None:
    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:]))
    futures = []
    for step in (1, 2):
        texts, config = wc.step_inputs(list(range(wc.BAGS)), step)
        config.stats = TrainerStepStats()
        futures.append((trainer.deferred(two).step(["text"] * len(texts), texts, config), config.stats))
    saved = trainer.deferred(two).save(tmp_path / "fleet.safetensors")
    assert saved.result() is None
    assert [f.result() for f, _ in futures] == [None, None] and [s.step for _, s in futures] == [1, 2]
    assert trainer.steps_taken == 2
    trainer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["fleet.safetensors"]
    resumed = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:], resume=str(tmp_path / "fleet.safetensors")))
    assert resumed.steps_taken == 2
    theirs = wc.run_steps(resumed, list(range(wc.BAGS)), [3])
    resumed.close()
    ours, _ = reference(0, [1, 2, 3])
    assert theirs[0]["step"] == 3 and abs(theirs[0]["loss"] - ours[2]["loss"]) <= 1e-5 * abs(ours[2]["loss"])


def test_counts_add_up_over_the_devices(two: Executor) -> None:
    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:]))
    texts = ["x" * 100, "y" * 90, *(f"item {i}" for i in range(40))]  # two cut at a row; too many to hold
    stats = TrainerStepStats()
    from uform import TrainerStepConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.step(["text"] * len(texts), texts, TrainerStepConfig(stats=stats))
        trainer.step(["text"] * len(texts), texts, TrainerStepConfig())
    # The workers' warnings reach this process once per kind (not once per worker or step), counted over both.
    shown = sorted(str(w.message) for w in caught if issubclass(w.category, CapacityWarning))
    assert len(shown) == 2, shown
    assert "a step cut" in shown[0] and "batch.max_columns_per_row" in shown[0]
    assert "a step dropped" in shown[1] and "batch.max_segments_per_device" in shown[1]
    assert trainer.notices.count("capacity.dropped") == 2 * stats.dropped
    assert trainer.notices.count("capacity.truncated") == 2 * stats.truncated
    alone = Trainer.init_vram(Executor.cpu(), wc.config(*wc.CASES[0][1:]))
    one = TrainerStepStats()
    alone.step(["text"] * len(texts), texts, TrainerStepConfig(stats=one))
    alone.close()
    trainer.close()
    assert stats.truncated == 2 and one.truncated == 2
    assert stats.dropped == len(texts) - 2 * 16 and one.dropped == len(texts) - 16


def test_a_device_without_items_still_steps(two: Executor) -> None:
    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:]))
    theirs = wc.run_steps(trainer, [2], [1])  # one bag: one device has nothing this step
    trainer.close()
    ours, _ = reference(0, [1], bags=[2])
    assert abs(theirs[0]["loss"] - ours[0]["loss"]) <= 1e-5 * abs(ours[0]["loss"])


def test_a_step_skipped_as_non_finite_is_no_step_taken(two: Executor) -> None:
    """One device's edges weigh 1e38 (its Sigmoid sum overflows): every worker skips, the merged stats count
    it, and the workers's `steps_taken` counts the updates applied, not the calls."""
    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:]))
    try:
        wc.run_steps(trainer, list(range(wc.BAGS)), [1])
        texts, config = wc.step_inputs(list(range(wc.BAGS)), 2)
        config.relations.attract.weights = [1e38] * 4 + list(config.relations.attract.weights[4:])  # bag 0's
        config.stats = TrainerStepStats()
        trainer.step(["text"] * len(texts), texts, config)
        assert config.stats.nonfinite == 1 and config.stats.step == 2
        assert trainer.steps_taken == 1
        wc.run_steps(trainer, list(range(wc.BAGS)), [3])
        assert trainer.steps_taken == 2
    finally:
        trainer.close()


def test_an_edge_across_bags_is_refused_and_changes_nothing(two: Executor) -> None:
    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:]))
    texts, config = wc.step_inputs([0, 1], 1)
    config.bags = list(range(len(texts)))  # every item its own bag: the pairs could land apart
    with pytest.raises(ValueError, match="different bags"):
        trainer.step(["text"] * len(texts), texts, config)
    assert trainer.steps_taken == 0
    theirs = wc.run_steps(trainer, [0, 1], [1])
    assert theirs[0]["step"] == 1
    trainer.close()


def test_a_killed_worker_fails_the_step_clearly(tmp_path: Path) -> None:
    executor = Executor.cpu(workers=2)
    try:
        with Mesh.bootstrap(executor, MeshOptions(job="doomed", timeout_seconds=20)) as mesh:
            trainer = Trainer.init_vram(executor, wc.config(*wc.CASES[0][1:], mesh=mesh))
            wc.run_steps(trainer, list(range(wc.BAGS)), [1])
            os.kill(executor.workers.pids[1], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(MeshError, match="mesh: ") as caught:
                wc.run_steps(trainer, list(range(wc.BAGS)), [2])
            assert time.monotonic() - start < 20
            assert "restart every process" in str(caught.value)
            with pytest.raises(MeshError):
                wc.run_steps(trainer, list(range(wc.BAGS)), [3])
            trainer.close()
    finally:
        executor.close()


def test_late_interaction_and_choices_route_with_their_items(two: Executor) -> None:
    """Sides and choice tapes travel with their items to the device of their bag: under Named negatives
    (late pairs never cross a bag) the workers' late-interaction and choices terms are one process's."""
    from uform import BatchShape, Choices, LateInteraction, Negatives, Objective, PairLossForm

    run = wc.config(
        Objective.Joint,
        PairLossForm.Sigmoid,
        Negatives.Named,
        batch=BatchShape(
            max_rows_per_device=6, max_segments_per_device=16, max_columns_per_row=64, max_choices_per_item=4
        ),
        late_interaction=LateInteraction(weight=1.0, width=16, max_query_span=8),
        choices=Choices(weight=0.5),
    )
    bags = list(range(wc.BAGS))

    def steps(trainer: Trainer) -> list[TrainerStepStats]:
        out = []
        for step in (1, 2):
            texts, config = wc.step_inputs(bags, step)
            config.sides = ["query" if i % 2 == 0 else "document" for i in range(len(texts))]
            legal = [b"xyz" if i % 3 == 0 else b"" for i in range(len(texts))]
            config.choices = legal
            config.choice_targets = [[0.2, 0.3, 0.5] if c else [] for c in legal]
            config.stats = TrainerStepStats()
            trainer.step(["text"] * len(texts), texts, config)
            out.append(config.stats)
        trainer.close()
        return out

    ours = steps(Trainer.init_vram(Executor.cpu(), run))
    theirs = steps(Trainer.init_vram(two, run))
    for a, b in zip(theirs, ours, strict=True):
        assert b.late_interaction_loss > 0 and b.choices_loss > 0
        for name in ("loss", "late_interaction_loss", "choices_loss", "masked_text_loss", "contrastive_loss"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-5), name


# --------------------------------------------------------------------------------------------------
# Progress, relayed from the workers: the reports, stops and failures of one device


RUN = wc.config(*wc.CASES[0][1:])
EVERY_BAG = list(range(wc.BAGS))


def resuming(path: Path, **fields: Any) -> TrainerInitVramConfig:
    """The run of `RUN`, resumed from `path`."""
    return wc.config(*wc.CASES[0][1:], resume=path, **fields)


class Boom(Exception):
    """A progress callback's own failure."""


def recorded(calls: list[tuple[int, int]], answer: Callable[[int, int], bool | None] = lambda d, t: None) -> Any:
    """A progress callback that records its reports in `calls` and answers what `answer` does."""

    def progress(done: int, total: int) -> bool | None:
        calls.append((done, total))
        return answer(done, total)

    return progress


def stop_at(which: str) -> Callable[[int, int], bool]:
    return lambda done, total: which == "last" and done < total


def test_the_relay_decides_each_point_once_for_every_worker() -> None:
    """First arrival decides: the callback hears each point once; a worker behind gets the verdict at once, a
    worker at the point being decided waits for it; a stop at a point stops every worker there."""
    calls: list[tuple[int, int]] = []
    replies: list[tuple[int, int, str]] = []
    decisions: list[Callable[[], None]] = []
    relay = ProgressRelay(
        recorded(calls, lambda done, total: done < 3), lambda *reply: replies.append(reply), decisions.append
    )
    relay.report(0, 10, 1, 4)
    relay.report(1, 11, 1, 4)  # point 0 is being decided: worker 1 waits for the same verdict
    assert calls == [] and replies == [] and len(decisions) == 1
    decisions.pop()()
    assert calls == [(1, 4)] and replies == [(0, 10, "go"), (1, 11, "go")]
    for done in (2, 3):
        relay.report(0, 10, done, 4)
        decisions.pop()()
    relay.report(1, 11, 2, 4)  # behind: decided already
    relay.report(1, 11, 3, 4)
    assert decisions == [] and calls == [(1, 4), (2, 4), (3, 4)]
    assert replies[2:] == [(0, 10, "go"), (0, 10, "stop"), (1, 11, "go"), (1, 11, "stop")]
    assert relay.failure is None


def test_a_relay_whose_callback_raises_stops_every_worker() -> None:
    error = Boom("the callback failed")
    replies: list[tuple[int, int, str]] = []

    def boom(done: int, total: int) -> None:
        raise error

    relay = ProgressRelay(boom, lambda *reply: replies.append(reply), lambda decide: decide())
    relay.report(1, 11, 1, 4)
    relay.report(0, 10, 1, 4)
    assert relay.failure is error and replies == [(1, 11, "raised"), (0, 10, "raised")]


@pytest.fixture(scope="module")
def saved(two: Executor, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workers' checkpoint after one step (weights and moments)."""
    path = tmp_path_factory.mktemp("relay") / "run.safetensors"
    trainer = Trainer.init_vram(two, RUN)
    wc.run_steps(trainer, EVERY_BAG, [1])
    trainer.save(path)
    trainer.close()
    return path


@pytest.mark.parametrize("progress_steps", [0, 4])
def test_a_save_relays_the_reports_of_one_device(two: Executor, tmp_path: Path, progress_steps: int) -> None:
    def reports(executor: Executor, path: Path) -> list[tuple[int, int]]:
        trainer = Trainer.init_vram(executor, RUN)
        wc.run_steps(trainer, EVERY_BAG, [1])
        calls: list[tuple[int, int]] = []
        trainer.save(TrainerSaveConfig(path=path, progress=recorded(calls), progress_steps=progress_steps))
        trainer.close()
        return calls

    ours = reports(Executor.cpu(), tmp_path / "one.safetensors")
    theirs = reports(two, tmp_path / "two.safetensors")
    with safe_open(str(tmp_path / "two.safetensors"), framework="pt") as f:
        total = len(list(f.keys()))
    assert theirs == ours
    assert 1 <= len(ours) <= (progress_steps or 10) and ours[-1] == (total, total)


def test_a_relayed_callback_may_wait_for_an_earlier_step(two: Executor, tmp_path: Path) -> None:
    """The callback runs on a thread of its own: the workers' answers keep coming in while it runs, so it
    may wait for a step called before the save, as on one device (where steps complete on their own thread)."""
    trainer = Trainer.init_vram(two, RUN)
    try:
        texts, config = wc.step_inputs(EVERY_BAG, 1)
        stats = config.stats = TrainerStepStats()
        step = trainer.deferred(two).step(["text"] * len(texts), texts, config)
        calls: list[tuple[int, int]] = []
        threads: set[str] = set()

        def after_the_step(done: int, total: int) -> bool:
            threads.add(threading.current_thread().name)
            return step.result(timeout=60) is None

        progress = recorded(calls, after_the_step)
        saving = trainer.deferred(two).save(TrainerSaveConfig(path=tmp_path / "run.safetensors", progress=progress))
        texts, config = wc.step_inputs(EVERY_BAG, 2)
        later = trainer.deferred(two).step(["text"] * len(texts), texts, config)
        assert saving.result(timeout=120) is None and later.result(timeout=120) is None
        assert calls and calls[-1][0] == calls[-1][1]
        assert stats.step == 1 and trainer.steps_taken == 2
        assert not any(name.startswith("uform-reader") for name in threads), threads
    finally:
        trainer.close()


@pytest.mark.parametrize("progress_steps", [0, 3])
def test_a_resume_merges_the_workers_reports_into_one_devices(two: Executor, saved: Path, progress_steps: int) -> None:
    """Every worker reads the file; the callback hears each point once, as from one device."""
    runs = []
    for executor in (Executor.cpu(), two):
        calls: list[tuple[int, int]] = []
        trainer = Trainer.init_vram(executor, resuming(saved, progress=recorded(calls), progress_steps=progress_steps))
        assert trainer.steps_taken == 1
        trainer.close()
        runs.append(calls)
    ours, theirs = runs
    assert theirs == ours
    assert 1 <= len(ours) <= (progress_steps or 10) and ours[-1][0] == ours[-1][1]


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_stopped_save_is_one_devices_and_the_trainer_goes_on(two: Executor, tmp_path: Path, which: str) -> None:
    path = tmp_path / "run.safetensors"
    trainer = Trainer.init_vram(two, RUN)
    alone = Trainer.init_vram(Executor.cpu(), RUN)
    try:
        wc.run_steps(trainer, EVERY_BAG, [1])
        trainer.save(path)
        before = path.read_bytes()
        wc.run_steps(trainer, EVERY_BAG, [2])  # the run moved on: a finished save would change the file
        wc.run_steps(alone, EVERY_BAG, [1, 2])
        caught, seen = [], []
        for twin in (alone, trainer):  # a stopped save writes nothing, so both may aim at the same file
            calls: list[tuple[int, int]] = []
            with pytest.raises(Stopped) as stopped:
                twin.save(TrainerSaveConfig(path=path, progress=recorded(calls, stop_at(which)), progress_steps=5))
            caught.append(str(stopped.value))
            seen.append(calls)
        assert caught[1] == caught[0] and seen[1] == seen[0]  # the same reports, stopped at the same tensor
        assert path.read_bytes() == before and os.listdir(tmp_path) == ["run.safetensors"]
        deferred = trainer.deferred(two).save(
            TrainerSaveConfig(path=tmp_path / "new.safetensors", progress=stop_at(which))
        )
        assert isinstance(deferred.exception(timeout=120), Stopped)
        assert os.listdir(tmp_path) == ["run.safetensors"]

        # Nothing of the run changed: the next step is the one-device twin's, and the next save writes.
        theirs, ours = wc.run_steps(trainer, EVERY_BAG, [3]), wc.run_steps(alone, EVERY_BAG, [3])
        assert theirs[0]["step"] == 3 and abs(theirs[0]["loss"] - ours[0]["loss"]) <= 1e-5 * abs(ours[0]["loss"])
        trainer.save(path)
        assert path.read_bytes() != before and read_metadata(path)["uform.step"] == "3"
    finally:
        trainer.close()
        alone.close()


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_stopped_resume_is_one_devices(two: Executor, saved: Path, which: str) -> None:
    caught, seen = [], []
    for executor in (Executor.cpu(), two):
        calls: list[tuple[int, int]] = []
        with pytest.raises(Stopped) as stopped:
            Trainer.init_vram(executor, resuming(saved, progress=recorded(calls, stop_at(which))))
        caught.append(str(stopped.value))
        seen.append(calls)
    assert caught[1] == caught[0] and seen[1] == seen[0]  # every worker stopped at the point the callback said
    # Nothing was placed and nothing is held: the workers make the next trainer, which resumes and steps.
    trainer = Trainer.init_vram(two, resuming(saved))
    try:
        assert trainer.steps_taken == 1
        assert wc.run_steps(trainer, EVERY_BAG, [2])[0]["step"] == 2
    finally:
        trainer.close()


def test_a_raising_callback_raises_its_own_error(two: Executor, saved: Path, tmp_path: Path) -> None:
    """As on one device: the call raises the callback's exception (itself) and stops where it raised."""
    error = Boom("the callback failed")

    def boom(calls: list[tuple[int, int]], failure: BaseException) -> Any:
        def answer(done: int, total: int) -> None:
            if len(calls) == 2:
                raise failure

        return recorded(calls, answer)

    calls: list[tuple[int, int]] = []
    with pytest.raises(KeyboardInterrupt):  # BaseException too: raised in the calling thread, not lost
        Trainer.init_vram(two, resuming(saved, progress=boom(calls, KeyboardInterrupt())))
    assert len(calls) == 2

    trainer = Trainer.init_vram(two, resuming(saved))
    try:
        calls.clear()
        with pytest.raises(Boom) as caught:
            trainer.save(TrainerSaveConfig(path=tmp_path / "run.safetensors", progress=boom(calls, error)))
        assert caught.value is error and len(calls) == 2
        calls.clear()
        deferred = trainer.deferred(two).save(
            TrainerSaveConfig(path=tmp_path / "run.safetensors", progress=boom(calls, error))
        )
        assert deferred.exception(timeout=120) is error and len(calls) == 2
        assert os.listdir(tmp_path) == []
        assert wc.run_steps(trainer, EVERY_BAG, [2])[0]["step"] == 2
    finally:
        trainer.close()


def test_a_damaged_checkpoint_is_refused_as_on_one_device(two: Executor, saved: Path, tmp_path: Path) -> None:
    """A worker's CheckpointError crosses back as a CheckpointError (not a RuntimeError around a traceback),
    with one device's message: a byte of the tensor data flipped, so the header still reads and only the
    digest, checked by each worker as it loads, finds it."""
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(saved.read_bytes())
    data[-3] ^= 0x40
    damaged.write_bytes(bytes(data))
    refused = []
    for executor in (Executor.cpu(), two):
        with pytest.raises(CheckpointError) as error:
            Trainer.init_vram(executor, resuming(damaged))
        refused.append(str(error.value))
    assert refused[1] == refused[0]


def test_the_cpu_executor_of_several_workers_is_public_and_checked() -> None:
    assert not Executor.cpu().has_workers()
    two = Executor.cpu(workers=2)
    try:
        assert two.has_workers() and len(two.devices) == 2
    finally:
        two.close()
    for bad, error, field in (
        (dict(workers=True), TypeError, "workers"),
        (dict(workers="2"), TypeError, "workers"),
        (dict(workers=-1), ValueError, "workers"),
        (dict(workers=2, threads=0), ValueError, "threads"),
        (dict(workers=2, threads=1.5), TypeError, "threads"),
    ):
        with pytest.raises(error, match=field):
            Executor.cpu(**bad)


# --------------------------------------------------------------------------------------------------
# Serving and evaluating a trainer of two devices


def test_a_two_device_trainer_serves_and_evaluates_as_one_device_model(two: Executor, tmp_path: Path) -> None:
    """`Model.from_trainer` on a trainer whose networks live in its workers serves a copy of rank 0's weights:
    it encodes bitwise as the one-device model `uform.load` builds from the same weights (the trainer's
    checkpoint), and `evaluate_retrieval` and `encode_texts` give the same figures."""
    from uform import Model, evaluate_retrieval, load
    from uform.evaluate import encode_texts

    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:]))
    try:
        wc.run_steps(trainer, list(range(wc.BAGS)), [1, 2])
        with pytest.raises(ValueError, match="worker processes"):
            trainer.network  # noqa: B018 - the property refuses: this process holds no network
        weights = trainer.weights()
        assert weights.step == 2 == trainer.steps_taken
        served = Model.from_trainer(trainer)
        assert served.step == 2 and served.path is None
        trainer.save(tmp_path / "run.safetensors")
        texts = [f"a {w} by the {v}" for w, v in zip(wc.WORDS, reversed(wc.WORDS), strict=True)]
        with load(tmp_path / "run.safetensors", Executor.cpu(), compiled=False) as alone:
            saved = alone.network.state_dict()
            assert sorted(saved) == sorted(weights.tensors)
            assert all(torch.equal(saved[k], weights.tensors[k]) for k in saved)
            assert torch.equal(served.encode(["text"] * len(texts), texts), alone.encode(["text"] * len(texts), texts))
            queries, documents, relevant = texts[:6], texts[6:] + texts[:6], [[6 + i] for i in range(6)]
            ours = evaluate_retrieval(served, queries, documents, relevant)
            assert ours == evaluate_retrieval(alone, queries, documents, relevant)
            assert set(ours) == {"recall@1", "recall@10", "mrr"}
            assert torch.equal(encode_texts(trainer, texts), alone.encode(["text"] * len(texts), texts))
        served.close()
    finally:
        trainer.close()


# --------------------------------------------------------------------------------------------------
# A step is checked once, in the calling process


def _refuse_step_checks(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> int:
    """In a worker: every uform module's `parse_modalities` (the first check of a step's arguments) raises, or,
    with `argument` "restore", is the real one again. Answers how many modules it replaced."""
    import sys

    from uform.data import items

    real = items.parse_modalities

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a step's arguments were checked again in the worker")

    refuse.real = real  # type: ignore[attr-defined]
    replaced = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("uform.") or name == "uform.data.items" or module is None:
            continue
        found = getattr(module, "parse_modalities", None)
        if found is None:
            continue
        original = getattr(found, "real", found)
        if original is real:
            module.parse_modalities = real if argument == "restore" else refuse
            replaced += 1
    return replaced


def test_a_workers_share_of_a_step_is_not_checked_again(two: Executor) -> None:
    """The calling process checks the step; each worker takes its share as checked (no `TrainerStepConfig`
    rebuilt, no check run again): with the workers' step checks made to raise, the step still runs."""
    trainer = Trainer.init_vram(two, wc.config(*wc.CASES[0][1:]))
    try:
        wc.run_steps(trainer, list(range(wc.BAGS)), [1])  # every module a step uses is loaded in the workers
        assert all(n >= 1 for n in two.workers.everyone(_refuse_step_checks, "refuse"))
        try:
            theirs = wc.run_steps(trainer, list(range(wc.BAGS)), [2])
        finally:
            two.workers.everyone(_refuse_step_checks, "restore")
        with pytest.raises(ValueError, match="modalities"):  # the caller's check still runs
            trainer.step(["not a modality"], ["x"])
    finally:
        trainer.close()
    ours, _ = reference(0, [1, 2])
    assert theirs[0]["step"] == 2 and abs(theirs[0]["loss"] - ours[1]["loss"]) <= 1e-5 * abs(ours[1]["loss"])
