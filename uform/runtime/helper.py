"""A helper process: the one way uform runs work in a process of its own, for the decode pool
(`uform.runtime.decoders`), a trainer's preparer processes (`uform.runtime.preparers`) and the device workers
(`uform.runtime.workers`). Each of those says what a job is and where it goes; this module carries it.

The owner's side is a `Helper`: it starts the process (a `uform.runtime.child.Child` by default, or a
`multiprocessing` start method) with a pipe and, where asked, a shared-memory slab of its own
(`uform.runtime.slab`); `submit(payload)` sends a call and answers a `Future` of the helper's reply; one reader
thread per helper (or one for several, `Readers`: a pool's) reads every message, resolves the futures, hands the helper's notes (progress reports, "I
started") to a callback and, when the process ends, reaps it and fails every call still pending with
`ProcessDied` naming it and its exit status (or with what the owner's ``lost`` makes of that). An exception
raised for a call in the helper crosses back with its type and its traceback (`uform.runtime.remote_error`).
`close_all` asks helpers to exit, waits `CLOSE_SECONDS` for them (one deadline for all), then kills the rest;
the reader thread is the only one that reaps a process (two threads reaping one process race for its status).

The helper's side is an `Endpoint`, made from the `Link` its target receives as its first argument:
`receive()` answers the owner's next call or note (None once the owner asked it to exit; EOFError once the
owner is gone), and `reply`, `fail` and `note` answer, from any thread.

The wire: every message is one pipe message, a 9-byte header (kind, the call's ident) then a pickled body, so
the ident is known before the body is unpickled (a body that does not load fails its own call, nothing else).
A body may put its large buffers (numpy arrays, `pickle.PickleBuffer`) into an area of the slab
(`uform.runtime.slab.write_out_of_band`): the body then names where they lie. Everything crosses with pickle,
between our own processes only; no user file is ever unpickled.

Standard library only: the decode pool's workers import it before anything else.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import multiprocessing.connection
import os
import pickle
import struct
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .child import START_METHOD
from .child import context as context_of
from .remote_error import describe, pack_error, unpack_error
from .slab import SlabFile, create_slab, read_out_of_band, release_slab, write_out_of_band

__all__ = [
    "BOOT_SECONDS",
    "CLOSE_SECONDS",
    "REAP_SECONDS",
    "Endpoint",
    "Frame",
    "Helper",
    "Link",
    "NotDelivered",
    "ProcessDied",
    "Readers",
    "UnreadableAnswer",
    "close_all",
    "exit_status",
]

BOOT_SECONDS = 120.0
"""How long a fresh helper may take to start (an interpreter, its imports, its slab) and say it is ready."""
CLOSE_SECONDS = 10.0
"""How long `close_all` lets helpers that were asked to exit end on their own (a preparer process ends its
decoders first) before it kills them."""
REAP_SECONDS = 5.0
"""How long to wait for a process that ended (or was killed) to be reaped."""

_HEADER = struct.Struct("<Bq")  # kind, ident
_READY, _CALL, _NOTE, _OK, _ERROR, _EXIT = range(1, 7)
_IN_SLAB = 0x80  # a kind's flag: the body is (header, spans) of a message whose buffers wait in the slab

Reserve = Callable[[int], bool]
"""Backs the first n bytes of an area of the slab with memory; False when there is no room."""
Lease = Callable[[list[tuple[int, int]]], Callable[[], None]]
"""Takes the spans of the slab that a reply's buffers hold (the owner may not reuse them) and answers what to run
once the last view of them is gone (it may)."""


def exit_status(exitcode: int | None) -> str:
    """A process's exit code in words: ``"exit code 3"``, ``"signal 9"``."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class ProcessDied(RuntimeError):
    """A helper process ended while it held calls (or before it was ready): names it and its exit status."""

    def __init__(self, name: str, pid: int | None, exitcode: int | None) -> None:
        self.name, self.pid, self.exitcode = name, pid, exitcode
        self.status = exit_status(exitcode)
        super().__init__(f"{name} (pid {pid}) died ({self.status})")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.name, self.pid, self.exitcode)


class NotDelivered(RuntimeError):
    """A message could not be sent: the helper process is gone (or going). It never received it."""


class UnreadableAnswer(RuntimeError):
    """A helper's reply that does not load here (its class does not import in the owner's process); `reason`
    says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"could not load the answer: {reason}")
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.reason,)


# ---- the wire ------------------------------------------------------------------------------------------------


def _encode(
    kind: int,
    ident: int,
    payload: Any,
    slab: mmap.mmap | None = None,
    area: tuple[int, int | None] | None = None,
    reserve: Reserve | None = None,
    in_band_below: int = 0,
    placed: tuple[int, int] | None = None,
) -> memoryview:
    """One message: its header, then `payload` pickled, its large buffers into `area` of `slab` where given and
    they fit (else everything in band), those already in `placed` of the slab named where they lie. Raises what
    pickling the payload raises."""
    written = None
    if slab is not None and area is not None:
        with contextlib.suppress(Exception):  # e.g. a non-contiguous buffer: the payload goes in band
            written = write_out_of_band(payload, slab, area[0], area[1], reserve, in_band_below, placed)
    buffer = io.BytesIO()
    if written is not None:
        buffer.write(_HEADER.pack(kind | _IN_SLAB, ident))
        pickle.dump(written, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        buffer.write(_HEADER.pack(kind, ident))
        pickle.dump(payload, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return buffer.getbuffer()  # no copy: the pipe writes it as it is


def _decode(data: bytes, slab: mmap.mmap | None, copy: bool, lease: Lease | None = None) -> Any:
    """The payload of one message; with `copy` False, its buffers in the slab are views of it (held views
    through `lease`, which answers the callback to run once they are all gone)."""
    kind = data[0]
    body = memoryview(data)[_HEADER.size :]
    if kind & _IN_SLAB:
        if slab is None:
            raise ValueError("a message whose buffers are in a slab, from a process without one")
        header, spans = pickle.loads(body)
        freed = None if lease is None else lease(spans)
        return read_out_of_band(header, spans, slab, copy, freed)
    return pickle.loads(body)


# ---- the helper's side ---------------------------------------------------------------------------------------


class Link:
    """What a helper's target receives first: its pipe end and its slab's file (None without one). It crosses
    to the helper when it starts, descriptors by number (`uform.runtime.child`) or duplicated
    (`multiprocessing`); the helper makes its `Endpoint` of it."""

    def __init__(self, conn: Connection, slab_file: SlabFile | None, slab_bytes: int) -> None:
        self.conn = conn
        self.slab_file = slab_file
        self.slab_bytes = slab_bytes

    def open(self) -> Endpoint:
        """The helper's end: its slab mapped (None where that fails: everything then crosses the pipe)."""
        slab = None
        if self.slab_file is not None:
            try:
                slab = self.slab_file.map(self.slab_bytes)
            except (OSError, ValueError):
                self.slab_file.close()
                self.slab_file = None
        return Endpoint(self.conn, slab, None if self.slab_file is None else self.slab_file.fd)


@dataclass
class Frame:
    """One message from the owner: a call (answer it with `Endpoint.reply` or `Endpoint.fail`) or a note."""

    kind: str  # "call" or "note"
    ident: int
    data: bytes
    slab: mmap.mmap | None

    def load(self) -> Any:
        """Its payload (buffers the owner put in the slab are views of it). Raises what unpickling raises."""
        return _decode(self.data, self.slab, copy=False)


class Endpoint:
    """A helper process's end of its pipe (and slab); every method may be called from any thread."""

    def __init__(self, conn: Connection, slab: mmap.mmap | None, slab_fd: int | None) -> None:
        self.conn = conn
        self.slab = slab
        self.slab_fd = slab_fd  # kept open: it reserves the pages the helper writes
        self._send_lock = threading.Lock()

    def ready(self) -> bool:
        """Tells the owner it started (and whether it mapped the slab); False when the owner is gone."""
        return self._send(_encode(_READY, 0, self.slab is not None))

    def receive(self) -> Frame | None:
        """The owner's next message; None once it asked this process to exit. Raises EOFError (or OSError)
        once the owner is gone."""
        data = self.conn.recv_bytes()
        kind, ident = _HEADER.unpack_from(data)
        if kind == _EXIT:
            return None
        return Frame("note" if (kind & ~_IN_SLAB) == _NOTE else "call", ident, data, self.slab)

    def reply(
        self,
        ident: int,
        value: Any,
        area: tuple[int, int | None] | None = None,
        reserve: Reserve | None = None,
        in_band_below: int = 0,
        placed: tuple[int, int] | None = None,
    ) -> bool:
        """Answers call `ident` with `value` (its large buffers into `area` of the slab where they fit, those the
        helper built in `placed` of the slab named where they lie); False when the owner is gone. Raises what
        pickling `value` raises (nothing was sent)."""
        return self._send(_encode(_OK, ident, value, self.slab, area, reserve, in_band_below, placed))

    def fail(self, ident: int, error: BaseException) -> bool:
        """Answers call `ident` with `error` (its type and traceback cross); False when the owner is gone."""
        return self._send(_HEADER.pack(_ERROR, ident) + pack_error(error))

    def note(self, payload: Any) -> bool:
        """Sends the owner a note (its ``on_note`` callback gets `payload`); False when the owner is gone."""
        return self._send(_encode(_NOTE, 0, payload))

    def close(self) -> None:
        """Unmaps the slab (a view still alive keeps it) and closes its file."""
        release_slab(self.slab)
        if self.slab_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.slab_fd)
            self.slab_fd = None

    def _send(self, message: bytes | memoryview) -> bool:
        try:
            with self._send_lock:
                self.conn.send_bytes(message)
        except (OSError, ValueError):
            return False
        return True


# ---- the owner's side ----------------------------------------------------------------------------------------


class Helper:
    """One helper process, seen from its owner (see the module's docstring).

    ``target(link, *args)`` runs in the process; it must be importable by name from a module of ours.
    ``context`` is a start method of `uform.runtime.child.context`. ``slab_bytes`` > 0 gives it a slab of that
    many bytes (sparse: pages are touched as they are written; none where /dev/shm is missing). ``views``: the
    replies' buffers in the slab stay views of it (the owner copies them out, then reuses the area) rather than
    copies. ``lease``: the replies' buffers in the slab stay views of it, held: ``lease(spans)`` runs on the
    reader thread before the reply resolves, and the callback it answers runs once the last view of that reply's
    buffers is gone (the owner then reuses those bytes; until then it gives the helper other ones). ``on_note(payload)`` runs on the reader thread for each note of the helper. ``lost(died)`` makes the
    exception that calls still pending fail with when the process ends (default: the `ProcessDied` itself).
    ``on_exit(helper)`` runs on the reader thread once the process ended and every call was failed. The
    callbacks must not hold the owner strongly where the owner relies on being collected. ``readers``: the
    helper's messages are read by that shared thread (`Readers`, a pool's) rather than a thread of its own."""

    def __init__(
        self,
        target: Callable[..., Any],
        args: Sequence[Any] = (),
        *,
        name: str,
        context: str = START_METHOD,
        slab_bytes: int = 0,
        slab_prefix: str = "uform-slab-",
        views: bool = False,
        lease: Lease | None = None,
        daemon: bool = True,
        on_note: Callable[[Any], None] | None = None,
        lost: Callable[[ProcessDied], BaseException] | None = None,
        on_exit: Callable[[Helper], None] | None = None,
        readers: Readers | None = None,
    ) -> None:
        self.name = name
        self._readers = readers
        self._target = target
        self._args = tuple(args)
        self._ctx: Any = context_of(context)  # ValueError for an unknown start method
        self._slab_bytes = slab_bytes
        self._slab_prefix = slab_prefix
        self._views = views or lease is not None
        self._lease = lease
        self._daemon = daemon
        self._on_note = on_note
        self._lost = lost
        self._on_exit = on_exit
        self.process: Any = None
        self.slab: mmap.mmap | None = None
        """The owner's mapping of the slab (None without one, or once the helper could not map it)."""
        self.slab_fd: int | None = None
        """The slab file's descriptor here (to reserve pages of the areas the owner writes)."""
        self.ready: Future = Future()
        """Resolves (to None) once the helper said it started; fails with `ProcessDied` if it ended first."""
        self.ended: Future = Future()
        """Resolves to the `ProcessDied` of the process once it ended and was reaped (after its calls failed)."""
        self.died: ProcessDied | None = None
        """Why it ended, once it did (set before its pending calls fail)."""
        self.reader: threading.Thread | None = None
        self._close_fd: Any = None  # closes the slab's descriptor once, at `release` or when collected
        self._conn: Connection | None = None
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()  # the pending table
        self._send_lock = threading.Lock()  # whole messages, one at a time
        self._ids = 0

    # -- life ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the process and its reader thread (it says it is ready later: `ready`). Raises what starting
        raises, leaving nothing behind."""
        if self._slab_bytes > 0:
            self.slab, self.slab_fd = create_slab(self._slab_bytes, self._slab_prefix)
            if self.slab_fd is not None:  # a step may still reserve through it after the process died
                self._close_fd = weakref.finalize(self, _close_quietly, self.slab_fd)
        ours, theirs = self._ctx.Pipe(duplex=True)
        link = Link(theirs, None if self.slab_fd is None else SlabFile(self.slab_fd), self._slab_bytes)
        process = self._ctx.Process(target=self._target, args=(link, *self._args), name=self.name, daemon=self._daemon)
        try:
            process.start()  # the pipe end and the slab's descriptor travel to it here
        except BaseException:
            ours.close()
            self.release()
            raise
        finally:
            theirs.close()  # we keep only our end, so its death reads as end of file
        self.process, self._conn = process, ours
        # The reader holds this helper, never its owner (the callbacks are the owner's to keep weak).
        if self._readers is not None:
            self.reader = self._readers.add(self, ours)
        else:
            self.reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
            self.reader.start()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def pending(self) -> int:
        """Calls sent and not answered yet."""
        with self._lock:
            return len(self._pending)

    def submit(
        self,
        payload: Any,
        *,
        area: tuple[int, int | None] | None = None,
        reserve: Reserve | None = None,
        in_band_below: int = 0,
        ident: int | None = None,
    ) -> Future:
        """Sends a call; answers the future of the helper's reply (its value, or the exception raised for it
        there). `area` (start, end) of the slab takes the payload's large buffers where they fit; `ident` names
        the call (the helper sees it; unique among this helper's pending calls), else the next number. Raises
        what pickling the payload raises, or `NotDelivered` when the helper is gone (either way nothing was
        sent)."""
        with self._lock:
            if ident is None:
                ident = self._ids
                self._ids += 1
        message = _encode(_CALL, ident, payload, self.slab, area, reserve, in_band_below)
        future: Future = Future()
        with self._lock:
            if self.died is not None:
                raise NotDelivered(f"{self.died}")
            self._pending[ident] = future
        if not self._send(message):
            with self._lock:
                self._pending.pop(ident, None)
            raise NotDelivered(f"{self.name} (pid {self.pid}) is gone: its pipe is closed")
        return future

    def notify(self, payload: Any) -> bool:
        """Sends the helper a note (a `Frame` of kind "note"); False when it is gone."""
        return self._send(_encode(_NOTE, 0, payload))

    def kill(self) -> None:
        """SIGKILL (its reader then reaps it and fails what it held)."""
        if self.process is not None:
            with contextlib.suppress(OSError, ValueError):
                self.process.kill()

    def close(self, grace: float = CLOSE_SECONDS) -> None:
        """`close_all` of this helper alone."""
        close_all([self], grace)

    def ask_exit(self) -> None:
        """Asks the helper to exit once it has answered what it holds (it reads None from `receive`)."""
        self._send(_HEADER.pack(_EXIT, 0))

    def __repr__(self) -> str:
        return f"<Helper {self.name} pid={self.pid}{' dead' if self.died else ''}>"

    # -- the reader ------------------------------------------------------------------------------------------

    def _send(self, message: bytes | memoryview) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send_bytes(message)
        except (OSError, ValueError):
            return False
        return True

    def _read(self) -> None:
        while self._receive():
            pass
        self._reap()

    def _receive(self) -> bool:
        """Reads and handles one message of the helper; False once its pipe ended (or carried garbage)."""
        conn = self._conn
        assert conn is not None
        try:
            data = conn.recv_bytes()
            kind, ident = _HEADER.unpack_from(data)
        except (EOFError, OSError):
            return False
        except struct.error:  # not a message of ours: the process is broken
            self.kill()
            return False
        base = kind & ~_IN_SLAB
        if base == _READY:
            if not pickle.loads(memoryview(data)[_HEADER.size :]):  # it could not map the slab
                self.release()
            if not self.ready.done():
                self.ready.set_result(None)
            return True
        if base == _NOTE:
            if self._on_note is not None:
                try:
                    self._on_note(_decode(data, self.slab, copy=True))
                except Exception:  # the owner's bug; the reader must go on reading
                    traceback.print_exc()
            return True
        with self._lock:
            future = self._pending.pop(ident, None)
        if future is None:
            return True
        try:
            if base == _ERROR:
                error = unpack_error(memoryview(data)[_HEADER.size :], f"{self.name} (pid {self.pid})")
            else:
                value = _decode(data, self.slab, copy=not self._views, lease=self._lease)
        except Exception as exc:  # a class that does not load here; the helper itself is fine
            future.set_exception(UnreadableAnswer(describe(exc)))
            return True
        del data
        if base == _ERROR:
            future.set_exception(error)
        else:
            future.set_result(value)
        return True

    def _reap(self) -> None:
        """The process ended (or broke its pipe): reap it, then fail what it held."""
        process = self.process
        with contextlib.suppress(OSError, ValueError, AssertionError):
            process.join(REAP_SECONDS)
            if process.is_alive():  # a broken pipe but a live process: make sure it is gone
                process.kill()
                process.join(REAP_SECONDS)
        died = ProcessDied(self.name, process.pid, process.exitcode)
        with self._lock:
            self.died = died
            pending, self._pending = list(self._pending.values()), {}
        with self._send_lock, contextlib.suppress(OSError):  # never while a message is being sent
            assert self._conn is not None
            self._conn.close()
        if not self._views or self._lease is not None:  # copied out, or held views that keep the mapping alive
            self.release()
        if not self.ready.done():
            self.ready.set_exception(died)
        for future in pending:
            if not future.done():
                future.set_exception(died if self._lost is None else self._lost(died))
        if self._on_exit is not None:
            self._on_exit(self)
        self.ended.set_result(died)

    def release(self) -> None:
        """Unmaps the slab here (a reply still viewing it keeps the mapping until the last view goes) and closes
        its file. Idempotent; `close_all` does it, and the reader once the process ended unless ``views``."""
        release_slab(self.slab)
        self.slab = None
        self.slab_fd = None
        if self._close_fd is not None:
            self._close_fd()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def close_all(helpers: Iterable[Helper], grace: float = CLOSE_SECONDS) -> None:
    """Ends helpers: each is asked to exit, waited for until one deadline `grace` seconds away, then killed;
    their readers reap them, and their slabs are released. Idempotent."""
    helpers = [h for h in helpers if h.process is not None]
    for helper in helpers:
        helper.ask_exit()
    deadline = time.monotonic() + grace
    current = threading.current_thread()  # a reader closing its own helper cannot wait for itself
    for helper in helpers:
        if helper.reader is not current:
            with contextlib.suppress(FutureTimeout):
                helper.ended.result(max(0.0, deadline - time.monotonic()))
        if not helper.ended.done():
            helper.kill()
    for helper in helpers:
        if helper.reader is not current:
            with contextlib.suppress(FutureTimeout):
                helper.ended.result(2 * REAP_SECONDS)
            if helper._readers is None and helper.reader is not None:  # its own: it ends right after `ended`
                helper.reader.join(REAP_SECONDS)
        helper.release()


class Readers:
    """One reader thread for several helpers (a pool's): it waits on all their pipes at once
    (`multiprocessing.connection.wait`) and handles each message as a helper's own reader would, so the
    helpers' answers never contend with one another for the interpreter lock. The thread starts with the first
    helper and ends with the last (a later one starts it anew)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._helpers: dict[Any, Helper] = {}
        self._thread: threading.Thread | None = None
        self._wake_read, self._wake_write = os.pipe()  # a new helper interrupts the wait
        os.set_blocking(self._wake_read, False)
        weakref.finalize(self, _close_quietly, self._wake_read)
        weakref.finalize(self, _close_quietly, self._wake_write)

    def add(self, helper: Helper, conn: Connection) -> threading.Thread:
        """Reads `helper`'s pipe `conn` from now on; answers the thread that does."""
        with self._lock:
            self._helpers[conn] = helper
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            thread = self._thread
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"\0")
        return thread

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._helpers:
                    self._thread = None
                    return
                conns = list(self._helpers)
            ready = multiprocessing.connection.wait([*conns, self._wake_read])
            for conn in ready:
                if conn == self._wake_read:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_read, 4096)
                    continue
                helper = self._helpers[conn]
                if not helper._receive():
                    with self._lock:
                        del self._helpers[conn]
                    helper._reap()
