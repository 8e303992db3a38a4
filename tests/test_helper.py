"""`uform.runtime.helper`: the one process primitive under the decode pool, the preparer processes and the device
workers (issue 11, item 2).

Pins: a call's reply comes back as a future, its large buffers through the helper's slab both ways (the slab's
bytes are the reply's); a helper that dies with calls pending fails every one of them with `ProcessDied` naming it
and its exit status, and later calls are refused with `NotDelivered`; an exception raised for a call arrives as
its own type with the remote traceback as its cause (or as a `RemoteError` naming a type that cannot be rebuilt;
never as the caller's own KeyboardInterrupt); `close_all` ends idle and busy helpers alike and leaves no process,
reader thread, slab file or descriptor behind.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from uform.runtime.helper import Helper, Link, NotDelivered, ProcessDied, Readers, close_all
from uform.runtime.remote_error import RemoteError, RemoteTraceback

SHM = Path("/dev/shm")


# -- the helper's side (module level: a helper imports this module to run them) -----------------------------------


def serve_calls(link: Link) -> None:
    """Runs each call ``(function, args)`` in turn; the reply's large buffers go into the slab from offset 0."""
    endpoint = link.open()
    if not endpoint.ready():
        return
    while True:
        try:
            frame = endpoint.receive()
        except EOFError:
            return
        if frame is None:
            return
        function, args = frame.load()
        try:
            value = function(*args)
        except BaseException as error:
            endpoint.fail(frame.ident, error)
        else:
            endpoint.reply(frame.ident, value, area=(0, None))
        del function, args, frame


def inspect_array(array: np.ndarray) -> tuple[bool, int, np.ndarray]:
    """Whether the array arrived as a view (of the slab) rather than a copy of its own, its sum, and a new array."""
    return not array.flags.owndata, int(array.sum()), np.arange(len(array), dtype=np.int32) * 3


def exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


def square(x: int) -> int:
    return x * x


def explode(message: str) -> None:
    raise ValueError(message)


def explode_locally(message: str) -> None:
    local = type("Local", (Exception,), {})  # no module attribute names it: it cannot pickle by reference
    raise local(message)


def interrupt() -> None:
    raise KeyboardInterrupt("pressed in the helper")


def started(**options: Any) -> Helper:
    helper = Helper(serve_calls, name="uform-test-helper", **options)
    helper.start()
    helper.ready.result(120)
    return helper


def slab_files() -> list[str]:
    return sorted(p.name for p in SHM.glob("uform-test-*")) if SHM.is_dir() else []


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# -- tests ----------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not SHM.is_dir(), reason="slabs live in /dev/shm")
def test_a_call_and_its_reply_cross_the_slab_both_ways() -> None:
    helper = started(slab_bytes=1 << 22, slab_prefix="uform-test-")
    try:
        assert helper.slab is not None and slab_files() == []  # mapped by both sides, no name left behind
        sent = np.arange(100_000, dtype=np.int64)
        start = 1 << 20  # the call's buffers from here: the reply's go from 0
        future = helper.submit((inspect_array, (sent,)), area=(start, None))
        viewed, total, made = future.result(60)
        assert viewed and total == int(sent.sum())  # the helper read the call's array in place, in the slab
        assert bytes(helper.slab[start : start + sent.nbytes]) == sent.tobytes()
        np.testing.assert_array_equal(made, np.arange(100_000, dtype=np.int32) * 3)
        assert bytes(helper.slab[: made.nbytes]) == made.tobytes()  # the reply came back through the slab
        made[0] = 7  # a copy of its own (views=False): the slab may be reused
        assert helper.submit((square, (12,))).result(60) == 144 and helper.pending == 0
    finally:
        helper.close()


def test_a_helper_that_dies_fails_every_pending_call_with_its_exit_status() -> None:
    helper = started()
    dying = helper.submit((exit_after, (0.3, 3)))
    queued = helper.submit((square, (2,)))  # waits behind the call that kills the process
    for future in (dying, queued):
        with pytest.raises(ProcessDied, match=r"uform-test-helper \(pid \d+\) died \(exit code 3\)") as caught:
            future.result(60)
        assert caught.value.exitcode == 3 and caught.value.pid == helper.pid
    died = helper.ended.result(60)
    assert died.status == "exit code 3" and helper.died is died and helper.pending == 0
    with pytest.raises(NotDelivered):
        helper.submit((square, (3,)))
    assert helper.reader is not None and not helper.reader.is_alive()  # it reaped the process and stopped
    helper.close()

    killed = started()
    stuck = killed.submit((time.sleep, (60,)))
    os.kill(killed.pid, signal.SIGKILL)  # type: ignore[arg-type]
    with pytest.raises(ProcessDied, match=rf"died \(signal {int(signal.SIGKILL)}\)"):
        stuck.result(60)
    killed.close()


def test_a_remote_exception_arrives_with_its_type_and_the_remote_traceback() -> None:
    helper = started()
    try:
        error = helper.submit((explode, ("bad frame",))).exception(60)
        assert type(error) is ValueError and str(error) == "bad frame"
        cause = error.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert (
            "uform-test-helper" in str(cause) and "in explode" in str(cause) and "ValueError: bad frame" in str(cause)
        )

        local = helper.submit((explode_locally, ("no module has me",))).exception(60)
        assert isinstance(local, RemoteError) and isinstance(local, RuntimeError)
        assert str(local) == "Local: no module has me" and local.remote_type.endswith("Local")
        assert "in explode_locally" in str(local.__cause__)

        interrupted = helper.submit((interrupt, ())).exception(60)
        assert isinstance(interrupted, RemoteError) and not isinstance(interrupted, KeyboardInterrupt)
        assert str(interrupted) == "KeyboardInterrupt: pressed in the helper"
        assert helper.submit((square, (5,))).result(60) == 25  # the helper lives on
    finally:
        helper.close()


def test_close_all_reaps_idle_and_busy_helpers_and_leaks_nothing() -> None:
    gc.collect()  # earlier tests' helpers, unreferenced: their descriptors go now, not during this test
    fds, files = open_fds(), slab_files()
    helpers = [started(slab_bytes=1 << 20, slab_prefix="uform-test-") for _ in range(3)]
    busy = helpers[0].submit((time.sleep, (60,)))  # it cannot read the exit request: it is killed
    processes = [h.process for h in helpers]
    start = time.monotonic()
    close_all(helpers, grace=1.0)
    assert time.monotonic() - start < 30
    assert all(p.exitcode is not None for p in processes)  # reaped, every one
    assert [p.exitcode for p in processes[1:]] == [0, 0]  # the idle ones exited when asked
    assert processes[0].exitcode == -signal.SIGKILL
    with pytest.raises(ProcessDied):
        busy.result(10)
    assert all(h.reader is not None and not h.reader.is_alive() for h in helpers)
    assert all(h.slab is None and h.slab_fd is None for h in helpers)
    close_all(helpers)  # idempotent
    assert slab_files() == files
    del helpers, processes, busy
    gc.collect()  # a process's sentinel is closed with its object (`uform.runtime.child.Child`)
    assert open_fds() == fds  # no descriptor (pipes, slabs) left open


def test_helpers_sharing_one_reader_thread_answer_and_die_apart() -> None:
    readers = Readers("uform-test-readers")
    helpers = [started(readers=readers) for _ in range(2)]
    thread = helpers[0].reader
    assert thread is not None and helpers[1].reader is thread and thread.is_alive()
    assert [h.submit((square, (i + 2,))).result(60) for i, h in enumerate(helpers)] == [4, 9]
    dying = helpers[0].submit((exit_after, (0.0, 5)))
    with pytest.raises(ProcessDied, match=r"died \(exit code 5\)"):
        dying.result(60)
    assert helpers[1].submit((square, (4,))).result(60) == 16  # the other one is read on as before
    close_all(helpers)
    thread.join(30)
    assert not thread.is_alive()  # the thread ends with its last helper


# -- its clients: the device workers ----------------------------------------------------------------------------


def missing_key(state: dict, device: Any, argument: Any, progress: Any) -> None:
    """A `uform.runtime.workers.Verb` that fails as plain Python does (no error of uform's)."""
    return {"present": 1}[argument]


def workers_pid(state: dict, device: Any, argument: Any, progress: Any) -> int:
    return os.getpid()


def test_a_device_workers_exception_arrives_as_its_own_type_and_its_death_names_the_signal() -> None:
    import torch

    from uform.runtime.workers import Workers
    from uform.runtime.world import MeshError

    fleet = Workers([torch.device("cpu")])
    try:
        (error,) = [f.exception(120) for f in fleet.call([(missing_key, "absent")])]
        assert type(error) is KeyError and error.args == ("absent",)  # not a RuntimeError around a traceback
        assert isinstance(error.__cause__, RemoteTraceback) and "in missing_key" in str(error.__cause__)
        (pid,) = fleet.everyone(workers_pid)
        assert fleet.pids == [pid]
        (stuck,) = fleet.call([(sleep_verb, 60)])
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(MeshError, match=rf"device 0 of this executor\) stopped \(signal {int(signal.SIGKILL)}\)"):
            stuck.result(60)
        with pytest.raises(MeshError, match="restart every process"):
            fleet.everyone(workers_pid)
    finally:
        fleet.close()


def sleep_verb(state: dict, device: Any, argument: float, progress: Any) -> None:
    time.sleep(argument)
