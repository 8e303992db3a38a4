"""The host stage of a serving model's calls in processes of their own: the call's media decoded, its items sorted
and packed into batches (`uform.data.windows.call_batches`) there, so that the serving process keeps only the
device's work and one copy of each finished batch.

Why. In process, a 4,096-JPEG `encode` on the H200 ran its packing thread, the decode pool's reader and the
launching thread under one interpreter lock, and the launching thread waited for batches 40% of its samples
(py-spy; BENCHMARKS.md, "Issue 12, seventeenth day", with what moving the stage out measured). It is the training
side's answer again (`uform.runtime.preparers`, PyTorch DataLoader's worker processes), shaped for a call: each
process takes a contiguous share of the call's items and streams its batches back as it packs them.

Each process is a `uform.runtime.helper.Helper` (a `uform.runtime.child.Child` on this module: the caller's script
needs no main guard, and the process never imports torch), started by the first call that needs it. It owns a
`DecodePool` of its own (its share of the model's ``media.workers``, from a fork server that preloads the decoding
libraries, as a preparer process's) and a slab: one input area and `SLOTS` output areas. A share is three kinds of
request, answered in the order sent:

- ``open``: the share's contents, copied once, back to back, into the input area (what does not fit crosses the
  pipe), with their modalities, sides and spans and the model's `Packing`. A share whose contents outgrow the area
  goes in parts, each packed as a call of its own.
- ``next`` into an output area: the share's next message, ("batch", `Packed`) with the batch's media arrays built
  in that area in the first place (`uform.runtime.slots.Built`), ("skipped", [(item, reason)]) for a window's
  media that did not decode, or ("done",). The owner keeps one request in flight per area, and asks for the
  next batch into an area only once the caller released the batch before it there (its `Lease`): the serving
  model reads a batch where it lies, its copies to the GPU made straight from the area, and releases it once
  they are done.
- ``close``: the share ends (its decoding thread joins). Being answered after every request before it, it also
  says that no area is still being written.

An item's answer never depends on its neighbours, so shares and parts change only how full their last batches are.
A share's skipped items are handed on only once every share before it is done, so the first a caller sees is the
call's first broken item, as in process. Failures: a `MediaError` (a strict `MediaPolicy`) crosses with its item,
which the owner shifts to the caller's index; any other exception of the host stage crosses as itself
(`uform.runtime.remote_error`); a process that died (killed, out of memory) fails the call with `ServeHostError`,
and the next call starts a new one. A process ignores SIGINT (the serving process handles Ctrl-C) and exits,
killing its decoders, once its pipe to the owner reports end of file.

This module imports the light uform modules only (numpy among them; torch is the caller's), so the processes start
without torch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import FIRST_COMPLETED
from typing import Any

from ..data.windows import CallItems, Packed, Packing, call_batches, pack_batch
from ..enums import LateInteractionSide, Modality
from ..media.decode import MediaPolicy, decode_items
from ..media.limits import MediaError
from ..media.units import Units
from .decoders import DecodePool, decode_parallelism
from .heap import keep_heap
from .helper import BOOT_SECONDS, Endpoint, Frame, Helper, Link, NotDelivered, ProcessDied, close_all
from .slots import (
    DECODER_CONTEXT,
    DECODER_PRELOAD,
    Built,
    contents_views,
    enum_codes,
    enum_members,
    write_contents,
)

__all__ = ["SLOTS", "Lease", "ServeHost", "ServeHostError"]

SLOTS = 4
"""Batches in flight between the process and the serving model (the in-process path's hand-off depth)."""

_STOP_POLL_SECONDS = 0.05
"""How often a call waiting for its areas' leases looks whether it was stopped (the owner dropped its batches)."""

_INPUT_BYTES = 1 << 30
"""The input area (virtual: pages are reserved as calls reach them); a call's contents beyond it go in parts."""
_SLOT_BYTES = 256 << 20
"""Each output area, likewise (a batch at the reference capacity is ~50 MB, its image units); every area starts
at a multiple of `uform.runtime.slab.SLAB_ALIGN`."""


class ServeHostError(RuntimeError):
    """The serving host process died (killed, out of memory) during a call; the call was not answered."""


class _Stopped(Exception):
    """The call was stopped while it waited for an area's lease (`_Process.next`): `ServeHost.batches` returns."""


Waiter = Callable[[], None]
"""Returns once nothing reads a released area any more (the owner's copies out of it done)."""


class Lease:
    """One batch's output area, held by the owner (`ServeHost.batches`): the process writes that
    area's next batch only once `release` was called. `slab` is the mapped slab, and [`start`, `end`) the area's
    bytes of it; the batch's arrays are views of them until the release."""

    def __init__(self, slab: Any, start: int, end: int) -> None:
        self.slab, self.start, self.end = slab, start, end
        self.released: concurrent.futures.Future = concurrent.futures.Future()

    def release(self, waiter: Waiter | None = None) -> None:
        """The owner is done with the area, or will be once `waiter` returns (called before the area is written
        again, on the thread that asks for it). Idempotent: the first release counts."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.released.set_result(waiter)


# ---- the owner's side ------------------------------------------------------------------------------------------


class ServeHost:
    """A serving model's host processes (see the module's docstring): `count` of them, each with its share of the
    decoders (``policy.workers``, or one per CPU, split evenly). `batches` runs one call; one call at a time (the
    model's lock serialises its callers). A process starts with the first call that needs it; `close` ends them
    (also at interpreter exit and when the object is collected)."""

    def __init__(self, policy: MediaPolicy, count: int, unmapping: Callable[[Any], None] | None = None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"host_processes: expected an int >= 1, got {count!r}")
        self.policy = policy
        self.count = count
        self.unmapping = unmapping
        """Called with a process's slab before this side unmaps it (the owner's hold on its pages undone)."""
        self.decoders = max(1, (policy.workers or decode_parallelism()) // count)
        """Decoding processes of each host process."""
        self.input_bytes = _INPUT_BYTES
        self.slot_bytes = _SLOT_BYTES
        self._held: list[_Process] = []  # the live processes, in a list the finalizer shares (not `self`)
        self._owner = os.getpid()
        self._finalizer = multiprocessing.util.Finalize(
            self, _shutdown, args=(self._held, self._owner), exitpriority=10
        )

    @property
    def processes(self) -> list[Any]:
        """The processes running now (none before the first call, nor once one died or they were closed)."""
        return [p.helper.process for p in self._held if p.helper.died is None]

    def close(self) -> None:
        """Ends the processes (each ends its decoders). Idempotent; the next call starts new ones."""
        self._unmapping(self._held)
        _shutdown(self._held, self._owner)

    def _unmapping(self, processes: list[_Process]) -> None:
        if self.unmapping is not None and os.getpid() == self._owner:
            for process in processes:
                if process.helper.slab is not None:
                    self.unmapping(process.helper.slab)

    def batches(
        self, shape: Packing, items: CallItems, stop: threading.Event
    ) -> Generator[tuple[str, Any], None, None]:
        """The call's messages, as `call_batches` answers them in process: ("skipped", [(item, reason)]) and
        ("batch", (`Packed`, `Lease`)), items by the caller's index, in the order the processes answer them. A
        batch's arrays are views of an output area and stay valid until its lease is released (the area's next
        batch waits for that; a lease never released holds its area, and a later call waits on it). The call's
        items are dealt to the processes in contiguous shares (a process only where its share fills a window: a
        short call goes to one). `stop` ends the call, also while it waits for a lease. Raises `ServeHostError`
        when a process died, and what the host stage raised."""
        if os.getpid() != self._owner:
            raise RuntimeError("uform: a serving model's host processes cannot be used in a forked child")
        n = len(items.modalities)
        count = max(1, min(self.count, n // max(1, shape.window)))
        processes = self._started(count)
        shares = [(n * k // count, n * (k + 1) // count) for k in range(count)]
        streams = [
            _Stream(self, process, shape, items, _parts(items.contents, a, b, self.input_bytes), stop)
            for process, (a, b) in zip(processes, shares, strict=True)
        ]
        try:
            for stream in streams:
                stream.advance()
            live = [s for s in streams if s.in_flight or s.leased]
            while live:
                waits = [s.in_flight[0][1] for s in live if s.in_flight]
                waits += [s.leased[0][1].released for s in live if s.leased]  # released in the order leased
                # A lease is released by the owner's device thread; a call it stopped never releases the batches it
                # dropped, so the wait looks at `stop` too.
                concurrent.futures.wait(waits, timeout=_STOP_POLL_SECONDS, return_when=FIRST_COMPLETED)
                if stop.is_set():
                    return
                for s in live:
                    s.reclaim()  # areas whose leases were released take their next batches
                ready = next((s for s in live if s.in_flight and s.in_flight[0][1].done()), None)
                if ready is None:
                    live = [s for s in streams if s.in_flight or s.leased]
                    continue
                stream = ready
                try:
                    message = stream.take()
                except MediaError as failure:  # a strict policy's: raised once every share before it is done
                    stream.fail(failure)
                    message = None
                if message is not None and message[0] == "batch":
                    yield "batch", (message[1], stream.lease())
                    if stop.is_set():
                        return
                elif message is not None:
                    stream.skipped.append(message)
                held, error = _in_order(streams)
                for skipped in held:
                    yield skipped
                    if stop.is_set():
                        return
                if error is not None:
                    raise error
                live = [s for s in streams if s.in_flight or s.leased]
        except _Stopped:  # stopped while an area waited for its lease
            return
        finally:
            for stream in streams:
                stream.end()

    def _started(self, count: int) -> list[_Process]:
        """The first `count` processes, live: those that died replaced, those missing started (side by side)."""
        for k, process in enumerate(self._held):
            if process.helper.died is not None:
                self._unmapping([process])
                close_all([process.helper], 0)
                self._held[k] = self._start()
        while len(self._held) < count:
            self._held.append(self._start())
        try:
            for process in self._held[:count]:
                process.wait_ready()
        except BaseException:
            self.close()
            raise
        return self._held[:count]

    def _start(self) -> _Process:
        helper = Helper(
            _serve_host_main,
            (self.input_bytes, self.slot_bytes, self.policy, self.decoders),
            name="uform-serve-host",
            slab_bytes=self.input_bytes + SLOTS * self.slot_bytes,
            slab_prefix="uform-serve-",
            views=True,  # a batch's lease is released before its area is asked again
            daemon=False,  # under multiprocessing: it starts the decoder processes, which a daemonic process may not
        )
        helper.start()
        return _Process(helper)


class _Process:
    """The owner's view of one host process: its helper, the bytes of its input area backed so far, and the
    leases of its output areas not yet asked for again (kept across calls: a later call waits on them)."""

    def __init__(self, helper: Helper) -> None:
        self.helper = helper
        self.reserved = [0]
        self.ready = False
        self.leases: dict[int, Lease] = {}

    def next(self, slot: int, stop: threading.Event) -> concurrent.futures.Future:
        """Asks for the next message into area `slot`, once the owner's lease on it (if any) is released and its
        waiter has returned: as long as the owner's forward takes, which no timeout bounds. Raises `_Stopped`
        where the call is stopped meanwhile (the lease stays, for the calls' end to release)."""
        lease = self.leases.pop(slot, None)
        if lease is not None:
            while True:
                try:
                    waiter = lease.released.result(_STOP_POLL_SECONDS)
                    break
                except concurrent.futures.TimeoutError:
                    if stop.is_set():
                        self.leases[slot] = lease
                        raise _Stopped from None
            if waiter is not None:
                waiter()
        return self.ask(("next", slot))

    def wait_ready(self) -> None:
        if self.ready:
            return
        try:
            self.helper.ready.result(BOOT_SECONDS)
        except BaseException as error:
            if isinstance(error, concurrent.futures.TimeoutError):
                status = "it did not answer"
            elif isinstance(error, ProcessDied):
                status = f"it exited ({error.status})"
            else:
                raise
            raise ServeHostError(
                f"uform: a serving host process failed to start: {status} (its error is on standard error)"
            ) from None
        self.ready = True

    def ask(self, request: tuple) -> concurrent.futures.Future:
        try:
            return self.helper.submit(request)
        except NotDelivered as gone:
            raise ServeHostError(
                f"uform: the serving host process (pid {self.helper.pid}) is gone; the call was not answered, and "
                "the next call starts a new process"
            ) from gone

    def open(self, shape: Packing, items: CallItems, room: int) -> concurrent.futures.Future:
        """Writes a part's contents into the input area (or in band, where it has no room) and opens the call."""
        contents = items.contents
        offsets, inline = write_contents(self.helper.slab, self.helper.slab_fd, self.reserved, 0, 0, room, contents)
        record = (
            shape,
            items.verb,
            enum_codes(items.modalities),
            offsets if inline is None else None,
            inline,
            None if items.sides is None else enum_codes(items.sides),
            items.span,
        )
        return self.ask(("open", record))


class _Stream:
    """One process's share of a call: its parts, opened one after another, `SLOTS` requests in flight."""

    def __init__(
        self, host: ServeHost, process: _Process, shape: Packing, items: CallItems, parts: list, stop: threading.Event
    ) -> None:
        self.host, self.process, self.shape, self.items, self.stop = host, process, shape, items, stop
        self.parts = collections.deque(parts)
        self.in_flight: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self.first = 0  # the open part's first item
        self.opened = False
        self.slot = -1  # the area of the batch last taken
        self.skipped: list[tuple[str, Any]] = []  # its ("skipped", ...) messages not yet handed on (`_in_order`)
        self.error: MediaError | None = None  # what its part raised, not yet raised (`_in_order`)
        self.leased: collections.deque[tuple[int, Lease]] = collections.deque()  # batches the owner still reads

    @property
    def finished(self) -> bool:
        return not self.in_flight and not self.leased and not self.parts

    def advance(self) -> None:
        """Opens the next part that has items and asks for its first batches (nothing once the parts are done)."""
        while self.parts and not self.in_flight:
            first, last = self.parts.popleft()
            items = self.items
            part = CallItems(
                verb=items.verb,
                modalities=items.modalities[first:last],
                contents=items.contents[first:last],
                sides=None if items.sides is None else items.sides[first:last],
                span=None if items.span is None else items.span[first:last],
            )
            self.first, self.opened = first, True
            _answer(self.process.open(self.shape, part, self.host.input_bytes), first)
            self.in_flight.extend((slot, self.process.next(slot, self.stop)) for slot in range(SLOTS))

    def take(self) -> tuple[str, Any] | None:
        """The answer at the head (done: None); once the part is done, the next part is opened."""
        slot, future = self.in_flight.popleft()
        message = _answer(future, self.first)
        if message[0] == "done":  # every request after it answers "done" too
            if not self.in_flight:
                self.end()
                self.advance()
            return None
        self.slot = slot
        return _shifted(message, self.first)

    def fail(self, error: MediaError) -> None:
        """Its part raised `error`: the share takes no more requests (those in flight answer "done")."""
        self.error = error
        self.parts.clear()
        self.end()

    def lease(self) -> Lease:
        """The batch just taken's area, held until the owner releases it (`reclaim` then asks for its next)."""
        slot = self.slot
        lease = Lease(self.process.helper.slab, *_area(self.host.input_bytes, self.host.slot_bytes, slot))
        self.process.leases[slot] = lease
        self.leased.append((slot, lease))
        return lease

    def reclaim(self) -> None:
        """Asks for the next batch into each area whose lease was released (in the order they were leased)."""
        while self.leased and self.leased[0][1].released.done():
            slot, _ = self.leased.popleft()
            if self.opened:
                self.in_flight.append((slot, self.process.next(slot, self.stop)))

    def end(self) -> None:
        """Closes the open part: answered after every request before it, so no area is being written after.
        Leases still held stay with the process: the next request into their areas waits for them."""
        self.leased.clear()
        if self.opened:
            self.opened = False
            self.in_flight.clear()
            with contextlib.suppress(Exception):
                self.process.ask(("close",)).result()


def _area(input_bytes: int, slot_bytes: int, slot: int) -> tuple[int, int]:
    """Output area `slot`'s bytes [start, end) of a slab: after the input area, `slot_bytes` each (both sides)."""
    start = input_bytes + slot * slot_bytes
    return start, start + slot_bytes


def _in_order(streams: list[_Stream]) -> tuple[list[tuple[str, Any]], MediaError | None]:
    """The skipped items' messages that may be handed on, and the `MediaError` to raise, if any: a share's only once
    every share before it is done, so the first a caller sees names the call's first broken item, as in process
    (`errors="raise"` raises at it, and so does a strict policy)."""
    out = []
    for stream in streams:
        out.extend(stream.skipped)
        stream.skipped.clear()
        if stream.error is not None:
            return out, stream.error
        if not stream.finished:
            break
    return out, None


def _answer(future: concurrent.futures.Future, first: int) -> Any:
    """A request's answer; a `MediaError` naming the caller's item, `ServeHostError` where the process died."""
    try:
        return future.result()
    except ProcessDied as died:
        raise ServeHostError(
            f"uform: the serving host process (pid {died.pid}) died ({died.status}) during the call; the call was "
            "not answered, and the next call starts a new process"
        ) from None
    except MediaError as error:
        if error.item is None:
            raise
        raise MediaError(error.reason, item=error.item + first) from None


def _shifted(message: tuple[str, Any], first: int) -> tuple[str, Any]:
    """A part's message with its items by the caller's index."""
    if not first:
        return message
    if message[0] == "skipped":
        return ("skipped", [(item + first, reason) for item, reason in message[1]])
    packed: Packed = message[1]
    return ("batch", dataclasses.replace(packed, members=packed.members + first))


def _parts(contents: Sequence[bytes | memoryview], first: int, last: int, room: int) -> list[tuple[int, int]]:
    """Items `first` to `last` cut, in order, into parts whose contents fit `room` bytes (an item larger than that
    alone: it crosses the pipe)."""
    parts, size = [], 0
    for i in range(first, last):
        length = len(contents[i])
        if i > first and size + length > room:
            parts.append((first, i))
            first, size = i, 0
        size += length
    if first < last:
        parts.append((first, last))
    return parts


def _shutdown(held: list[_Process], owner: int) -> None:
    if os.getpid() != owner:  # a forked child does not own them
        return
    close_all([p.helper for p in held])
    held.clear()


# ---- the process ---------------------------------------------------------------------------------------------


def _serve_host_main(link: Link, input_bytes: int, slot_bytes: int, policy: MediaPolicy, decoders: int) -> None:
    """The process's whole life: map the slab, say ready, then answer each request in the order sent until the
    owner asks it to exit or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the serving process's to handle
    keep_heap()  # a batch's arrays are the same sizes batch after batch: from the heap, not fresh pages
    if DECODER_CONTEXT == "forkserver":  # the decoders' fork server imports nothing of the caller's script
        multiprocessing.get_context("forkserver").set_forkserver_preload(DECODER_PRELOAD)
    endpoint = link.open()
    host = _Host(endpoint, input_bytes, slot_bytes, policy, decoders)
    if not endpoint.ready():
        return
    while True:
        try:
            frame = endpoint.receive()
        except (EOFError, OSError):  # the owner is gone: nothing is waiting for any answer
            host.abandon()
            os._exit(0)
        if frame is None:
            break
        host.answer(frame)
    host.close()


class _Host:
    """The process's state: its decoders, and the open call's messages."""

    def __init__(
        self, endpoint: Endpoint, input_bytes: int, slot_bytes: int, policy: MediaPolicy, decoders: int
    ) -> None:
        self.endpoint = endpoint
        self.workers = decoders
        self.input_bytes = input_bytes
        self.slot_bytes = slot_bytes
        self.policy = policy
        self.reserved = [0] * SLOTS  # bytes of each output area backed so far
        self.pool: DecodePool | None = None
        self.call: Generator[tuple[str, Any], None, None] | None = None
        self.stop = threading.Event()
        self.alloc: Built | None = None  # where the batch being packed builds its media arrays

    def answer(self, frame: Frame) -> None:
        try:
            request = frame.load()
            if request[0] == "next":
                self._next(frame.ident, request[1])
                return
            self._end()
            if request[0] == "open":
                self._open(request[1])
            self.endpoint.reply(frame.ident, None)
        except BaseException as error:  # the owner raises it for the call
            with contextlib.suppress(BaseException):
                self._end()
            self.endpoint.fail(frame.ident, error)

    def _open(self, record: tuple) -> None:
        shape, verb, modalities, offsets, inline, sides, span = record
        items = CallItems(
            verb=verb,
            modalities=enum_members(modalities, Modality),
            contents=contents_views(self.endpoint.slab, 0, offsets, inline),
            sides=None if sides is None else enum_members(sides, LateInteractionSide),
            span=span,
        )

        def decode(window: range) -> tuple[dict[int, Units], list[tuple[int, str]], dict[int, Any]]:
            media = [i for i in window if items.modalities[i] != Modality.Text]
            if not media:
                return {}, [], {}
            max_units = shape.columns - shape.prefix
            batch = shape.config.batch
            units, failed = decode_items(  # unkeyed: serving draws no masks
                self.decoders(), self.policy, batch, items.modalities, items.contents, media, max_units, False
            )
            return units, sorted(failed), {}

        def pack(members: list[int], rows: int, units: dict[int, Units], _along: dict[int, Any]) -> Packed:
            assert self.alloc is not None
            return pack_batch(shape, items, members, rows, units, self.alloc)

        self.stop = threading.Event()
        self.call = call_batches(shape, items, decode, pack, self.stop)

    def _next(self, ident: int, slot: int) -> None:
        """The open call's next message, a batch's arrays built in output area `slot`."""
        start, end = _area(self.input_bytes, self.slot_bytes, slot)
        endpoint = self.endpoint
        built = self.alloc = Built(endpoint.slab, endpoint.slab_fd, self.reserved, slot, start, end)
        try:
            message = next(self.call) if self.call is not None else ("done",)
        except StopIteration:
            self.call = None
            message = ("done",)
        except BaseException as error:
            self.call = None
            endpoint.fail(ident, error)
            return
        finally:
            self.alloc = None
        if message[0] != "batch":
            endpoint.reply(ident, message)
            return
        built.reply(endpoint, ident, message)

    def _end(self) -> None:
        """Ends the open call, if any (its decoding thread joins)."""
        call, self.call = self.call, None
        if call is not None:
            self.stop.set()
            call.close()

    def decoders(self) -> DecodePool:
        if self.pool is None:
            self.pool = DecodePool(self.workers, self.policy.limits.timeout_seconds, DECODER_CONTEXT)
        return self.pool

    def abandon(self) -> None:
        """The owner died: kill the decoders now."""
        if self.pool is not None:
            self.pool.abandon()

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self._end()
        if self.pool is not None:
            self.pool.close()
        self.endpoint.close()
