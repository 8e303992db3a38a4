"""Preparer processes (`uform.runtime.preparers`): a trainer's prepare stage (decode, pack, corrupt, pair) in processes of its own.

Pins: the batches a preparer process answers are bitwise the in-process ones (media, text, late interaction,
choices, groups, bags, sides, relations all cross) and hold their own memory, not the slab's; training through
preparer processes (two of them, deferred steps) is bitwise in-process training, warnings included; a strict
MediaError and a decode time limit behave as in process; a killed preparer process fails the step it held with
a clear error, leaves the trainer as it was, and the next step starts a new one; close() leaves no process,
thread or /dev/shm file behind; the slab's fallbacks (no shared memory, areas too small) answer the same; a
trainer in workers worker (a spawned process) uses preparer processes too; preparer processes never load torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same, descendants, snapshot, wait_gone
from media_samples import encode_image, photo, pygame_file, video
from PIL import Image

import uform.runtime.helper
import uform.runtime.preparers
from uform import (
    Arena,
    AudioShape,
    BatchShape,
    Choices,
    Contrastive,
    Edges,
    Executor,
    ImageShape,
    LateInteraction,
    Modality,
    Objective,
    Relations,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    TrainerStepStats,
    VideoShape,
)
from uform.config import resolve
from uform.media.decode import MediaPolicy
from uform.media.limits import MediaError, MediaLimits
from uform.notices import MediaWarning, Notices
from uform.replica.checked_step import check_step
from uform.runtime.preparation import Preparation
from uform.runtime.preparers import PREPARE_SLOTS, PrepareJob, PreparerError, Preparers, prepare_step
from uform.runtime.remote_error import RemoteError, pack_error, unpack_error

SHM = Path("/dev/shm")


def run_config(**overrides: Any) -> TrainerInitVramConfig:
    """A tiny Joint run of every modality with late interaction, choices and two temperature groups."""
    fields: dict[str, Any] = dict(
        depth=1,
        hidden=128,
        objective=Objective.Joint,
        batch=BatchShape(
            max_rows_per_device=4,
            max_segments_per_device=16,
            max_columns_per_row=256,
            max_choices_per_item=4,
            image=ImageShape(patch_side=16),
            video=VideoShape(patch_side=16, tube_frames=2),
            audio=AudioShape(chunk_samples=320),
        ),
        contrastive=Contrastive(temperature_groups=2),
        late_interaction=LateInteraction(weight=0.5, width=16),
        choices=Choices(weight=1.0),
        schedule=Schedule(steps=20, warmup_steps=2, learning_rate=1e-3),
        seed=11,
    )
    fields.update(overrides)
    return TrainerInitVramConfig(**fields)


def jpeg(name: str = "astronaut.png", size: tuple[int, int] = (64, 48)) -> bytes:
    return encode_image(photo(name).convert("RGB").resize(size, Image.Resampling.BOX), "JPEG", quality=90)


def step_arguments(step: int) -> tuple[list[str], list[bytes | str], TrainerStepConfig]:
    """A step of every modality and every per-item field; item 7 is broken (a WAV declared as an image)."""
    items: list[tuple[str, bytes | str]] = [
        ("image", jpeg()),
        ("text", f"an astronaut, step {step}"),
        ("video", video("mp4")[0]),
        ("text", "a coffee cup panning"),
        ("audio", pygame_file("boom.wav")),
        ("text", "a boom"),
        ("text", "which letter?"),
        ("image", pygame_file("boom.wav")),
        ("image", jpeg("coffee.png", (48, 32))),
        ("text", "a coffee cup"),
    ]
    count = len(items)
    linked: list[list[int]] = [[] for _ in range(count)]
    for a, b in ((0, 1), (2, 3), (4, 5), (8, 9)):
        linked[a].append(b)
        linked[b].append(a)
    relations = Relations(
        attract=Edges(offsets=np.cumsum([0] + [len(x) for x in linked]).tolist(), ids=[j for x in linked for j in x])
    )
    choices = [b"abc" if i == 6 else b"" for i in range(count)]
    config = TrainerStepConfig(
        bags=[0, 0, 1, 1, 2, 2, 3, 4, 5, 5],
        temperature_groups=[i % 2 for i in range(count)],
        sides=["query" if i % 2 else "document" for i in range(count)],
        choices=choices,
        choice_targets=[[0.5, 0.25, 0.25] if c else [] for c in choices],
        relations=relations,
    )
    return [m for m, _ in items], [c for _, c in items], config


def media_warnings(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MediaWarning)]


def host_files() -> list[str]:
    return sorted(p.name for p in SHM.glob("uform-host-*")) if SHM.is_dir() else []


@pytest.fixture(scope="module")
def executor() -> Executor:
    return Executor.cpu()


@pytest.fixture(scope="module")
def twins(executor: Executor) -> Iterator[tuple[Trainer, Trainer]]:
    """The same run in process and through two preparer processes."""
    here = Trainer.init_vram(executor, run_config(), media=MediaPolicy(workers=1), host_processes=0)
    away = Trainer.init_vram(executor, run_config(), media=MediaPolicy(workers=2), host_processes=2)
    yield here, away
    here.close()
    away.close()


# ---- the same batches, the same training ------------------------------------------------------------------------


def test_the_default_and_the_argument(executor: Executor) -> None:
    trainer = Trainer.init_vram(executor, run_config())
    assert trainer.host_processes == 0  # the CPU executor's default: its kernels run without the lock
    trainer.close()


def test_the_cuda_default_follows_the_run() -> None:
    """Two preparer processes where media is decoded, one for text alone (a second one made the text step slower
    on the H200), none on the CPU: the rule reads only the executor's device type and the run's modalities."""
    from types import SimpleNamespace

    from uform.runtime.preparation import default_host_processes

    cuda = SimpleNamespace(device=torch.device("cuda"))
    text = run_config(batch=BatchShape(max_rows_per_device=4, max_segments_per_device=16, max_columns_per_row=256))
    assert default_host_processes(cuda, run_config()) == 2  # type: ignore[arg-type]
    assert default_host_processes(cuda, text) == 1  # type: ignore[arg-type]
    for shape in (ImageShape(patch_side=16), VideoShape(patch_side=16), AudioShape(chunk_samples=320)):
        kind = {ImageShape: "image", VideoShape: "video", AudioShape: "audio"}[type(shape)]
        one = dataclasses.replace(text, batch=dataclasses.replace(text.batch, **{kind: shape}))
        assert default_host_processes(cuda, one) == 2, kind  # type: ignore[arg-type]
    assert default_host_processes(SimpleNamespace(device=torch.device("cpu")), run_config()) == 0  # type: ignore[arg-type]
    for bad, error in ((-1, ValueError), (True, TypeError), (1.5, TypeError), ("1", TypeError)):
        with pytest.raises(error, match="host_processes"):
            Trainer.init_vram(executor, run_config(), host_processes=bad)  # type: ignore[arg-type]


def test_host_batches_are_bitwise_the_in_process_ones(twins: tuple[Trainer, Trainer]) -> None:
    here, away = twins
    for step in (101, 102):
        modalities, contents, config = step_arguments(step)
        answers = []
        for trainer in (here, away):
            trainer.notices = Notices()  # each step's media warning is its trainer's first
            checked = trainer.replica.check_step(modalities, contents, config, copy_buffers=False)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                batch, tensors = trainer.replica.prepare(checked, step)
            answers.append((batch, tensors, media_warnings(caught)))
        (a, ta, wa), (b, tb, wb) = answers
        assert wa == wb and len(wa) == 1 and "contents[7]" in wa[0]
        assert sorted(ta) == sorted(tb)
        for name in ta:
            assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
            assert ta[name].stride() == tb[name].stride(), name
        arrays = b.arrays()
        for name, array in a.arrays().items():
            assert array.dtype == arrays[name].dtype and np.array_equal(array, arrays[name]), name
        for field in ("row", "column", "slot", "length", "placed", "truncated"):
            assert np.array_equal(getattr(a.layout, field), getattr(b.layout, field)), field
        for field in ("positives", "late_positives", "truncated", "dropped", "skipped"):
            assert getattr(a, field) == getattr(b, field), field
        assert b.skipped == 1 and b.late and b.choice and b.media["video"]["valid"].any()
        # The host batch holds its own memory: nothing of it is a view of a preparer process's slab.
        host = next(h for h in away.replica.stage.preparers._processes if h is not None and h.slab is not None)  # type: ignore[union-attr]
        slab = np.frombuffer(host.slab, dtype=np.uint8)
        owned = [*arrays.values(), *(t.numpy() for t in tb.values()), *vars(b.layout).values()]
        assert not any(isinstance(x, np.ndarray) and np.shares_memory(x, slab) for x in owned)
        del slab


def test_training_through_host_processes_is_bitwise_in_process_training(twins: tuple[Trainer, Trainer]) -> None:
    here, away = twins
    results = []
    for trainer in (here, away):
        trainer.notices = Notices()
        verbs = trainer.deferred(trainer.executor)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pending = []
            for step in (1, 2, 3, 4):
                modalities, contents, config = step_arguments(step)
                config.stats, config.arena = TrainerStepStats(), Arena()
                pending.append((verbs.step(modalities, contents, config), config))
            out = [(f.result(), c.stats) for f, c in pending]
        results.append((out, sorted(media_warnings(caught)), snapshot(trainer)))
    (ours, our_warnings, our_weights), (theirs, their_warnings, their_weights) = results
    # One warning per trainer however many steps skip an item (it was one per item), each counted.
    assert our_warnings == their_warnings and len(their_warnings) == 1
    assert here.notices.count("media") == away.notices.count("media") == 4
    for (e1, s1), (e2, s2) in zip(ours, theirs, strict=True):
        assert s1 == s2 and s2 is not None and s2.skipped == 1 and s2.late_interaction_loss > 0
        assert torch.equal(e1, e2)
    assert_same(our_weights, their_weights)
    # How many of the two processes a run starts is timing: a step the first finishes before the next is asked
    # for needs no second (seen on the H200 machine's 16 cores). The answers never depend on it (above).
    assert 1 <= len(away.replica.stage.preparers.processes) <= 2  # type: ignore[union-attr]


def test_host_processes_never_load_torch(twins: tuple[Trainer, Trainer]) -> None:
    _, away = twins
    assert away.replica.stage.preparers is not None
    for process in away.replica.stage.preparers.processes:
        for pid in {process.pid, *descendants(process.pid)}:  # the preparer process, its fork server, its decoders
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended meanwhile
                maps = (Path("/proc") / str(pid) / "maps").read_text()
                assert "libtorch" not in maps, pid


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_host_tensors_are_pinned_and_bitwise_the_in_process_ones() -> None:
    """CUDA's default is one preparer process; its answer lands in page-locked memory (one copy out of the slab),
    with the flex block tables, equal to the in-process answer, and steps train."""
    gpu = Executor.for_vram([0])
    here = Trainer.init_vram(gpu, run_config(), media=MediaPolicy(workers=1), host_processes=0)
    away = Trainer.init_vram(gpu, run_config(), media=MediaPolicy(workers=1))
    try:
        assert away.host_processes == 1
        modalities, contents, config = step_arguments(1)
        answers = []
        for trainer in (here, away):
            checked = trainer.replica.check_step(modalities, contents, config, copy_buffers=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                answers.append(trainer.replica.prepare(checked, 1)[1])
        ours, theirs = answers
        assert sorted(ours) == sorted(theirs) and any(k.startswith("block.") for k in theirs)
        for name, tensor in theirs.items():
            assert tensor.is_pinned() and torch.equal(tensor, ours[name]), name
            assert tensor.stride() == ours[name].stride(), name  # the block tables' head axis keeps a real stride
        stats = TrainerStepStats()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            away.step(modalities, contents, dataclasses.replace(config, stats=stats))
        assert stats.step == 1 and stats.skipped == 1 and np.isfinite(stats.loss)
    finally:
        here.close()
        away.close()


# ---- failures -------------------------------------------------------------------------------------------------


def test_strict_media_error_and_time_limit_through_a_host_process(executor: Executor) -> None:
    from test_media_training import SLOW_PIXELS, slow_png

    slow = slow_png()
    started = time.perf_counter()
    uform.media.decode.decode_item(
        "image", slow, {"patch_side": 16, "channels": 4}, 255, MediaLimits(max_pixels=SLOW_PIXELS)
    )
    timeout = min(0.25, (time.perf_counter() - started) / 4)
    if timeout < 0.05:
        pytest.skip("the slow sample decodes too fast here to time out honestly")
    limits = MediaLimits(timeout_seconds=timeout, max_pixels=SLOW_PIXELS)
    strict = Trainer.init_vram(executor, run_config(), media=MediaPolicy(strict=True, workers=1), host_processes=1)
    lenient = Trainer.init_vram(executor, run_config(), media=MediaPolicy(workers=1, limits=limits), host_processes=1)
    try:
        good = (["image", "text"], [jpeg(), "a photo"])
        for trainer in (strict, lenient):
            trainer.step(*good)
        before = snapshot(strict)
        with pytest.raises(MediaError, match=r"contents\[2\]: not a JPEG, PNG or WebP file") as caught:
            strict.step(["text", "image", "image"], ["fine", jpeg(), pygame_file("boom.wav")])
        assert caught.value.item == 2 and not getattr(caught.value, "__notes__", None)
        assert strict.steps_taken == 1
        assert_same(snapshot(strict), before)
        stats = TrainerStepStats()
        strict.step(*good, TrainerStepConfig(stats=stats))
        assert stats.step == 2 and strict.steps_taken == 2

        stats = TrainerStepStats()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            lenient.step(["image", "image", "text"], [jpeg(), slow, "a caption"], TrainerStepConfig(stats=stats))
        warned = media_warnings(record)
        assert len(warned) == 1 and "contents[1]" in warned[0] and "timed out" in warned[0], warned
        assert stats.skipped == 1 and stats.masked_image_loss > 0
    finally:
        strict.close()
        lenient.close()


def test_a_killed_host_process_fails_its_step_and_the_next_step_starts_a_new_one(executor: Executor) -> None:
    trainer = Trainer.init_vram(executor, run_config(), media=MediaPolicy(workers=1), host_processes=1)
    twin = Trainer.init_vram(executor, run_config(), media=MediaPolicy(workers=1), host_processes=0)
    try:
        first = (["image", "text"], [jpeg(), "a photo"])
        for t in (trainer, twin):
            t.step(*first)
        assert trainer.replica.stage.preparers is not None
        (process,) = trainer.replica.stage.preparers.processes
        family = {process.pid, *descendants(process.pid)}
        assert len(family) >= 3  # the preparer process, its decoders' fork server, a decoder
        # Stopped, it cannot answer; the step waits in its pipe, and the kill fails it.
        os.kill(process.pid, signal.SIGSTOP)
        future = trainer.deferred(executor).step(*first)
        deadline = time.monotonic() + 10
        while (
            not any(h is not None and h.pending for h in trainer.replica.stage.preparers._processes)
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        time.sleep(0.2)  # registered, then sent: let the send land in the stopped process's pipe
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(PreparerError, match=r"step 2: the preparer process \(pid \d+\) died \(signal 9\)"):
            future.result(timeout=30)
        assert trainer.steps_taken == 1
        assert not wait_gone(family), "the killed preparer process left processes behind"
        second = (["text", "image"], ["after the crash", jpeg("coffee.png")])
        a, b = TrainerStepStats(), TrainerStepStats()
        trainer.step(*second, TrainerStepConfig(stats=a))
        twin.step(*second, TrainerStepConfig(stats=b))
        assert a == b and a.step == 2
        assert_same(snapshot(trainer), snapshot(twin))
        (again,) = trainer.replica.stage.preparers.processes
        assert again.pid != process.pid
    finally:
        trainer.close()
        twin.close()


def test_close_leaves_nothing_behind(executor: Executor) -> None:
    before = host_files()
    trainer = Trainer.init_vram(executor, run_config(), media=MediaPolicy(workers=2), host_processes=2)
    verbs = trainer.deferred(executor)
    futures = [verbs.step(["image", "image", "text"], [jpeg(), jpeg("coffee.png"), f"item {i}"]) for i in range(4)]
    for f in futures:
        f.result()
    assert trainer.replica.stage.preparers is not None
    family = set()
    for process in trainer.replica.stage.preparers.processes:
        family |= {process.pid, *descendants(process.pid)}
    assert len(family) >= 4
    threads = [trainer.replica._queue, trainer.replica._host, trainer.replica._completion]
    readers = [h.reader for h in trainer.replica.stage.preparers._processes if h is not None]
    assert host_files() == before  # the slabs never keep a name
    trainer.close()
    assert not wait_gone(family), "close() left processes running"
    assert all(r is not None and not r.is_alive() for r in readers)
    assert not any(t.is_alive() for pool in threads for t in pool._threads)
    assert host_files() == before


def started_processes(hosts: Preparers, count: int, seconds: float = 60.0) -> list[Any]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(hosts.processes) < count:
        time.sleep(0.05)
    return hosts.processes


def test_the_first_step_starts_every_process_and_close_ends_those_still_starting() -> None:
    """One step at a time never needs a second process, yet the first step starts it behind the first, so
    a run whose steps go in flight later does not pay its boot then (it used to start on the first step that
    found the others busy). A close while the second still boots ends it as soon as it has booted."""
    config = resolve(run_config())
    hosts = Preparers(2, config, MediaPolicy(workers=1), 0, pin=False)
    try:
        hosts.prepare(text_job(), 1)
        processes = started_processes(hosts, 2)
        assert len(processes) == 2 and all(p.is_alive() for p in processes)
        hosts.prepare(text_job(), 2)  # one at a time: both idle, so the first takes it again
        assert len(hosts.processes) == 2
    finally:
        hosts.close()
    assert not wait_gone({p.pid for p in processes})

    hosts = Preparers(2, config, MediaPolicy(workers=1), 0, pin=False)
    hosts.prepare(text_job(), 1)
    hosts.close()  # the second is most likely still booting
    starters = [t for t in threading.enumerate() if t.name.startswith("uform-host-start-")]
    for t in starters:
        t.join(60)
    assert not any(t.is_alive() for t in starters)
    assert hosts.processes == []


def test_a_process_that_fails_to_start_behind_is_started_again_when_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start behind the first that fails leaves its process unstarted, not the trainer broken: the first
    process takes the steps, and the step that needs the second starts it again and raises its error there."""
    hosts = Preparers(2, resolve(run_config()), MediaPolicy(workers=1), 0, pin=False)
    real = hosts._start
    failures: list[int] = []

    def start(index: int) -> Any:
        if index == 1:
            failures.append(index)
            raise PreparerError("uform: a preparer process failed to start: it did not answer")
        return real(index)

    monkeypatch.setattr(hosts, "_start", start)
    try:
        hosts.prepare(text_job(), 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not failures or hosts._starting):
            time.sleep(0.02)
        assert failures == [1] and hosts._processes[1] is None and not hosts._starting
        host = hosts._processes[0]
        assert host is not None
        host.free.clear()  # the first process busy: the next step needs the second
        with pytest.raises(PreparerError, match="failed to start"):
            hosts.prepare(text_job(), 2)
        assert failures == [1, 1]
        host.free.extend(range(PREPARE_SLOTS))
    finally:
        hosts.close()


# ---- the transport's fallbacks -----------------------------------------------------------------------------------


def text_job(count: int = 12) -> PrepareJob:
    texts = [f"caption number {i} " * (1 + i % 3) for i in range(count)]
    return PrepareJob(modalities=[Modality.Text] * count, contents=[t.encode() for t in texts])


@pytest.mark.parametrize("how", ["slab", "no shared memory", "areas too small"])
def test_the_transport_answers_the_same_whichever_way_it_goes(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    config = resolve(run_config(choices=Choices(), late_interaction=LateInteraction()))
    policy = MediaPolicy(workers=1)
    if how == "no shared memory":
        monkeypatch.setattr(uform.runtime.helper, "create_slab", lambda size, prefix: (None, None))
    hosts = Preparers(1, config, policy, 64, pin=False)  # tables of 64-wide tiles (Hopper's) cross too
    if how == "areas too small":
        hosts.input_bytes, hosts.output_bytes = 64, 4096
    try:
        job = text_job()
        for step in (1, 2, 3):
            batch, tensors, failed = hosts.prepare(job, step)
            expected = prepare_step(config, policy, 64, lambda: None, job, step)  # type: ignore[arg-type,return-value]
            assert failed == [] and sorted(expected.tables)
            tiles = -(-config.batch.max_columns_per_row // 64)
            assert tensors["block.kv_indices"].shape[-2:] == (tiles, tiles)
            for name, array in expected.batch.arrays().items():
                assert np.array_equal(batch.arrays()[name], array) and torch.equal(
                    tensors[name], torch.from_numpy(array)
                )
            for name, table in expected.tables.items():
                assert torch.equal(tensors[f"block.{name}"], torch.from_numpy(table)), name
        (host,) = [h for h in hosts._processes if h is not None]
        assert (host.slab is None) == (how == "no shared memory")
    finally:
        hosts.close()


@pytest.mark.skipif(not SHM.is_dir(), reason="slabs live in /dev/shm")
def test_the_media_arrays_are_built_where_the_answer_crosses() -> None:
    """The step's image patches are stacked straight into the slot's output area, so the answer names them
    there rather than copying them once more (it used to copy them in after the rest, from memory of its own)."""
    config = resolve(run_config())
    policy = MediaPolicy(workers=1)
    hosts = Preparers(1, config, policy, 0, pin=False)
    try:
        contents = [jpeg(), b"one", jpeg("coffee.png"), b"two"]
        batch, _, failed = hosts.prepare(
            PrepareJob(modalities=[Modality.Image, Modality.Text] * 2, contents=contents), 5
        )
        values = batch.media["image"]["values"]
        assert failed == [] and values.shape == (2 * 4 * 3, 16 * 16 * 4)  # two 64 x 48 images, RGBA patches of 16
        (host,) = [h for h in hosts._processes if h is not None]
        assert host.slab is not None
        starts = [s * (hosts.input_bytes + hosts.output_bytes) + hosts.input_bytes for s in range(PREPARE_SLOTS)]
        assert any(bytes(host.slab[at : at + values.nbytes]) == values.tobytes() for at in starts)
    finally:
        hosts.close()


class Interrupted(Future):
    """A step's answer whose wait is interrupted (Ctrl-C in the waiting thread) until it has come."""

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            raise KeyboardInterrupt
        return super().result(timeout)


def test_an_interrupted_wait_keeps_its_slot_until_the_step_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose wait was interrupted is still being prepared into its slot's areas: the slot is not given to
    another step until its answer came back (both would write the same output area)."""
    hosts = Preparers(1, resolve(run_config()), MediaPolicy(workers=1), 0, pin=False)
    host = uform.runtime.preparers._Preparer(0, SimpleNamespace(died=None, process=None))  # type: ignore[arg-type]
    hosts._processes[0] = host
    answer = Interrupted()
    monkeypatch.setattr(hosts, "_send", lambda *_: answer)
    with pytest.raises(KeyboardInterrupt):
        hosts.prepare(text_job(), 1)
    assert host.free == [0]  # the slot of the step in flight stays taken
    answer.set_result(None)  # the answer came (nobody reads it)
    assert sorted(host.free) == list(range(PREPARE_SLOTS))
    hosts.close()


def test_an_exception_that_does_not_pickle_comes_back_as_a_runtime_error() -> None:
    class Local(Exception):  # defined here, so it cannot be unpickled by reference
        pass

    def raised(error: Exception) -> BaseException:
        try:
            raise error
        except Exception as caught:
            return unpack_error(pack_error(caught), "the preparer process")

    error = raised(Local("broken"))
    assert isinstance(error, RemoteError) and isinstance(error, RuntimeError) and str(error) == "Local: broken"
    assert "in the preparer process" in str(error.__cause__) and "raise error" in str(error.__cause__)
    media = raised(MediaError("not a JPEG", item=3))
    assert isinstance(media, MediaError) and str(media) == "contents[3]: not a JPEG" and media.item == 3


# ---- a trainer in workers worker ------------------------------------------------------------------------------


def test_a_trainer_in_a_fleet_worker_uses_host_processes() -> None:
    """An executor of two CPU "devices": each worker is a spawned process whose trainer starts a preparer process;
    the world's losses are one process's (relative 1e-5), media skipped on either device counted."""
    run = run_config(late_interaction=LateInteraction(), choices=Choices())
    modalities = ["image", "text", "image", "text", "image", "text"]
    contents: list[bytes | str] = [jpeg(), "an astronaut", jpeg("coffee.png"), "a cup", b"\xff\xd8 broken", "x"]
    bags = [0, 0, 1, 1, 2, 2]

    shown: list[list[str]] = []

    def steps(trainer: Trainer) -> list[TrainerStepStats]:
        out = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                stats = TrainerStepStats()
                trainer.step(modalities, contents, TrainerStepConfig(bags=bags, stats=stats))
                out.append(stats)
        shown.append(media_warnings(caught))
        return out

    alone = Trainer.init_vram(Executor.cpu(), run, media=MediaPolicy(workers=1), host_processes=0)
    ours = steps(alone)
    alone.close()
    two = Executor.cpu(workers=2)
    try:
        fleet = Trainer.init_vram(two, run, media=MediaPolicy(workers=1), host_processes=1)
        theirs = steps(fleet)
        fleet.close()
    finally:
        two.close()
    # The workers hold their warnings back: the caller's process shows one, naming the caller's item (a
    # worker's own index would differ), and counts every one over the devices.
    assert shown[0] == shown[1] and len(shown[1]) == 1 and "contents[4] (image)" in shown[1][0], shown
    assert fleet.notices.count("media") == 2
    for a, b in zip(theirs, ours, strict=True):
        assert a.skipped == b.skipped == 1 and a.step == b.step
        for name in ("loss", "contrastive_loss", "masked_text_loss", "masked_image_loss"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-5), name


@pytest.mark.parametrize("side, tiles", [(64, 4), (128, 2), (0, 0)])
def test_a_replicas_stage_builds_tables_of_its_tile_side(side: int, tiles: int) -> None:
    """`Preparation.factory` hands the stage the replica's tile side (`model.attention.flex_block` on the flex path,
    0 on the dense path): the flex path's steps carry tables of that side, the dense path's none."""
    config = resolve(run_config())
    job = text_job()
    checked = check_step(config, job.modalities, job.contents, None, False)
    stage = Preparation.factory(MediaPolicy(workers=1), torch.device("cpu"), 0)(config, side)
    try:
        _, tensors, failed = stage.prepare(checked, 1)
    finally:
        stage.close()
    assert failed == []
    if not tiles:
        assert not [name for name in tensors if name.startswith("block.")]
    else:
        assert tensors["block.kv_indices"].shape[-2:] == (tiles, tiles)


def test_a_dense_replicas_stage_carries_no_tables(make_trainer) -> None:
    """The replica hands its stage tile side 0 on the dense path (the CPU's): its steps carry no block tables."""
    trainer = make_trainer()
    assert trainer.replica.attention == "dense" and trainer.replica.stage.tiles == 0
