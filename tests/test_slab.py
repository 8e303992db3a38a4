"""`uform.runtime.slab`'s lifetime rules for the copies it saves (issue 12, goal 2).

Pins: a buffer its writer built inside the slab's ``placed`` range crosses where it lies (no copy) while the rest
are copied after it; held views (``freed``) keep their bytes taken until the last view of a message is gone,
derived arrays included, and free them at once when the message does not unpickle; `Areas` never offers a helper
the bytes of a reply still viewed, frees them when its views go (even from inside its own lock), prefers the
lowest gap that holds the largest reply so far, else the longest.
"""

from __future__ import annotations

import gc
import mmap
import pickle

import numpy as np
import pytest

from uform.runtime.slab import SLAB_ALIGN, Areas, read_out_of_band, write_out_of_band


def test_buffers_built_in_the_placed_range_cross_where_they_lie() -> None:
    slab = mmap.mmap(-1, 1 << 20)
    built = np.frombuffer(slab, dtype=np.uint8, count=8192, offset=4096).reshape(8, 1024)
    built[:] = np.arange(8, dtype=np.uint8)[:, None]
    beyond = np.frombuffer(slab, dtype=np.int64, count=1000, offset=300_000)  # in the slab, outside `placed`
    beyond[:] = 5
    other = np.arange(2000, dtype=np.int64)
    written = write_out_of_band({"built": built, "other": other, "beyond": beyond}, slab, 65536, placed=(4096, 65536))
    assert written is not None
    header, spans = written
    assert spans == [(4096, 8192), (65536, other.nbytes), (65536 + other.nbytes, beyond.nbytes)]
    assert bytes(slab[65536 : 65536 + other.nbytes]) == other.tobytes()  # the others copied from `start`
    message = read_out_of_band(header, spans, slab, copy=True)
    np.testing.assert_array_equal(message["built"], built)
    np.testing.assert_array_equal(message["other"], other)
    np.testing.assert_array_equal(message["beyond"], beyond)
    unplaced = write_out_of_band({"built": built}, slab, 65536)  # without `placed`, it is copied like any other
    assert unplaced is not None and unplaced[1] == [(65536, 8192)]
    del built, beyond, message


def test_held_views_free_their_bytes_once_the_last_view_is_gone() -> None:
    slab = mmap.mmap(-1, 1 << 20)
    message = (np.full(50_000, 3, dtype=np.int32), np.arange(10_000, dtype=np.float32), "label")
    written = write_out_of_band(message, slab, 128)
    assert written is not None
    freed: list[int] = []
    first, second, label = read_out_of_band(*written, slab, copy=False, freed=lambda: freed.append(1))
    assert label == "label" and not first.flags.owndata and (first == 3).all()
    assert np.shares_memory(first, np.frombuffer(slab, dtype=np.uint8))  # a view, not a copy
    derived = second[::7]  # a view of a view holds the bytes too
    del first, second
    gc.collect()
    assert freed == []
    assert derived[1] == 7.0
    del derived
    assert freed == [1]  # exactly once, as the last view went


def test_held_views_free_their_bytes_at_once_when_the_message_does_not_load() -> None:
    slab = mmap.mmap(-1, 1 << 16)
    freed: list[int] = []
    with pytest.raises(pickle.UnpicklingError):
        read_out_of_band(b"not a pickle", [(0, 64)], slab, copy=False, freed=lambda: freed.append(1))
    assert freed == [1]
    slab.close()  # no export of it is left behind


def test_areas_never_offer_bytes_a_reply_still_holds() -> None:
    a = SLAB_ALIGN
    areas = Areas(1000 * a)
    assert areas.offer() == (0, 1000 * a)
    free_first = areas.hold([(0, 100 * a - 5), (100 * a - 5, 5)])
    assert areas.held == [(0, 100 * a)]
    assert areas.offer() == (100 * a, 1000 * a)
    free_second = areas.hold([(100 * a, 100 * a)])
    free_first()  # the gap at the front holds a reply as long as the largest so far: offered first
    assert areas.held == [(100 * a, 200 * a)] and areas.offer() == (0, 100 * a)
    # that reply crossed the pipe: it took nothing
    free_third = areas.hold([(300 * a, 400 * a)])  # a larger reply, further on
    assert areas.held == [(100 * a, 200 * a), (300 * a, 700 * a)]
    assert areas.offer() == (700 * a, 1000 * a)  # no gap holds 400: the longest one
    with areas._lock:  # a finalizer may run where the lock is held: freeing never waits for it
        free_second()
        free_third()
    assert areas.held == [] and areas.offer() == (0, 1000 * a)


def test_areas_offer_the_longest_gap_when_none_holds_the_largest_reply() -> None:
    areas = Areas(100)
    free = areas.hold([(0, 60)])
    assert areas.offer() == (64, 100)  # shorter than the largest reply (64), but the only room there is
    free()
    full = Areas(64)
    full.hold([(0, 64)])
    assert full.offer() == (0, 0)  # no room at all: the reply crosses the pipe
