"""`uform.data.row_copy.copy_rows`: a step's units stacked on a few threads write what one copy writes."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

from uform.data import row_copy
from uform.data.row_copy import copy_rows


def _parts(rng: np.random.Generator, dtype: type[np.generic], features: int, holes: bool):
    sizes = [int(n) for n in rng.integers(0, 40, size=int(rng.integers(1, 30)))]
    parts: list[np.ndarray | None] = []
    for n in sizes:
        if holes and rng.random() < 0.3:
            parts.append(None)
        elif dtype == np.uint8:
            parts.append(rng.integers(0, 256, size=(n, features), dtype=np.uint8))
        else:
            parts.append(rng.standard_normal((n, features)).astype(dtype))
    return parts, sizes


def _reference(out: np.ndarray, parts, sizes) -> np.ndarray:
    expected = out.copy()
    at = 0
    for part, n in zip(parts, sizes, strict=True):
        if part is not None:
            expected[at : at + n] = part
        at += n
    return expected


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("spread_bytes", [0, 1 << 40])
def test_spread_copies_write_what_one_copy_writes(dtype, holes, spread_bytes):
    rng = np.random.default_rng(7)
    for _ in range(25):
        parts, sizes = _parts(rng, dtype, 24, holes)
        out = np.full((sum(sizes) + 3, 24), 99, dtype=dtype)  # rows past the parts and under holes keep the 99s
        expected = _reference(out, parts, sizes)
        copy_rows(out, parts, sizes, spread_bytes=spread_bytes)
        np.testing.assert_array_equal(out, expected)


def test_large_copies_run_on_the_pool_small_ones_on_the_caller(monkeypatch):
    threads: list[str] = []
    original = row_copy._copy_run

    def recorded(*args):
        threads.append(threading.current_thread().name)
        original(*args)

    monkeypatch.setattr(row_copy, "_copy_run", recorded)
    monkeypatch.setattr(row_copy, "_threads", lambda: 2)  # the same on a one-core machine
    parts = [np.full((4, 8), i, dtype=np.uint8) for i in range(6)]
    out = np.zeros((24, 8), dtype=np.uint8)
    copy_rows(out, parts, [4] * 6, spread_bytes=1)
    assert len(threads) == 2 and all(name.startswith("uform-row-copy") for name in threads)
    np.testing.assert_array_equal(out[:, 0], np.repeat(np.arange(6), 4))
    threads.clear()
    copy_rows(out, parts, [4] * 6)  # 192 bytes, far below SPREAD_BYTES
    assert threads == [threading.current_thread().name]


def test_a_rejected_call_writes_nothing():
    out = np.zeros((10, 4), dtype=np.uint8)
    good = np.ones((3, 4), dtype=np.uint8)
    with pytest.raises(ValueError, match="part 1 has 3 rows but its size is 2"):
        copy_rows(out, [good, good], [3, 2], spread_bytes=0)
    with pytest.raises(ValueError, match="hold 12 rows but `out` has 10"):
        copy_rows(out, [good, good], [6, 6], spread_bytes=0)
    with pytest.raises(ValueError, match="2 parts but 1 sizes"):
        copy_rows(out, [good, good], [3], spread_bytes=0)
    assert not out.any()


def _child(connection) -> None:
    parts = [np.full((5, 3), i, dtype=np.uint8) for i in range(8)]
    out = np.zeros((40, 3), dtype=np.uint8)
    copy_rows(out, parts, [5] * 8, spread_bytes=0)
    connection.send(out[:, 0].tolist())


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_copies_with_a_pool_of_its_own():
    for _ in range(8):  # the pool made here, its threads idle (the state a forked child inherits)
        copy_rows(np.zeros((8, 1), np.uint8), [np.ones((4, 1), np.uint8)] * 2, [4, 4], spread_bytes=0)
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    child = context.Process(target=_child, args=(theirs,), daemon=True)
    child.start()
    assert ours.poll(30), "the forked child's copy did not finish (its inherited pool has no threads)"
    assert ours.recv() == np.repeat(np.arange(8), 5).tolist()
    child.join(30)
    assert child.exitcode == 0
