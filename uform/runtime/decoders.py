"""A pool of decoder processes: media items are decoded off the training thread, in parallel, each under a time limit.

`DecodePool.map(function, jobs)` runs `function(*args, **kwargs)` for every `(args, kwargs)` job in worker processes
and answers one `Outcome` per job, in job order. No item can hang or crash the caller:

- a job that raises answers an error outcome (``"ValueError: <message>"``) and its worker lives on;
- a job that runs past ``timeout_seconds`` answers ``"timed out after 2.0 s"``; its worker is killed (SIGKILL) and
  replaced while the rest of the batch completes;
- a worker that dies in a job (a codec segfault, ``os._exit``) answers ``"the decoder process died (signal 11)"``
  and is replaced.

A job is sent to one worker once and never run twice, not even after its worker died.

Each worker is a `uform.runtime.helper.Helper` (a `uform.runtime.child.Child` by default, which never imports the
caller's main module, so a script without a main guard can decode; or a `multiprocessing` process) with a slab
of shared memory of its own, `_SLAB_BYTES` long: a result's large buffers (numpy arrays: an image's patches are
256 KiB) come back through it, read by the pool's one reader thread (`helper.Readers`, which waits on every
worker's pipe at once, so answers never contend with one another for the interpreter lock), and the outcome's
arrays are views of the slab, not copies: held views (`uform.runtime.slab.read_out_of_band`), whose bytes the
worker never overwrites while any of them lives. Each job names the gap of the slab its result may be written
into (`uform.runtime.slab.Areas`: the bytes of earlier results still viewed are left out), so a caller may keep
one map's outcomes while the next map runs; once the last view of a result is gone, its bytes are free again. A
result that does not fit the gap offered crosses the pipe. A job is pickled ``(function, args, kwargs, area)``, its
large buffers (`pickle.PickleBuffer`s among its arguments: the image bytes of a chunk) copied into the worker's input
area past those bytes (`_INPUT_BYTES`), where the worker reads them as views; one that does not fit crosses the pipe. Before running a job whose unpickling was slow (its first job, or any
that took over `_SLOW_LOAD_SECONDS`: an import of the job function's module) a worker sends the note
``"started"``, and the job's time limit runs from then, so neither the interpreter start nor a first import
counts against the decode (they have their own generous limits, `uform.runtime.helper.BOOT_SECONDS` and
`_LOAD_SECONDS`); any other job's limit runs from when it was sent, which saves a message per job. The calling
thread starts workers, gives ready ones their first job, and handles deaths and deadlines; in the steady state
it sleeps.

This module, and the runtime modules it imports (child, heap, helper, remote_error, slab), import only the standard
library, so the worker entry stays light: importing ``uform.runtime.decoders`` loads no torch and no numpy (a job
function that lives in a module importing torch brings torch into the worker when its first job arrives).
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing.util
import os
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .child import START_METHOD, Process
from .child import context as context_of
from .heap import keep_heap
from .helper import BOOT_SECONDS, Helper, Link, NotDelivered, ProcessDied, Readers, UnreadableAnswer, close_all
from .remote_error import describe
from .slab import Areas, reserve_area

__all__ = ["DecodePool", "JobError", "Outcome", "decode_parallelism"]

T = TypeVar("T")

# How long a worker may take to unpickle a job (the first import of the job function's module) beyond the job's limit.
_LOAD_SECONDS = 60.0
# Consecutive failed worker starts, with no start succeeding in between, after which `map` gives up.
_BOOT_FAILURES = 3
# Each worker's shared-memory slab for result buffers (virtual until touched: it holds every result still viewed,
# a preparer's two steps' worth at most, and offers the lowest gap that fits, so its pages stay few).
_SLAB_BYTES = 64 << 20
# Each worker's slab also has an input area past the results' bytes: a job's large buffers (`pickle.PickleBuffer`s in
# its arguments, a chunk's JPEG bytes) are copied there rather than through the pipe, which moves 64 KiB per round
# trip and made every job's send cost the dispatching thread ~0.1 ms per 10 KiB (a chunk of 16 JPEGs: 0.6-3 ms, on
# the one thread that dispatches every worker's next job). One job at a time per worker: the area needs no keeping.
_INPUT_BYTES = 16 << 20
# Job buffers smaller than this stay in the pickled message.
_INPUT_IN_BAND_BELOW = 4096
# Unpickling a job for longer than this (an import) makes the worker announce the job's start, re-arming its limit.
_SLOW_LOAD_SECONDS = 0.05

# Worker states.
_BOOTING, _IDLE, _LOADING, _RUNNING, _GONE = "booting", "idle", "loading", "running", "gone"


def decode_parallelism() -> int:
    """The default number of decoder processes: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


@dataclass
class Outcome(Generic[T]):
    """What one job answered: its value, or a readable reason it has none; and how long it took, in seconds."""

    value: T | None
    error: str | None  # None when the job returned; otherwise why not
    elapsed: float  # seconds from sending the job to its outcome

    @property
    def ok(self) -> bool:
        return self.error is None


class JobError(Exception):
    """A worker's own reason that a job has no value (it could not load the job, or not send its result); its
    message is the outcome's error as it is."""


class _Worker:
    """The pool's view of one worker: its helper and where its job stands."""

    __slots__ = ("areas", "deadline", "future", "helper", "inputs", "job", "reserved", "sent_at", "state", "warm")

    def __init__(self, deadline: float, slab_bytes: int, input_bytes: int) -> None:
        self.helper: Helper | None = None
        self.areas = Areas(slab_bytes)  # the bytes of its slab that results still viewed hold
        self.inputs = (slab_bytes, slab_bytes + input_bytes)  # the jobs' input area, past the results' bytes
        self.reserved = [0]  # bytes of the input area backed so far (`reserve_area`)
        self.state = _BOOTING
        self.deadline = deadline  # monotonic; math.inf when idle
        self.job: int | None = None  # index into the current map's jobs while loading or running
        self.future: Future | None = None  # the job's answer
        self.sent_at = 0.0
        self.warm = False  # it has answered a job, so it announces a job's start only after a slow unpickling


class DecodePool:
    """Runs picklable decode jobs in worker processes, in parallel, each under a time limit.

    ``workers`` 0 means `decode_parallelism()`. Processes start lazily, on the first `map` that needs them, and
    are reused across maps. ``context`` is how workers start: "uform" (the default) as `uform.runtime.child.Child`, a
    fresh interpreter on a module of uform's that never imports the caller's main module (so the caller's script
    needs no main guard, and may come from stdin, ``-c`` or a notebook); or a `multiprocessing` start method
    ("forkserver", "spawn"), which imports the main module again in every worker: only for a process whose main
    module is uform's own (a preparer process's decoders, from a fork server that preloads the decoding libraries).
    The job function, and everything in its jobs, must be importable from a module by name: a worker never
    imports ``__main__``. Worker processes ignore SIGINT: on Ctrl-C the parent's `map` raises KeyboardInterrupt
    (killing the workers that were mid-job, so the pool stays usable) and the parent closes the pool.

    Call `map` from one thread at a time: a lock serializes concurrent callers, and `close` waits for a running
    `map` to finish. The pool is a context manager; `close` is idempotent and also runs at interpreter exit or
    when the pool is garbage-collected.
    """

    def __init__(self, workers: int = 0, timeout_seconds: float = 30.0, context: str = START_METHOD) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers: expected an int >= 0 (0 means one per CPU), got {workers!r}")
        timeout = float(timeout_seconds)
        if not timeout > 0:  # also refuses NaN
            raise ValueError(f"timeout_seconds: expected a positive number of seconds, got {timeout_seconds!r}")
        self.workers = workers or decode_parallelism()
        self.timeout_seconds = timeout
        context_of(context)  # ValueError for an unknown start method
        self.context = context
        self.slab_bytes = _SLAB_BYTES  # each worker's slab for results, for workers started from now on
        self.input_bytes = _INPUT_BYTES  # and its input area for jobs' buffers, past those bytes
        self._workers: list[_Worker] = []
        self._lock = threading.RLock()  # RLock: a signal handler that closes the pool mid-map must not deadlock
        self._readers = Readers("uform-decoders-reader")  # one thread reads every worker's answers
        self._guard = threading.RLock()  # the workers' states and the current map's jobs (readers dispatch too)
        self._wake = threading.Event()  # set by the helpers' readers: an answer, a note, a start or a death
        self._closed = False
        self._boot_failures = 0
        self._owner = os.getpid()
        # Runs once: on close(), when the pool is collected, or at interpreter exit before multiprocessing
        # terminates and joins its children; it does nothing in a forked child, which does not own the workers.
        self._finalizer = multiprocessing.util.Finalize(
            self, _shutdown, args=(self._workers, self._owner), exitpriority=10
        )

    # -- public --------------------------------------------------------------------------------------------------

    def map(
        self, function: Callable[..., T], jobs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> list[Outcome[T]]:
        """Runs ``function(*args, **kwargs)`` for every ``(args, kwargs)`` job, in parallel; one Outcome per job, in order.

        ``function`` must be picklable (a module-level function of a module other than ``__main__``, which the
        workers never import); a job whose arguments do not pickle answers an error outcome. Raises RuntimeError
        when the pool is closed or when worker processes keep failing to start.
        """
        jobs = list(jobs)
        if not jobs:
            return []
        with self._lock:
            self._check_usable()
            try:
                pickle.dumps(function, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise TypeError(
                    f"DecodePool.map: the function must pickle (a module-level function), got {function!r}: "
                    f"{describe(exc)}"
                ) from exc
            if getattr(function, "__module__", None) == "__main__":
                raise TypeError(
                    f"DecodePool.map: the function must live in a module the workers can import, not in the main "
                    f"module (__main__), which they never import; got {function!r}"
                )
            outcomes: list[Outcome[T] | None] = [None] * len(jobs)
            try:
                self._run(function, jobs, outcomes)
            except BaseException:
                # Interrupted (Ctrl-C) or failed: the jobs in flight are abandoned, so their workers must go too.
                self._kill_busy()
                raise
            assert all(o is not None for o in outcomes)
            return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        """Terminates the worker processes (idle ones exit on their own, busy ones are killed). Idempotent."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def abandon(self) -> None:
        """Kills every worker now, without waiting for the pool's lock: for a process about to exit while a
        `map` may still run on another thread (which then fails). The pool is closed."""
        self._closed = True
        self._finalizer()

    @property
    def processes(self) -> list[Process]:
        """The worker processes running now (for inspection and tests)."""
        return [w.helper.process for w in self._workers if w.helper is not None]

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._workers)} running"
        return (
            f"DecodePool(workers={self.workers}, timeout_seconds={self.timeout_seconds}, "
            f"context={self.context!r}; {state})"
        )

    # -- the dispatch loop ---------------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("DecodePool: the pool is closed")
        if os.getpid() != self._owner:
            raise RuntimeError("DecodePool: a pool cannot be used in a forked child; make a new one there")

    def _run(
        self, function: Callable[..., T], jobs: list[tuple[tuple[Any, ...], dict[str, Any]]], outcomes: list
    ) -> None:
        batch = _Batch(function, jobs, outcomes, self.timeout_seconds, self._guard, self._wake)
        while True:
            with self._guard:
                self._wake.clear()  # before looking: whatever happens from now on wakes the wait below
                if not batch.remaining:
                    return
                self._check_usable()
                now = time.monotonic()
                for worker in list(self._workers):
                    self._service(worker, batch, now)
                self._start_workers(len(batch.pending))
                for worker in self._workers:  # the readers hand busy workers their next job themselves
                    if worker.state == _IDLE and batch.pending:
                        batch.send(worker)
                if not batch.remaining:
                    return
                nearest = min((w.deadline for w in self._workers), default=math.inf)
            self._wake.wait(None if math.isinf(nearest) else max(0.0, nearest - time.monotonic()))

    def _start_workers(self, wanted: int) -> None:
        """Starts workers until those idle or starting cover the ``wanted`` pending jobs, up to the pool's size."""
        available = sum(w.state in (_IDLE, _BOOTING) for w in self._workers)
        while available < wanted and len(self._workers) < self.workers:
            worker = _Worker(time.monotonic() + BOOT_SECONDS, self.slab_bytes, self.input_bytes)
            helper = Helper(
                _worker_main,
                name="uform-decoder",
                context=self.context,
                slab_bytes=self.slab_bytes + self.input_bytes,
                slab_prefix="uform-decoder-",
                lease=worker.areas.hold,  # a result's arrays are views of the slab until the caller drops them
                # The callbacks hold the worker, the lock and the event, never the pool (collected when unused).
                on_note=functools.partial(_started, worker, self.timeout_seconds, self._guard, self._wake),
                readers=self._readers,
            )
            helper.start()
            worker.helper = helper
            helper.ready.add_done_callback(functools.partial(_wake, self._wake))
            helper.ended.add_done_callback(functools.partial(_wake, self._wake))
            self._workers.append(worker)
            available += 1

    def _service(self, worker: _Worker, batch: _Batch, now: float) -> None:
        """Looks at one worker (under the guard): it became ready, died, or ran past its deadline."""
        helper = worker.helper
        assert helper is not None
        if worker.state == _BOOTING and helper.ready.done():
            if helper.ready.exception() is None:
                worker.state, worker.deadline = _IDLE, math.inf
                self._boot_failures = 0
            else:
                died = helper.died
                status = "exit status unknown" if died is None else died.status
                self._discard(worker, batch, "", boot_failure=f"exited ({status}) before it was ready")
                return
        if worker.state in (_IDLE, _GONE) and helper.ended.done():  # its job, if any, was answered
            self._discard(worker, batch, "", "")
        elif worker.deadline <= now:
            self._expire(worker, batch, now)

    def _expire(self, worker: _Worker, batch: _Batch, now: float) -> None:
        """A worker past its deadline: kill it; its job answers a time-out."""
        assert worker.helper is not None
        worker.helper.kill()  # its reader reaps it
        if worker.state == _RUNNING:
            reason = f"timed out after {self.timeout_seconds} s"
        else:
            reason = f"timed out loading the job after {now - worker.sent_at:.1f} s"
        self._discard(worker, batch, reason, boot_failure=f"was not ready within {BOOT_SECONDS} s")

    def _discard(self, worker: _Worker, batch: _Batch | None, reason: str, boot_failure: str) -> None:
        """Drops a worker that died or was killed; its job, if any, answers `reason`."""
        with contextlib.suppress(ValueError):  # already gone if close() ran inside a signal handler
            self._workers.remove(worker)
        booting, worker.state = worker.state == _BOOTING, _GONE  # a late answer of its job is ignored
        if booting:
            self._boot_failures += 1
            if self._boot_failures >= _BOOT_FAILURES:
                self._boot_failures = 0
                hint = (
                    "its error is on standard error"
                    if self.context == START_METHOD
                    else "does the main module start the pool outside `if __name__ == '__main__':`?"
                )
                raise RuntimeError(
                    f"DecodePool: worker processes fail to start: the last one {boot_failure} (start method "
                    f"{self.context!r}; {hint})"
                )
            return
        if worker.job is not None and batch is not None:
            batch.answer(worker.job, Outcome(None, reason, time.monotonic() - worker.sent_at))
        worker.job = None

    def _kill_busy(self) -> None:
        with self._guard:
            for worker in list(self._workers):
                if worker.state != _IDLE:
                    if worker.helper is not None:
                        worker.helper.kill()
                    worker.state = _GONE
                    with contextlib.suppress(ValueError):
                        self._workers.remove(worker)


class _Batch:
    """One `map`'s jobs: those pending, the outcomes, and the dispatch. A worker's reader hands the worker its
    next job as soon as it answered one (`answered`), so in the steady state the calling thread sleeps and
    each answer costs one thread's wake-up; the calling thread dispatches to workers that became ready and
    handles deaths and deadlines. Everything here runs under the pool's guard."""

    def __init__(
        self,
        function: Callable[..., Any],
        jobs: list[tuple[tuple[Any, ...], dict[str, Any]]],
        outcomes: list,
        timeout: float,
        guard: threading.RLock,
        wake: threading.Event,
    ) -> None:
        self.function = function
        self.jobs = jobs
        self.outcomes = outcomes
        self.timeout = timeout
        self.guard = guard
        self.wake = wake
        self.pending = deque(range(len(jobs)))
        self.remaining = len(jobs)

    def answer(self, index: int, outcome: Outcome) -> None:
        self.outcomes[index] = outcome
        self.remaining -= 1

    def send(self, worker: _Worker) -> None:
        """Sends pending jobs to an idle worker until one is on its way (a job that does not pickle answers an
        error at once; the worker stays idle if it is gone)."""
        helper = worker.helper
        assert helper is not None
        while self.pending:
            index = self.pending.popleft()
            args, kwargs = self.jobs[index]
            sent_at = time.monotonic()
            # Armed before it is sent: the worker's "started" may come back before `submit` returns.
            worker.job, worker.sent_at = index, sent_at
            if worker.warm:  # its job is unpickled at once, unless it says otherwise with "started"
                worker.state, worker.deadline = _RUNNING, sent_at + self.timeout
            else:
                worker.state, worker.deadline = _LOADING, sent_at + self.timeout + _LOAD_SECONDS
            area = worker.areas.offer()  # where its result may go: no bytes a result still viewed holds
            try:
                future = helper.submit(
                    (self.function, tuple(args), dict(kwargs), area),
                    area=worker.inputs,
                    reserve=functools.partial(_reserve_inputs, worker),
                    in_band_below=_INPUT_IN_BAND_BELOW,
                )
            except NotDelivered:  # it died while idle: the job never reached it, so it may go to another worker
                worker.state, worker.job, worker.deadline = _GONE, None, math.inf  # buried once reaped
                self.pending.appendleft(index)
                return
            except Exception as exc:
                worker.state, worker.job, worker.deadline = _IDLE, None, math.inf
                self.answer(index, Outcome(None, f"could not send the job: {describe(exc)}", 0.0))
                continue
            worker.future = future
            future.add_done_callback(functools.partial(self.answered, worker))
            return

    def answered(self, worker: _Worker, future: Future) -> None:
        """A job's future resolved (on the worker's reader): its outcome, then the worker's next job."""
        with self.guard:
            if worker.future is not future or worker.state not in (_LOADING, _RUNNING):
                return  # a worker the calling thread already gave up on (timed out, interrupted)
            assert worker.job is not None
            error = future.exception()
            elapsed = time.monotonic() - worker.sent_at
            if isinstance(error, ProcessDied):
                self.answer(worker.job, Outcome(None, f"the decoder process died ({error.status})", elapsed))
                worker.state, worker.deadline = _GONE, math.inf  # buried by the calling thread once reaped
            elif error is not None:
                self.answer(worker.job, Outcome(None, _reason(error), elapsed))
                worker.state, worker.deadline, worker.warm = _IDLE, math.inf, True
            else:
                self.answer(worker.job, Outcome(future.result(), None, elapsed))
                worker.state, worker.deadline, worker.warm = _IDLE, math.inf, True
            worker.job, worker.future = None, None
            assert worker.helper is not None
            if worker.state == _IDLE and self.pending and not worker.helper.ended.done():
                self.send(worker)
            # The calling thread sleeps on: a worker that took its next job has a later deadline than the one
            # it waits for. It wakes when the map is done, or for a worker now idle or gone.
            busy = worker.state in (_LOADING, _RUNNING)
        if not busy or not self.remaining:
            self.wake.set()


def _reserve_inputs(worker: _Worker, length: int) -> bool:
    """Backs the first `length` bytes of `worker`'s input area with memory (False: no room, the job goes in band)."""
    helper = worker.helper
    fd = None if helper is None else helper.slab_fd
    return reserve_area(fd, worker.reserved, 0, worker.inputs[0], length)


def _wake(event: threading.Event, _: object = None) -> None:
    event.set()


def _started(worker: _Worker, timeout: float, guard: threading.RLock, wake: threading.Event, _note: object) -> None:
    """A worker's note (on its reader) that its job is unpickled and starts now: the job's limit runs from now."""
    with guard:
        if worker.state in (_LOADING, _RUNNING):
            worker.state, worker.deadline = _RUNNING, time.monotonic() + timeout
    wake.set()  # the deadline came nearer


def _reason(error: BaseException) -> str:
    """An outcome's error for what a job's future raised."""
    if isinstance(error, JobError):
        return str(error)
    if isinstance(error, UnreadableAnswer):
        return f"could not load the result: {error.reason}"
    return describe(error)


def _shutdown(workers: list[_Worker], owner: int) -> None:
    """Ends every worker: idle ones are asked to exit; the rest are killed."""
    if os.getpid() != owner:  # a forked child does not own them
        return
    helpers = [w.helper for w in workers if w.helper is not None]
    for worker in workers:
        if worker.state != _IDLE and worker.helper is not None:
            worker.helper.kill()
    workers.clear()
    close_all(helpers)


# -- the worker process --------------------------------------------------------------------------------------------


def _worker_main(link: Link) -> None:
    """A worker's whole life: map its slab, say ready, then run jobs until the pool asks it to exit or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    keep_heap()  # a job's buffers are the same few sizes job after job: from the heap, not fresh pages
    endpoint = link.open()
    if not endpoint.ready():
        return
    first = True
    while True:
        try:
            frame = endpoint.receive()
        except (EOFError, OSError):
            return
        if frame is None:
            return
        ident, loading = frame.ident, time.monotonic()
        try:
            function, args, kwargs, area = frame.load()
        except BaseException as exc:
            reason = describe(exc)
            if "__main__" in reason:
                reason += " (the decoder processes never import the main module: define it in a module of its own)"
            sent = endpoint.fail(ident, JobError(f"could not load the job: {reason}"))
        else:
            del frame  # the job's bytes: its arguments are unpickled copies
            if (first or time.monotonic() - loading > _SLOW_LOAD_SECONDS) and not endpoint.note("started"):
                return
            first = False
            try:
                value = function(*args, **kwargs)
            except BaseException as exc:  # SystemExit and KeyboardInterrupt included: the job's, not ours
                sent = endpoint.fail(ident, exc)
            else:
                try:
                    sent = endpoint.reply(ident, value, area=area)
                except Exception as exc:  # an unpicklable result (or one whose pickling raised)
                    sent = endpoint.fail(ident, JobError(f"could not send the result: {describe(exc)}"))
                del value
            del function, args, kwargs
        if not sent:
            return
