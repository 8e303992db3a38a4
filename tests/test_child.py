"""`uform.runtime.child.Child`: a process of ours that never imports the caller's main module (issue 10, item 4).

Pins: a child runs its target with the caller's ``sys.path`` and a ``__main__`` that is not the caller's, and
receives a pipe end and a slab file by descriptor number (no copy, no name) beside arguments larger than a
pipe holds; its sentinel is ready once it
ended, and its exit code reads as multiprocessing's (0, 1 for a target that raised, minus the signal that
killed it); nothing defined in ``__main__`` crosses (a clear TypeError naming it, in `Child` and in
`DecodePool.map`; a job's argument of ``__main__`` answers an error outcome that says why). The forms of the caller's script are in test_script_forms.py.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest

from uform.runtime.child import Child, context
from uform.runtime.decoders import DecodePool
from uform.runtime.slab import SlabFile, create_slab, release_slab


def report(conn: Connection, slab: SlabFile, blob: bytes) -> None:
    """A child's target: writes into the slab through the inherited descriptor and says what it saw."""
    mapping = slab.map(64)
    mapping[:5] = b"hello"
    main = sys.modules["__main__"]
    conn.send((os.getpid(), sys.path, getattr(main, "__file__", None), "test_child" in sys.modules, len(blob)))
    conn.recv()  # until the parent says go


def fail() -> None:
    raise ValueError("the target failed")


def test_a_child_runs_its_target_with_the_callers_path_and_descriptors_by_number() -> None:
    slab, fd = create_slab(1 << 16)
    assert slab is not None and fd is not None
    ours, theirs = multiprocessing.Pipe()
    blob = bytes(range(256)) * 4096  # 1 MiB: more than a pipe holds, so the start writes while the child reads
    child = Child(target=report, args=(theirs, SlabFile(fd), blob), name="uform-test")
    child.start()
    theirs.close()
    os.close(fd)
    try:
        pid, path, main_file, imported, length = ours.recv()
        assert length == len(blob)
        assert pid == child.pid and child.is_alive() and child.exitcode is None
        assert path == sys.path and main_file is None and imported  # our module, by name; never the caller's main
        assert slab[:5] == b"hello"  # one file, mapped on both sides
        assert not multiprocessing.connection.wait([child.sentinel], 0)
        ours.send("go")
        child.join(30)
        assert child.exitcode == 0 and not child.is_alive()
        assert multiprocessing.connection.wait([child.sentinel], 0)
    finally:
        child.kill()
        release_slab(slab)


def test_exit_codes_read_as_multiprocessings() -> None:
    failing = Child(target=fail)
    failing.start()
    failing.join(60)
    assert failing.exitcode == 1
    _ours, theirs = multiprocessing.Pipe()  # kept open: the child waits on its end until killed
    stopped = Child(target=Connection.recv, args=(theirs,))
    stopped.start()
    theirs.close()
    time.sleep(0.2)
    stopped.kill()
    stopped.join(30)
    assert stopped.exitcode == -signal.SIGKILL and not stopped.is_alive()
    stopped.kill()  # reaped: a no-op, never a signal to a reused pid
    with pytest.raises(ValueError, match="already started"):
        stopped.start()


def test_nothing_of_the_main_module_crosses(monkeypatch: pytest.MonkeyPatch) -> None:
    def job(x: int) -> int:
        return x

    class Local:
        pass

    main = sys.modules["__main__"]
    for thing in (job, Local):
        thing.__module__, thing.__qualname__ = "__main__", thing.__name__
        monkeypatch.setattr(main, thing.__name__, thing, raising=False)  # so it pickles, as a script's would
    with pytest.raises(TypeError, match=r"defined in the main module \(__main__\)"):
        Child(target=job, args=(1,)).start()
    with pytest.raises(TypeError, match=r"Local.*defined in the main module"):
        Child(target=print, args=(Local(),)).start()
    with DecodePool(1) as pool:
        with pytest.raises(TypeError, match=r"not in the main module \(__main__\)"):
            pool.map(job, [((1,), {})])
        assert pool.processes == []  # refused before any worker started
        (outcome,) = pool.map(len, [((Local(),), {})])  # a job whose argument only the caller's main module has
    assert outcome.error is not None and outcome.error.startswith("could not load the job: AttributeError")
    assert "never import the main module" in outcome.error


def test_context_names_ours_and_multiprocessings() -> None:
    ours: Any = context("uform")
    assert ours.Process is Child
    assert context("spawn").get_start_method() == "spawn"
    with pytest.raises(ValueError):
        context("no-such-method")
