"""Gathering concurrent requests into model calls: a `Batcher` queues each request's items under a key, and one
worker thread takes the oldest request together with every waiting request of the same key that still fits
the call's capacity, runs one call over their items, and hands each request its slice through a `Future`.

Why a worker thread: the model runs one call at a time anyway (`Model` holds a lock), so while a call runs the
requests that arrive meanwhile pile up and ride the next call together. An idle batcher runs a lone request at
once. Under load it may `linger`: clients that waited for one call send their next requests just after it
answers, spread over the time the server takes to answer and read them, and the first to arrive would
otherwise start a call of its own while the rest wait out that call (a model at a fixed capacity costs the
same whatever a call holds, so alternate calls of a few and of the rest answer half of what it could). So the
next call waits, at most `linger` seconds after the last one ended and never longer than it took, until as
many items of its key wait as that call carried. The queue is bounded in items: a request that would overflow
it is refused with `Busy` at once (the server answers 503), so memory stays bounded under any load.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["Batcher", "BatcherClosed", "Busy"]

K = TypeVar("K", bound=Hashable)
I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")


class Busy(RuntimeError):
    """The queue holds as many items as it may: the request was not queued (try again later)."""


class BatcherClosed(RuntimeError):
    """The batcher was closed before the request ran."""


@dataclass
class _Request(Generic[K, I, R]):
    key: K
    items: list[I]
    future: Future = field(default_factory=Future)


class Batcher(Generic[K, I, R]):
    """Runs `run(key, items) -> results` (one result per item, in order) on a worker thread over the items of
    as many waiting requests of one key as fit `capacity` items (a single larger request runs alone).
    `max_queued` bounds the items waiting; `submit` beyond it raises `Busy`. `linger` (seconds, 0: never) is
    how long a call may wait, just after the last one, for as many items as the last call of its key carried."""

    def __init__(
        self,
        run: Callable[[K, list[I]], Sequence[R]],
        *,
        capacity: int,
        max_queued: int,
        linger: float = 0.0,
        name: str = "uform-batcher",
    ) -> None:
        for label, value in (("capacity", capacity), ("max_queued", max_queued)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{label}: must be positive, got {value}")
        if isinstance(linger, bool) or not isinstance(linger, (int, float)):
            raise TypeError(f"linger: expected seconds as a number, got {type(linger).__name__}")
        if not (math.isfinite(linger) and linger >= 0):
            raise ValueError(f"linger: must be finite and at least 0 seconds, got {linger}")
        self._run = run
        self.capacity = capacity
        """Items one call gathers at most (from several requests; one larger request runs alone)."""
        self.max_queued = max_queued
        """Items that may wait at once."""
        self.linger = float(linger)
        """Seconds a call may wait after the last one for as many items as the last call of its key carried."""
        self._pending: deque[_Request[K, I, R]] = deque()
        self._queued = 0
        self._queued_by_key: dict[K, int] = {}
        self._carried: dict[K, int] = {}  # items the last call of each key ran
        self._last_end = -math.inf  # time.monotonic() when the last call answered
        self._last_seconds = 0.0  # how long it ran
        self._closed = False
        self._condition = threading.Condition()
        self.calls = 0
        """Calls run so far."""
        self.requests = 0
        """Requests answered (a result or an error) so far."""
        self.items = 0
        """Items those calls ran."""
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Items waiting now (not counting the call that runs)."""
        with self._condition:
            return self._queued

    def submit(self, key: K, items: Sequence[I]) -> Future:
        """Queues `items` under `key`; answers a `Future` of their results (a list, in order). Raises `Busy`
        when the queue cannot take them and `BatcherClosed` after `close`."""
        request: _Request[K, I, R] = _Request(key, list(items))
        if not request.items:
            request.future.set_result([])
            return request.future
        with self._condition:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if self._queued + len(request.items) > self.max_queued and self._queued > 0:
                raise Busy(f"{self._queued} items are waiting, at most {self.max_queued} may")
            self._pending.append(request)
            self._queued += len(request.items)
            self._queued_by_key[key] = self._queued_by_key.get(key, 0) + len(request.items)
            self._condition.notify()
        return request.future

    def close(self, timeout: float | None = None) -> None:
        """Stops taking requests, fails the waiting ones with `BatcherClosed`, lets the running call finish
        and joins the worker."""
        with self._condition:
            self._closed = True
            dropped = list(self._pending)
            self._pending.clear()
            self._queued = 0
            self._queued_by_key.clear()
            self._condition.notify_all()
        for request in dropped:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(BatcherClosed("the server is shutting down"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> Batcher[K, I, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _take(self) -> list[_Request[K, I, R]] | None:
        """The next call's requests: the oldest, then later ones of its key while they fit (None: closed)."""
        with self._condition:
            while not self._pending and not self._closed:
                self._condition.wait()
            self._linger()
            if not self._pending:
                return None
            head = self._pending.popleft()
            group, count = [head], len(head.items)
            kept: deque[_Request[K, I, R]] = deque()
            for request in self._pending:
                if request.key == head.key and count + len(request.items) <= self.capacity:
                    group.append(request)
                    count += len(request.items)
                else:
                    kept.append(request)
            self._pending = kept
            self._queued -= count
            self._queued_by_key[head.key] -= count
            return group

    def _linger(self) -> None:
        """Under load, waits (the condition held) for the head's key to gather what its last call carried, at
        most `linger` after the last call ended and no longer than it ran; an idle batcher passes at once."""
        if not self._pending or self.linger == 0:
            return
        key = self._pending[0].key
        wanted = min(self._carried.get(key, 0), self.capacity)
        deadline = self._last_end + min(self.linger, self._last_seconds)
        while not self._closed and self._queued_by_key.get(key, 0) < wanted:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._condition.wait(left)

    def _main(self) -> None:
        while (group := self._take()) is not None:
            live = [r for r in group if r.future.set_running_or_notify_cancel()]  # a client gone: skip its items
            if not live:
                continue
            items = [item for r in live for item in r.items]
            started = time.monotonic()
            try:
                results: Any = list(self._run(live[0].key, items))
                if len(results) != len(items):  # pragma: no cover - a broken `run`
                    raise RuntimeError(f"batcher: run answered {len(results)} results for {len(items)} items")
            except BaseException as error:  # every request of the call hears it; the worker goes on
                for r in live:
                    r.future.set_exception(error)
            else:
                start = 0
                for r in live:
                    r.future.set_result(results[start : start + len(r.items)])
                    start += len(r.items)
            self._last_end = time.monotonic()
            self._last_seconds = self._last_end - started
            self._carried[live[0].key] = len(items)
            self.calls += 1
            self.requests += len(live)
            self.items += len(items)
