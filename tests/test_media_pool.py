"""DecodePool: jobs run in worker processes, in order, each under a time limit; a job that raises, hangs or kills
its process answers an error outcome and the rest of the batch (and later maps) still complete.

The job functions live at module level so they pickle into the workers. Timing bounds are generous on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from uform.runtime.decoders import DecodePool, Outcome, decode_parallelism

POOL_SOURCE = Path(__file__).resolve().parent.parent / "uform" / "runtime" / "decoders.py"


# -- jobs (module level, so they pickle) ------------------------------------------------------------------------------


class MediaError(Exception):
    """Stands in for the media package's decode error."""


def square(x: int, delay: float = 0.0) -> int:
    if delay:
        time.sleep(delay)
    return x * x


def power(base: int, *, exponent: int = 2) -> int:
    return base**exponent


def fail(message: str) -> None:
    raise ValueError(message)


def fail_media(message: str) -> None:
    raise MediaError(message)


def hang(seconds: float) -> str:
    time.sleep(seconds)
    return "woke up"


def exit_process(code: int) -> None:
    os._exit(code)


def segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)  # the signal is delivered before this returns


def job_pid() -> int:
    return os.getpid()


def sigint_ignored() -> bool:
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def big_array(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32)


def filled(value: int, n: int) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


def arrays(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """Several buffers in one result, one of them not contiguous (it cannot go out of band)."""
    grid = np.arange(n * 3, dtype=np.int64).reshape(n, 3)
    return np.full((n, 1024), 7, dtype=np.uint8), grid, grid[:, ::2], "label"


def digest(data: bytes | memoryview) -> tuple[str, int]:
    """The job's bytes as the worker sees them: their hash and length."""
    return hashlib.sha256(data).hexdigest(), len(data)


def mmapped_blocks_while_holding(nbytes: int) -> tuple[int, int]:
    """glibc's count of blocks it mapped for themselves (`mallinfo2().hblks`), before and while this process holds
    a buffer of `nbytes`."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd")]
        _fields_ += [(name, ctypes.c_size_t) for name in ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = Mallinfo2
    before = mallinfo2().hblks
    block = bytearray(nbytes)
    during = mallinfo2().hblks
    del block
    return before, during


def unpicklable_result() -> object:
    return lambda: None


# -- fixtures -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[DecodePool]:
    with DecodePool(workers=2, timeout_seconds=2.0) as shared:
        yield shared


def jobs_of(*args_list: tuple) -> list[tuple[tuple, dict]]:
    return [(args, {}) for args in args_list]


def values(outcomes: list[Outcome]) -> list:
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    return [o.value for o in outcomes]


# -- tests ----------------------------------------------------------------------------------------------------------


def test_results_come_in_job_order_and_equal_a_serial_map(pool: DecodePool) -> None:
    # Earlier jobs sleep longer, so they finish out of order.
    jobs = [((x, 0.02 * (8 - x)), {}) for x in range(8)]
    outcomes = pool.map(square, jobs)
    assert values(outcomes) == [square(*args, **kwargs) for args, kwargs in jobs]
    assert all(o.error is None and o.elapsed >= 0.0 for o in outcomes)
    assert values(pool.map(power, [((3,), {"exponent": 3}), ((2,), {})])) == [27, 4]


def test_zero_jobs_answer_nothing_and_start_no_process() -> None:
    fresh = DecodePool(workers=2)
    try:
        assert fresh.map(square, []) == []
        assert fresh.processes == []
    finally:
        fresh.close()


def test_an_exception_becomes_an_error_outcome_and_the_worker_lives_on(pool: DecodePool) -> None:
    pool.map(square, jobs_of((1,), (2,)))
    pids = {p.pid for p in pool.processes}
    outcomes = pool.map(fail, jobs_of(("bad frame",)))
    assert outcomes[0].value is None and outcomes[0].error == "ValueError: bad frame"
    outcomes = pool.map(fail_media, jobs_of(("truncated stream",)))
    assert outcomes[0].error == "MediaError: truncated stream"
    assert {p.pid for p in pool.processes} == pids  # nobody was replaced
    assert values(pool.map(square, jobs_of((3,), (4,)))) == [9, 16]


def test_a_hung_job_times_out_while_the_rest_of_the_batch_completes(pool: DecodePool) -> None:
    start = time.monotonic()
    outcomes = pool.map(hang, [((60.0,), {})] + [((0.0,), {})] * 5)
    assert time.monotonic() - start < 20.0
    assert outcomes[0].value is None and outcomes[0].error == "timed out after 2.0 s"
    assert 1.5 < outcomes[0].elapsed < 20.0
    assert values(outcomes[1:]) == ["woke up"] * 5
    assert len(pool.processes) <= 2
    assert values(pool.map(square, jobs_of((5,), (6,), (7,)))) == [25, 36, 49]


@pytest.mark.parametrize(
    ("function", "args", "reason"),
    [
        (exit_process, (3,), "the decoder process died (exit code 3)"),
        (segfault, (), f"the decoder process died (signal {int(signal.SIGSEGV)})"),
    ],
    ids=["exit", "segfault"],
)
def test_a_job_that_kills_its_process_answers_died_and_later_maps_work(
    pool: DecodePool, function, args: tuple, reason: str
) -> None:
    outcomes = pool.map(function, [(args, {})])
    assert outcomes[0].value is None and outcomes[0].error == reason
    assert values(pool.map(square, jobs_of(*[(x,) for x in range(6)]))) == [x * x for x in range(6)]
    assert all(p.is_alive() for p in pool.processes)


def test_a_worker_that_dies_while_idle_is_replaced_and_loses_no_job(pool: DecodePool) -> None:
    pool.map(square, jobs_of((1,), (2,), (3,)))
    victim = pool.processes[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10.0)
    assert values(pool.map(square, jobs_of(*[(x,) for x in range(6)]))) == [x * x for x in range(6)]
    assert victim not in pool.processes or not victim.is_alive()


def test_one_worker_with_a_mix_of_good_and_bad_jobs() -> None:
    with DecodePool(workers=1, timeout_seconds=1.0) as single:
        mixed = [
            (square, (2,)),
            (fail, ("no header",)),
            (square, (3,)),
            (exit_process, (7,)),
            (square, (4,)),
            (hang, (60.0,)),
            (square, (5,)),
        ]

        # One function per map, so route through a dispatcher job.
        start = time.monotonic()
        outcomes = single.map(call, [((f, a), {}) for f, a in mixed])
        assert time.monotonic() - start < 30.0
        assert [o.value for o in outcomes] == [4, None, 9, None, 16, None, 25]
        assert [o.error for o in outcomes] == [
            None,
            "ValueError: no header",
            None,
            "the decoder process died (exit code 7)",
            None,
            "timed out after 1.0 s",
            None,
        ]
        assert len(single.processes) == 1
        assert values(single.map(square, jobs_of((6,), (7,)))) == [36, 49]


def call(function, args: tuple):
    return function(*args)


def test_the_pool_is_reused_across_maps(pool: DecodePool) -> None:
    first = values(pool.map(job_pid, [((), {})] * 4))
    assert set(first) <= {p.pid for p in pool.processes}
    for round_ in range(5):
        assert values(pool.map(square, jobs_of(*[(x + round_,) for x in range(5)]))) == [
            (x + round_) ** 2 for x in range(5)
        ]
    assert set(values(pool.map(job_pid, [((), {})] * 4))) <= {p.pid for p in pool.processes}
    assert len(pool.processes) <= 2


def test_close_is_idempotent_and_ends_every_process() -> None:
    fresh = DecodePool(workers=2, timeout_seconds=5.0)
    assert values(fresh.map(square, jobs_of((1,), (2,), (3,)))) == [1, 4, 9]
    processes = fresh.processes
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    fresh.close()
    fresh.close()
    assert not any(p.is_alive() for p in processes)
    assert fresh.processes == []
    with pytest.raises(RuntimeError, match="closed"):
        fresh.map(square, jobs_of((1,)))
    with DecodePool(workers=1) as managed:
        assert values(managed.map(square, jobs_of((4,)))) == [16]
        processes = managed.processes
    assert processes and not any(p.is_alive() for p in processes)


def test_workers_ignore_sigint(pool: DecodePool) -> None:
    assert values(pool.map(sigint_ignored, [((), {})] * 2)) == [True, True]


def test_large_arrays_cross_the_pipe(pool: DecodePool) -> None:
    (outcome,) = pool.map(big_array, jobs_of((4_000_000,)))  # 16 MB
    assert outcome.ok
    np.testing.assert_array_equal(outcome.value, np.arange(4_000_000, dtype=np.float32))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="slabs live in /dev/shm")
def test_a_jobs_large_buffers_cross_the_workers_slab_not_the_pipe() -> None:
    data = np.random.default_rng(0).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()  # 1 MiB
    expected = (hashlib.sha256(data).hexdigest(), len(data))
    with DecodePool(workers=1, timeout_seconds=30) as one:
        assert values(one.map(digest, jobs_of((pickle.PickleBuffer(data),)))) == [expected]  # the worker starts
        (worker,) = one._workers
        assert worker.helper is not None
        sent: list[int] = []
        send = worker.helper._send
        worker.helper._send = lambda message: sent.append(len(message)) or send(message)  # type: ignore[method-assign]
        for _ in range(3):  # the one input area, reused job after job
            assert values(one.map(digest, jobs_of((pickle.PickleBuffer(data),)))) == [expected]
        assert len(sent) == 3 and max(sent) < 4096  # the message names where the bytes lie: they are not in it
    with DecodePool(workers=1, timeout_seconds=30) as small:
        small.input_bytes = 1 << 16  # too small for the job's bytes: they cross the pipe, whole
        assert values(small.map(digest, jobs_of((pickle.PickleBuffer(data),), (b"short",)))) == [
            expected,
            (hashlib.sha256(b"short").hexdigest(), 5),
        ]


def glibc_mallinfo2() -> bool:
    import ctypes

    return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc") and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not glibc_mallinfo2(), reason="glibc's malloc thresholds")
def test_a_workers_buffers_of_a_few_megabytes_come_from_its_heap(pool: DecodePool) -> None:
    """A decoder's image-sized buffers (256 KiB for a 256 x 256 RGBA image's units, 1 MiB here) come from the heap, not
    pages mapped for each and unmapped once it is freed (glibc's 128 KiB threshold, `runtime.heap.keep_heap`): those
    page faults cost a 256 x 256 JPEG's decode about 0.3 ms more, measured, job after job."""
    for before, during in values(pool.map(mmapped_blocks_while_holding, jobs_of((1 << 20,), (4 << 20,)))):
        assert during == before


def slab_files() -> list[str]:
    folder = Path("/dev/shm")
    return sorted(p.name for p in folder.glob("uform-decoder-*")) if folder.is_dir() else []


def test_results_with_several_buffers_come_back_whole_and_writable(pool: DecodePool) -> None:
    outcomes = pool.map(arrays, jobs_of(*[(n,) for n in (1, 300, 2000)]))
    for n, outcome in zip((1, 300, 2000), outcomes, strict=True):
        assert outcome.ok, outcome.error
        values, grid, strided, label = outcome.value
        expected = arrays(n)
        np.testing.assert_array_equal(values, expected[0])
        np.testing.assert_array_equal(grid, expected[1])
        np.testing.assert_array_equal(strided, expected[2])
        assert label == "label" and values.flags.writeable and grid.flags.writeable
        values[0, 0] = 1  # writable: a view of the slab that no later result writes over


def test_results_larger_than_the_slab_cross_the_pipe() -> None:
    with DecodePool(workers=1, timeout_seconds=30) as small:
        small.slab_bytes = 1 << 20
        (outcome,) = small.map(big_array, jobs_of((1_000_000,)))  # 4 MB, four times the slab
        assert outcome.ok
        np.testing.assert_array_equal(outcome.value, np.arange(1_000_000, dtype=np.float32))
        (outcome,) = small.map(big_array, jobs_of((1000,)))  # and the slab still serves small ones
        np.testing.assert_array_equal(outcome.value, np.arange(1000, dtype=np.float32))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="slabs live in /dev/shm")
def test_results_are_views_of_the_slab_that_no_later_result_overwrites() -> None:
    n = 3 << 20  # 3 MiB each: two held results and a third fit the slab only side by side
    with DecodePool(workers=1, timeout_seconds=2) as one:
        (first,) = values(one.map(filled, jobs_of((1, n))))
        (worker,) = one._workers
        assert worker.helper is not None and worker.helper.slab is not None
        slab = np.frombuffer(worker.helper.slab, dtype=np.uint8)
        assert np.shares_memory(first, slab)  # a view of the worker's slab: not copied out
        del slab
        assert worker.areas.held == [(0, n)]
        second, third = values(one.map(filled, jobs_of((2, n), (3, n))))  # the same worker, while `first` lives
        assert (first == 1).all() and (second == 2).all() and (third == 3).all()
        assert worker.areas.held == [(0, n), (n, 2 * n), (2 * n, 3 * n)]
        del second  # its bytes are free again, and the lowest gap that holds a result is offered first
        (fourth,) = values(one.map(filled, jobs_of((4, n))))
        assert worker.areas.held == [(0, n), (n, 2 * n), (2 * n, 3 * n)] and (fourth == 4).all()
        assert (first == 1).all() and (third == 3).all()
        (timed_out,) = one.map(hang, jobs_of((30.0,)))  # the worker is killed: what it answered stays readable
        assert timed_out.error is not None and (first == 1).all() and (fourth == 4).all()
        del first, third, fourth
        assert worker.areas.held == []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="slabs live in /dev/shm")
def test_slab_files_are_unlinked_once_workers_are_ready() -> None:
    before = slab_files()
    with DecodePool(workers=2, timeout_seconds=2) as managed:
        managed.map(big_array, jobs_of((10,), (20,)))
        assert slab_files() == before  # mapped by both sides, no name left behind
        outcomes = managed.map(hang, jobs_of((30.0,)))  # a killed worker's slab goes with it
        assert outcomes[0].error is not None and "timed out" in outcomes[0].error
        managed.map(big_array, jobs_of((10,)))
        assert slab_files() == before
    assert slab_files() == before


def test_unpicklable_results_jobs_and_functions(pool: DecodePool) -> None:
    (outcome,) = pool.map(unpicklable_result, [((), {})])
    assert outcome.error is not None and outcome.error.startswith("could not send the result:")
    outcomes = pool.map(square, [((lambda: 1,), {}), ((3,), {})])
    assert outcomes[0].error is not None and outcomes[0].error.startswith("could not send the job:")
    assert outcomes[1].value == 9
    with pytest.raises(TypeError, match="must pickle"):
        pool.map(lambda x: x, jobs_of((1,)))


def test_defaults_and_arguments() -> None:
    assert decode_parallelism() >= 1
    default = DecodePool()
    assert default.workers == decode_parallelism() and default.timeout_seconds == 30.0
    assert default.processes == []  # started lazily
    default.close()
    for bad in ({"workers": -1}, {"workers": 1.5}, {"timeout_seconds": 0}, {"timeout_seconds": float("nan")}):
        with pytest.raises(ValueError):
            DecodePool(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DecodePool(context="no-such-method")


def test_the_module_imports_only_the_standard_library() -> None:
    """Importing the decode pool in a fresh interpreter loads nothing beyond the standard library but the
    package's own modules (the pool's runtime ones: child, heap, helper, remote_error, slab), so no torch, no numpy."""
    script = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import uform.runtime.decoders\n"
        "tops = {name.partition('.')[0] for name in set(sys.modules) - before}\n"
        "others = sorted(tops - set(sys.stdlib_module_names) - {'uform', '__mp_main__'})\n"
        "ours = sorted(name for name in sys.modules if name.startswith('uform'))\n"
        "print(json.dumps([others, ours]))\n"
    )
    root = POOL_SOURCE.parent.parent.parent
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=root)
    assert result.returncode == 0, result.stderr
    others, ours = json.loads(result.stdout)
    # Nothing outside the standard library (multiprocessing aliases __main__ as __mp_main__): no torch, no numpy.
    assert others == []
    runtime = ("child", "decoders", "heap", "helper", "remote_error", "slab")
    assert ours == ["uform", "uform.runtime", *(f"uform.runtime.{name}" for name in runtime)]
