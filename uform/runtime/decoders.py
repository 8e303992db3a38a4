"""A pool of decoder processes: media items are decoded off the training thread, in parallel, each under a time limit.

`DecodePool.map(function, jobs)` runs `function(*args, **kwargs)` for every `(args, kwargs)` job in worker processes
and answers one `Outcome` per job, in job order. No item can hang or crash the caller:

- a job that raises answers an error outcome (``"ValueError: <message>"``) and its worker lives on;
- a job that runs past ``timeout_seconds`` answers ``"timed out after 2.0 s"``; its worker is killed (SIGKILL) and
  replaced while the rest of the batch completes;
- a worker that dies in a job (a codec segfault, ``os._exit``) answers ``"the decoder process died (signal 11)"``
  and is replaced.

A job is sent to one worker once and never run twice, not even after its worker died.

Protocol. Each worker is a process (a `uform.runtime.child.Child` by default, which never imports the caller's main
module, so a script without a main guard can decode; or a `multiprocessing` process) with a pipe of its own, and
(where /dev/shm exists) a slab of shared memory of its own, `_SLAB_BYTES` long. It sends ``("ready",)`` once it has
started, then for each job it receives (pickled ``(function, args, kwargs)``) it sends ``("ok", value)`` or
``("error", reason)`` when it finishes; an empty message asks it to exit. Before running a job whose unpickling was
slow (its first job, or any that took over `_SLOW_LOAD_SECONDS`: an import of the job function's module) it sends
``("started",)``, and the job's time limit runs from then, so neither the interpreter start nor a first import
counts against the decode (they have their own generous limits, `_BOOT_SECONDS` and `_LOAD_SECONDS`); any other
job's limit runs from when it was sent, which saves the parent a wake-up per job. The parent waits with `multiprocessing.connection.wait` on the pipes and the process sentinels
until the nearest deadline. Results cross with pickle, between our own processes only; user files are never
unpickled. A result's large buffers (numpy arrays: an image's patches are 256 KiB) do not cross the pipe: the
worker pickles with protocol 5, writes the out-of-band buffers into its slab and sends ``("slab", header,
spans)``; the parent copies them out once and unpickles around them. A pipe moves 64 KiB per round trip between
the two processes, which made the parent the bottleneck of a 16-worker pool (about 0.45 GB/s in all); the slab is
a memcpy. The parent reads a worker's slab before giving it another job, so one slab per worker suffices; a result
larger than the slab goes through the pipe. The slab's file is unlinked as soon as it is made: the worker maps it
through a duplicate of its descriptor passed when the worker starts, so no name under /dev/shm outlives a process
killed at any moment. The slab helpers (`create_slab`, `SlabFile`, `reserve_slab`, `slab_payload`, `load_message`, `release_slab`) also carry a trainer's
steps to and from its host processes (`uform.runtime.preparers`).

This module imports only the standard library at top level, so the worker entry stays light. (Importing it as
``uform.runtime.decoders`` still runs the package's ``__init__``; a job function that lives in a module importing torch
brings torch into the worker when its first job arrives.)
"""

from __future__ import annotations

import contextlib
import math
import mmap
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from .child import Process

__all__ = ["DecodePool", "Outcome", "decode_parallelism"]

T = TypeVar("T")

# How long a fresh worker may take to start (interpreter, imports) before it is killed as a failed start.
_BOOT_SECONDS = 120.0
# How long a worker may take to unpickle a job (the first import of the job function's module) beyond the job's limit.
_LOAD_SECONDS = 60.0
# Consecutive failed worker starts, with no start succeeding in between, after which `map` gives up.
_BOOT_FAILURES = 3
# How long `close` lets idle workers exit on their own before killing them.
_CLOSE_GRACE_SECONDS = 1.0
# How long to wait for a killed (or dead) worker to be reaped.
_REAP_SECONDS = 5.0

# Each worker's shared-memory slab for result buffers (virtual until touched: a slab holds one result at a time).
_SLAB_BYTES = 16 << 20
_SLAB_FOLDER = "/dev/shm"
_SLAB_ALIGN = 64

# Unpickling a job for longer than this (an import) makes the worker announce the job's start, re-arming its limit.
_SLOW_LOAD_SECONDS = 0.05

# Worker states.
_BOOTING, _IDLE, _LOADING, _RUNNING = "booting", "idle", "loading", "running"

_DEFAULT_CONTEXT = (
    "uform"  # uform.runtime.child.START_METHOD (imported when a pool is made: this module loads standalone)
)


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


class _Worker:
    """The parent's view of one worker process."""

    __slots__ = ("conn", "deadline", "job", "process", "sent_at", "slab", "state", "warm")

    def __init__(self, process: Process, conn: Connection, deadline: float, slab: mmap.mmap | None) -> None:
        self.process = process
        self.conn = conn
        self.slab = slab  # the parent's mapping of the worker's result slab, None without shared memory
        self.state = _BOOTING
        self.deadline = deadline  # monotonic; math.inf when idle
        self.job: int | None = None  # index into the current map's jobs while loading or running
        self.sent_at = 0.0
        self.warm = False  # it has answered a job, so it announces a job's start only after a slow unpickling


class DecodePool:
    """Runs picklable decode jobs in worker processes, in parallel, each under a time limit.

    ``workers`` 0 means `decode_parallelism()`. Processes start lazily, on the first `map` that needs them, and
    are reused across maps. ``context`` is how workers start: "uform" (the default) as `uform.runtime.child.Child`, a
    fresh interpreter on a module of uform's that never imports the caller's main module (so the caller's script
    needs no main guard, and may come from stdin, ``-c`` or a notebook); or a `multiprocessing` start method
    ("forkserver", "spawn"), which imports the main module again in every worker: only for a process whose main
    module is uform's own (a host process's decoders, from a fork server that preloads the decoding libraries).
    The job function, and everything in its jobs, must be importable from a module by name: a worker never
    imports ``__main__``. Worker processes ignore SIGINT: on Ctrl-C the parent's `map` raises KeyboardInterrupt
    (killing the workers that were mid-job, so the pool stays usable) and the parent closes the pool.

    Call `map` from one thread at a time: a lock serializes concurrent callers, and `close` waits for a running
    `map` to finish. The pool is a context manager; `close` is idempotent and also runs at interpreter exit or
    when the pool is garbage-collected.
    """

    def __init__(self, workers: int = 0, timeout_seconds: float = 30.0, context: str = _DEFAULT_CONTEXT) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers: expected an int >= 0 (0 means one per CPU), got {workers!r}")
        timeout = float(timeout_seconds)
        if not timeout > 0:  # also refuses NaN
            raise ValueError(f"timeout_seconds: expected a positive number of seconds, got {timeout_seconds!r}")
        self.workers = workers or decode_parallelism()
        self.timeout_seconds = timeout
        # Local: this module loads standalone, from its file, with the standard library only (no uform).
        from .child import context as context_of

        self._ctx: Any = context_of(context)  # ValueError for an unknown start method
        self.context = context
        self.slab_bytes = _SLAB_BYTES  # each worker's shared-memory slab, for workers started from now on
        self._workers: list[_Worker] = []
        self._lock = threading.RLock()  # RLock: a signal handler that closes the pool mid-map must not deadlock
        self._closed = False
        self._boot_failures = 0
        self._owner = os.getpid()
        # Runs once: on close(), when the pool is collected, or at interpreter exit before multiprocessing
        # terminates and joins its children; it does nothing in a forked child, which does not own the workers.
        self._finalizer = multiprocessing.util.Finalize(self, _shutdown, args=(self._workers,), exitpriority=10)

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
                    f"{_describe(exc)}"
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

    @property
    def processes(self) -> list[Process]:
        """The worker processes running now (for inspection and tests)."""
        return [w.process for w in self._workers]

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
        pending = deque(range(len(jobs)))
        remaining = len(jobs)
        while remaining:
            self._check_usable()
            self._start_workers(len(pending))
            # Dispatch: one pending job to each idle worker.
            for worker in self._workers:
                if not pending:
                    break
                if worker.state != _IDLE:
                    continue
                index = pending.popleft()
                args, kwargs = jobs[index]
                sent_at = time.monotonic()
                try:
                    payload = pickle.dumps((function, tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    outcomes[index] = Outcome(None, f"could not send the job: {_describe(exc)}", 0.0)
                    remaining -= 1
                    continue
                try:
                    worker.conn.send_bytes(payload)
                except OSError:
                    # The worker died while idle: the job never reached it, so it may go to another worker.
                    pending.appendleft(index)
                    continue  # its death is noticed below, through its sentinel
                worker.job, worker.sent_at = index, sent_at
                if worker.warm:  # its job is unpickled at once, unless it says otherwise with "started"
                    worker.state, worker.deadline = _RUNNING, sent_at + self.timeout_seconds
                else:
                    worker.state, worker.deadline = _LOADING, sent_at + self.timeout_seconds + _LOAD_SECONDS
            if not remaining:
                break
            # Wait for a message, a death, or the nearest deadline.
            waitables: list[Any] = []
            for worker in self._workers:
                waitables += (worker.conn, worker.process.sentinel)
            nearest = min((w.deadline for w in self._workers), default=math.inf)
            timeout = None if math.isinf(nearest) else max(0.0, nearest - time.monotonic())
            ready = set(multiprocessing.connection.wait(waitables, timeout))
            for worker in list(self._workers):
                if worker.conn in ready or worker.process.sentinel in ready:
                    remaining -= self._service(worker, outcomes)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.deadline <= now:
                    remaining -= self._expire(worker, outcomes, now)

    def _start_workers(self, wanted: int) -> None:
        """Starts workers until those idle or starting cover the ``wanted`` pending jobs, up to the pool's size."""
        available = sum(w.state in (_IDLE, _BOOTING) for w in self._workers)
        while available < wanted and len(self._workers) < self.workers:
            parent_end, child_end = self._ctx.Pipe(duplex=True)
            slab, fd = create_slab(self.slab_bytes)
            shared = None if fd is None else SlabFile(fd)
            process = self._ctx.Process(
                target=_worker_main, args=(child_end, shared, self.slab_bytes), name="uform-decoder", daemon=True
            )
            try:
                process.start()  # the slab's descriptor travels to the worker here, duplicated
            except BaseException:
                release_slab(slab)
                raise
            finally:
                child_end.close()  # the parent keeps only its end, so a dead worker reads as end of file
                if fd is not None:
                    os.close(fd)  # the parent keeps only its mapping
            self._workers.append(_Worker(process, parent_end, time.monotonic() + _BOOT_SECONDS, slab))
            available += 1

    def _service(self, worker: _Worker, outcomes: list) -> int:
        """Reads the worker's messages, or buries it if it died; answers how many jobs finished (0 or 1)."""
        try:
            while worker.conn.poll():
                data = worker.conn.recv_bytes()
                now = time.monotonic()
                try:
                    message = load_message(data, worker.slab)
                except Exception as exc:  # a result whose class does not load here; the worker itself is fine
                    message = ("error", f"could not load the result: {_describe(exc)}")
                del data
                kind = message[0] if isinstance(message, tuple) and message else None
                if kind == "ready" and worker.state == _BOOTING:
                    worker.state, worker.deadline = _IDLE, math.inf
                    self._boot_failures = 0
                elif kind == "started" and worker.state in (_LOADING, _RUNNING):
                    worker.state, worker.deadline = _RUNNING, now + self.timeout_seconds
                elif kind in ("ok", "error") and worker.job is not None and len(message) == 2:
                    value, error = (message[1], None) if kind == "ok" else (None, str(message[1]))
                    outcomes[worker.job] = Outcome(value, error, now - worker.sent_at)
                    worker.state, worker.job, worker.deadline = _IDLE, None, math.inf
                    worker.warm = True
                    # One result per wake-up; anything else pending is read on the next one. A worker that
                    # exited right after answering is buried then too (its sentinel stays ready).
                    return 1
                else:  # cannot happen with our worker: treat it as broken
                    _kill(worker)
                    return self._bury(worker, outcomes)
        except (EOFError, OSError):
            return self._bury(worker, outcomes)
        if not worker.process.is_alive():
            return self._bury(worker, outcomes)
        return 0

    def _bury(self, worker: _Worker, outcomes: list) -> int:
        """A worker that exited (or broke its pipe): reap it; its job, if any, answers why. Answers jobs finished."""
        worker.process.join(_REAP_SECONDS)
        if worker.process.is_alive():  # a broken pipe but a live process: make sure it is gone
            worker.process.kill()
            worker.process.join(_REAP_SECONDS)
        status = exit_status(worker.process.exitcode)
        return self._discard(
            worker,
            outcomes,
            f"the decoder process died ({status})",
            boot_failure=f"exited ({status}) before it was ready",
        )

    def _expire(self, worker: _Worker, outcomes: list, now: float) -> int:
        """A worker past its deadline: kill it; its job answers a time-out. Answers jobs finished."""
        _kill(worker)
        if worker.state == _RUNNING:
            reason = f"timed out after {self.timeout_seconds} s"
        else:
            reason = f"timed out loading the job after {now - worker.sent_at:.1f} s"
        return self._discard(worker, outcomes, reason, boot_failure=f"was not ready within {_BOOT_SECONDS} s")

    def _discard(self, worker: _Worker, outcomes: list, reason: str, boot_failure: str) -> int:
        with contextlib.suppress(ValueError):  # already gone if close() ran inside a signal handler
            self._workers.remove(worker)
        with contextlib.suppress(OSError):
            worker.conn.close()
        release_slab(worker.slab)
        worker.slab = None
        if worker.state == _BOOTING:
            self._boot_failures += 1
            if self._boot_failures >= _BOOT_FAILURES:
                self._boot_failures = 0
                hint = (
                    "its error is on standard error"
                    if self.context == _DEFAULT_CONTEXT
                    else "does the main module start the pool outside `if __name__ == '__main__':`?"
                )
                raise RuntimeError(
                    f"DecodePool: worker processes fail to start: the last one {boot_failure} (start method "
                    f"{self.context!r}; {hint})"
                )
            return 0
        if worker.job is None:  # idle: nothing was lost
            return 0
        outcomes[worker.job] = Outcome(None, reason, time.monotonic() - worker.sent_at)
        worker.job = None
        return 1

    def _kill_busy(self) -> None:
        for worker in list(self._workers):
            if worker.state != _IDLE:
                _kill(worker)
                with contextlib.suppress(ValueError):
                    self._workers.remove(worker)
                with contextlib.suppress(OSError):
                    worker.conn.close()
                release_slab(worker.slab)
                worker.slab = None


# -- helpers, shared by parent and worker --------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    """``"ValueError: <message>"``, or just the type name when the message is empty."""
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable message>"
    name = type(exc).__name__
    return f"{name}: {message}" if message else name


def exit_status(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _kill(worker: _Worker) -> None:
    with contextlib.suppress(OSError, ValueError):
        worker.process.kill()
        worker.process.join(_REAP_SECONDS)


def _shutdown(workers: list[_Worker]) -> None:
    """Ends every worker: idle ones get end of file and exit; the rest, and stragglers, are killed."""
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.conn.close()  # an idle worker reads end of file and exits
        if worker.state != _IDLE:
            with contextlib.suppress(OSError, ValueError):
                worker.process.kill()
    deadline = time.monotonic() + _CLOSE_GRACE_SECONDS
    for worker in workers:
        reap(worker.process, deadline)
        release_slab(worker.slab)
        worker.slab = None
    workers.clear()


def create_slab(size: int, prefix: str = "uform-decoder-") -> tuple[mmap.mmap | None, int | None]:
    """A fresh zero-filled (sparse) slab of `size` bytes under /dev/shm, mapped here: (mapping, open descriptor),
    or (None, None) where there is none. Its file is unlinked at once, so nothing is left behind whoever dies
    when: another process maps it through the descriptor (`SlabFile`, passed in a `multiprocessing` start), and
    its pages go with the last descriptor and mapping. Close the descriptor once it is sent and no longer
    reserves pages (`reserve_slab`)."""
    if not os.path.isdir(_SLAB_FOLDER):
        return None, None
    try:
        fd, path = tempfile.mkstemp(prefix=prefix, dir=_SLAB_FOLDER)
    except OSError:
        return None, None
    with contextlib.suppress(OSError):
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size), fd
    except (OSError, ValueError, OverflowError):
        os.close(fd)
        return None, None


class SlabFile:
    """A slab's descriptor as an argument of a worker process, so the slab needs no name on the file system: a
    `uform.runtime.child.Child` inherits it under the same number (``inherited_fd``), and for a process that
    `multiprocessing` starts it pickles as a duplicate sent to the child (as a `Connection` does)."""

    inherited_fd = True  # uform.runtime.child's mark: crosses to a Child as `fd`, rebuilt there as SlabFile(fd)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_slab_file, (reduction.DupFd(self.fd),)  # only while a process is being started

    def map(self, size: int) -> mmap.mmap:
        return mmap.mmap(self.fd, size)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _rebuild_slab_file(duplicate: Any) -> SlabFile:
    return SlabFile(duplicate.detach())


def reserve_slab(fd: int, offset: int, length: int) -> bool:
    """Backs `length` bytes of a slab file from `offset` with memory now (``posix_fallocate``), so that writing
    them cannot fault with SIGBUS when /dev/shm is full; False when there is no room (the caller sends in band)."""
    if length <= 0:
        return True
    try:
        os.posix_fallocate(fd, offset, length)
    except (OSError, AttributeError):  # ENOSPC, or no posix_fallocate on this platform
        return False
    return True


def reserve_area(fd: int | None, reserved: list[int], index: int, start: int, length: int) -> bool:
    """Backs the first `length` bytes of area `index` of a slab file, which begins at `start`, with memory
    (`reserve_slab`); `reserved[index]` counts the bytes already backed and grows (an area keeps its pages, so
    each byte is reserved once). False when there is no room, or no file."""
    if length <= reserved[index]:
        return True
    if fd is None or not reserve_slab(fd, start + reserved[index], length - reserved[index]):
        return False
    reserved[index] = length
    return True


def reap(process: Any, deadline: float) -> None:
    """Waits for `process` to exit until `deadline` (time.monotonic), then kills it and waits for that."""
    with contextlib.suppress(OSError, ValueError, AssertionError):
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(_REAP_SECONDS)


def release_slab(slab: mmap.mmap | None) -> None:
    """Closes a slab's mapping (unless views of it live on: it then goes with the last of them)."""
    if slab is not None:
        with contextlib.suppress(BufferError, ValueError):
            slab.close()


def load_message(data: bytes, slab: mmap.mmap | None, copy: bool = True) -> Any:
    """A message: plain pickle, or ``("slab", header, spans)`` whose out-of-band buffers wait in `slab` at the
    (offset, length) `spans`. `copy` takes each buffer out of the slab (the one copy); without it the message's
    arrays are views of the slab, valid until the writer reuses those bytes."""
    message = pickle.loads(data)
    if isinstance(message, tuple) and len(message) == 3 and message[0] == "slab":
        if slab is None:
            raise ValueError("a slab message from a worker without a slab")
        _, header, spans = message
        if not copy:
            view = memoryview(slab)
            return pickle.loads(header, buffers=[view[at : at + length] for at, length in spans])
        with memoryview(slab) as view:  # the one copy, out of the slab
            buffers = [bytearray(view[at : at + length]) for at, length in spans]
        return pickle.loads(header, buffers=buffers)
    return message


def slab_payload(
    message: Any,
    slab: mmap.mmap,
    start: int = 0,
    end: int | None = None,
    reserve: Callable[[int], bool] | None = None,
    in_band_below: int = 0,
) -> bytes | None:
    """``("slab", header, spans)`` with the message's out-of-band buffers (those of `in_band_below` bytes or more)
    written into `slab[start:end]`; None when it has none, or they do not fit, or `reserve(length)` (which backs
    the first `length` bytes of that area) says there is no room: the message then crosses the pipe whole."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        with buffer.raw() as raw:  # raises for a non-contiguous buffer: the caller's fallback sends in band
            if raw.nbytes < in_band_below:
                return True
        buffers.append(buffer)
        return False

    header = pickle.dumps(message, protocol=5, buffer_callback=out_of_band)
    if not buffers:
        return None
    end = len(slab) if end is None else end
    views = [b.raw() for b in buffers]
    spans, at = [], start
    for view in views:
        if at + view.nbytes > end:
            return None
        spans.append((at, view.nbytes))
        at += -(-view.nbytes // _SLAB_ALIGN) * _SLAB_ALIGN
    if reserve is not None and not reserve(spans[-1][0] + spans[-1][1] - start):
        return None
    for view, (at, length) in zip(views, spans, strict=True):
        slab[at : at + length] = view
    return pickle.dumps(("slab", header, spans), protocol=pickle.HIGHEST_PROTOCOL)


# -- the worker process --------------------------------------------------------------------------------------------


def _send(conn: Connection, message: tuple[Any, ...], slab: mmap.mmap | None = None) -> bool:
    """Sends one message to the parent, its large buffers through `slab` when they fit; False when the parent
    is gone."""
    try:
        payload = None
        if slab is not None:
            with contextlib.suppress(Exception):  # e.g. a non-contiguous buffer: the message goes in band
                payload = slab_payload(message, slab)
        if payload is None:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an unpicklable result (or one whose pickling raised)
        payload = pickle.dumps(("error", f"could not send the result: {_describe(exc)}"))
    try:
        conn.send_bytes(payload)
    except OSError:
        return False
    return True


def _worker_main(conn: Connection, slab_file: SlabFile | None = None, slab_bytes: int = _SLAB_BYTES) -> None:
    """A worker's whole life: map its slab, announce readiness, then run jobs until end of file or an empty
    message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    slab = None
    if slab_file is not None:
        try:
            slab = slab_file.map(slab_bytes)
        except (OSError, ValueError):
            slab = None  # results cross the pipe whole
        slab_file.close()  # the mapping stays
    if not _send(conn, ("ready",)):
        return
    first = True
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not data:
            return
        reply: tuple[Any, ...]
        loading = time.monotonic()
        try:
            function, args, kwargs = pickle.loads(data)
        except BaseException as exc:
            reason = _describe(exc)
            if "__main__" in reason:
                reason += " (the decoder processes never import the main module: define it in a module of its own)"
            reply = ("error", f"could not load the job: {reason}")
        else:
            del data
            if (first or time.monotonic() - loading > _SLOW_LOAD_SECONDS) and not _send(conn, ("started",)):
                return
            first = False
            try:
                reply = ("ok", function(*args, **kwargs))
            except BaseException as exc:  # SystemExit and KeyboardInterrupt included: the job's, not ours
                reply = ("error", _describe(exc))
            del function, args, kwargs
        if not _send(conn, reply, slab):
            return
        del reply
