"""The NCCL fault handling without NCCL: the library's TORCH_NCCL_ASYNC_ERROR_HANDLING default, the world's
watch over its groups' error state, the concurrent abort, and the deadline-bounded wait for a step's device
work, with stand-ins for the CUDA event and the NCCL process groups (the real thing: test_world.py's
two-GPU test, `-k "nccl and kill"`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import make_config, step_with

import uform.runtime.world
from uform import Executor, Mesh, MeshError, MeshOptions, MultimemTier, Trainer
from uform.runtime.process_group import ASYNC_ERROR_HANDLING, GROUP_SLACK, group_timeout, nccl_defaults
from uform.runtime.world import World, WorldAborted, wait_event


class Event:
    """A CUDA event's `query`: done once `done` is set."""

    def __init__(self, done: bool = False) -> None:
        self.done = threading.Event()
        if done:
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()


class Group:
    """An NCCL process group's `abort` and its backend's `get_error`."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.error = "SUCCESS"
        self.aborts = 0
        self.started = threading.Event()
        self.hold = hold  # abort() returns only once this is set

    def _get_backend(self, device: torch.device) -> Any:
        assert device.type == "cuda"
        return SimpleNamespace(get_error=lambda: SimpleNamespace(name=self.error))

    def abort(self) -> None:
        self.aborts += 1
        self.started.set()
        if self.hold is not None:
            self.hold.wait()


def nccl_world(step: Any, gradients: Any, timeout: float = 1.0) -> World:
    return World(
        rank=0, size=2, backend="nccl", device=torch.device("cpu"), timeout=timeout, group=step, gradients=gradients
    )


# --------------------------------------------------------------------------------------------------
# The environment default


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """os.environ as a copy without the variables `nccl_defaults` sets, restored after the test."""
    copy = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_NVLS_ENABLE")
    }
    monkeypatch.setattr(os, "environ", copy)
    return copy


def test_the_library_asks_torch_to_clean_up_without_ending_the_process(environment: dict[str, str]) -> None:
    nccl_defaults(MultimemTier.Off)
    assert environment["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == ASYNC_ERROR_HANDLING == "2"
    assert environment["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("name", ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"])
def test_a_users_error_handling_stays(environment: dict[str, str], name: str) -> None:
    """Under either spelling torch reads (the older one only where the newer is unset)."""
    environment[name] = "3"
    nccl_defaults(MultimemTier.Off)
    assert environment[name] == "3"
    assert environment.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") == "3"


def test_nccl_groups_time_out_after_the_world_does() -> None:
    """The world's watch keeps the deadline; torch's watchdog, later, finds the collectives aborted."""
    assert group_timeout("gloo", 30.0).total_seconds() == 30.0
    assert group_timeout("nccl", 30.0).total_seconds() == 30.0 + GROUP_SLACK
    assert GROUP_SLACK > 60  # torch's sleep after a failure it sees first (4 x 15 s at its defaults)


# --------------------------------------------------------------------------------------------------
# Abort


def test_the_abort_reaches_every_group_at_once_and_only_once() -> None:
    """Each group's abort waits until the other's has begun, as ncclCommAbort may wait for the whole device,
    which another communicator's kernel holds until its own abort flag is set (NVIDIA/nccl#1013): aborting
    one group after the other would never end."""
    step_started, gradients_started = threading.Event(), threading.Event()
    step, gradients = Group(hold=gradients_started), Group(hold=step_started)
    step.started, gradients.started = step_started, gradients_started
    world = nccl_world(step, gradients)
    reason = world.abort("first")
    assert world.settle(5.0), "the aborts waited for each other"
    assert reason == world.aborted and reason.startswith("first;") and "aborted the world's NCCL" in reason
    assert world.abort("second") == reason
    assert (step.aborts, gradients.aborts) == (1, 1)
    with pytest.raises(WorldAborted, match="first"):
        world.check()
    with pytest.raises(WorldAborted, match="first"):
        world.all_reduce(torch.zeros(1))  # refused before torch.distributed is asked


def test_an_abort_that_hangs_does_not_hold_anyone() -> None:
    never = threading.Event()
    world = nccl_world(Group(hold=never), Group())
    start = time.monotonic()
    world.abort("stuck")
    assert not world.settle(0.2)
    with pytest.raises(WorldAborted, match="stuck"):
        wait_event(Event(), world, "step 3's device work")
    assert time.monotonic() - start < 2
    never.set()


# --------------------------------------------------------------------------------------------------
# The watch


def until_aborted(world: World, seconds: float = 5.0) -> None:
    """Waits (at most `seconds`) for the world's watch to abort it."""
    deadline = time.monotonic() + seconds
    while not world.aborted and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_watch_aborts_the_world_when_torch_reports_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uform.runtime.world, "WATCH_SECONDS", 0.02)
    step, gradients = Group(), Group()
    world = nccl_world(step, gradients, timeout=30.0)
    world.watch()
    time.sleep(0.2)
    assert not world.aborted and world.errors() == ""
    step.error = "TIMEOUT"  # torch's watchdog: a collective of the step group ran past the deadline
    until_aborted(world)
    assert "waited past the 30 s deadline (TIMEOUT on the step group)" in world.aborted
    assert world.settle(5.0) and (step.aborts, gradients.aborts) == (1, 1)
    world.unwatch()


def test_the_watch_aborts_the_world_when_a_collective_is_past_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mark (a collective's event and its launch time) still unfinished a deadline after its launch."""
    monkeypatch.setattr(uform.runtime.world, "WATCH_SECONDS", 0.02)
    step, gradients = Group(), Group()
    world = nccl_world(step, gradients, timeout=0.3)
    world.watch()
    now = time.monotonic()
    world._marks.extend([(Event(done=True), now, "an all-reduce of the step"), (Event(), now, "an all-gather")])
    until_aborted(world)
    assert 0.3 <= time.monotonic() - now < 3
    assert world.aborted.startswith("an all-gather has not finished ") and "past the 0.3 s deadline" in world.aborted
    assert world.settle(5.0) and (step.aborts, gradients.aborts) == (1, 1)
    world.unwatch()


def test_finished_marks_are_dropped_and_young_ones_kept() -> None:
    world = nccl_world(Group(), Group(), timeout=30.0)
    now = time.monotonic()
    pending = (Event(), now, "the gradient buckets' all-reduces")
    world._marks.extend([(Event(done=True), now - 60, "an all-gather of the step"), pending])
    assert world.overdue() == "" and list(world._marks) == [pending]


def test_unwatched_worlds_make_no_marks() -> None:
    world = World(rank=0, size=2, backend="gloo", device=torch.device("cpu"), timeout=1.0)
    world.mark("an all-reduce of the step")  # no CUDA event is made
    assert not world._marks


def test_errors_name_every_failed_group() -> None:
    step, gradients = Group(), Group()
    gradients.error = "COMM_ERROR"
    assert nccl_world(step, gradients).errors() == (
        "NCCL reported a communication error (a peer process exited or the network failed) "
        "(COMM_ERROR on the gradients group)"
    )


def test_only_the_errors_torch_names_count() -> None:
    step, gradients = Group(), Group()
    step.error, gradients.error = "SUCCESS", "SOMETHING_NEW"
    assert nccl_world(step, gradients).errors() == ""


def test_a_torch_that_cannot_report_errors_reports_none() -> None:
    old = SimpleNamespace(_get_backend=lambda device: SimpleNamespace(), abort=lambda: None)
    assert nccl_world(old, old).errors() == ""


def test_only_nccl_worlds_of_two_or_more_are_watched() -> None:
    for backend, size in (("gloo", 2), ("nccl", 1)):
        world = World(rank=0, size=size, backend=backend, device=torch.device("cpu"), timeout=1.0)
        world.watch()
        assert world._stop is None


# --------------------------------------------------------------------------------------------------
# The wait for a step's device work


def test_the_wait_answers_when_the_work_is_done() -> None:
    event = Event()
    threading.Timer(0.05, event.done.set).start()
    world = nccl_world(Group(), Group())
    start = time.monotonic()
    wait_event(event, world, "step 1's device work")
    assert time.monotonic() - start < 1 and not world.aborted


def test_the_wait_gives_up_at_once_when_the_world_is_aborted() -> None:
    world = nccl_world(Group(), Group(), timeout=60.0)
    threading.Timer(0.1, world.abort, args=("a collective waited past the 60 s deadline",)).start()
    start = time.monotonic()
    with pytest.raises(WorldAborted, match="waited past the 60 s deadline"):
        wait_event(Event(), world, "step 3's device work")
    assert time.monotonic() - start < 2


def test_the_wait_has_a_deadline_of_its_own() -> None:
    """Where torch's watchdog says nothing (blocking waits, an older torch), the wait aborts the world itself
    once the world's deadline and the grace have passed."""
    step, gradients = Group(), Group()
    world = nccl_world(step, gradients, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(WorldAborted, match=r"step 3's device work did not finish within 0\.5 s"):
        wait_event(Event(), world, "step 3's device work", grace=0.2)
    assert 0.5 <= time.monotonic() - start < 3
    assert world.settle(5.0) and (step.aborts, gradients.aborts) == (1, 1)


def test_work_that_finishes_after_an_error_is_not_trusted() -> None:
    """Aborted collectives end early: the event completes, but their results are partial."""
    step = Group()
    step.error = "TIMEOUT"
    world = nccl_world(step, Group())
    with pytest.raises(WorldAborted, match="TIMEOUT on the step group"):
        wait_event(Event(done=True), world, "step 3's device work")
    assert world.aborted


# --------------------------------------------------------------------------------------------------
# The trainer over an aborted world


@pytest.fixture
def lone_mesh(executor: Executor):
    mesh = Mesh.bootstrap(executor, MeshOptions(timeout_seconds=30))
    world = mesh.world
    try:
        yield mesh
    finally:
        for trainer in list(mesh._borrowers):
            trainer.close()
        if world is not None:  # what the tests set; the gloo group itself was never aborted
            world.aborted = ""
        mesh.close()


def test_an_aborted_world_saves_no_weights_and_steps_no_more(lone_mesh: Mesh, tmp_path: Path) -> None:
    """An abort may cut a step short after its update was launched: the weights are not written, and every
    later step refuses at once with the world's error."""
    trainer = Trainer.init_vram(lone_mesh.executor, make_config(mesh=lone_mesh))
    step_with(trainer)
    world = lone_mesh.world
    assert world is not None
    failure = "mesh: step 2 failed on process 0 of 2: a peer process stopped (...)"
    world.failed.append(failure)
    world.aborted = "a collective waited past the 30 s deadline (TIMEOUT on the step group)"
    with pytest.raises(MeshError, match="saves none") as refused:
        trainer.save(tmp_path / "partial.safetensors")
    assert str(refused.value).startswith(failure)
    assert not (tmp_path / "partial.safetensors").exists()
    start = time.monotonic()
    with pytest.raises(MeshError) as again:
        step_with(trainer)
    assert str(again.value) == failure and time.monotonic() - start < 1
    assert trainer.steps_taken == 1
