"""The worker processes of an executor of several devices (one per device, each a rank of the run's world), and
how a step travels to them and back.

Shape legend: N items of a step, D the devices of the executor (its workers), H hidden.

This module is the runtime beneath the executor: it knows nothing of meshes or trainers. Each command names
its `Verb`, owned by the module that sends it (`uform.runtime.mesh` joins and leaves the world,
`uform.runtime.replicas` builds, steps and saves), so the layers only point down: replicas -> mesh -> executor ->
workers.

The calling process keeps no replica. A step's items are checked here, routed to the devices by bag (a bag
never splits; bags balance across devices by their size, greedily, largest first: Graham's LPT rule),
their bytes copied once into a shared-memory segment per device, and each worker steps its share as one
process of the world (`Trainer` with a mesh). The answers are merged: the losses are world means and
every worker reports the same; `truncated`, `dropped` and `skipped` add up over this process's devices;
the arena's rows come back in the caller's item order.

Each worker is a `uform.runtime.helper.Helper`: a command is one of its calls (the verb and its argument,
pickled once), its answer or error resolves the call's future here (an exception crosses as its own type, with
the worker's traceback as its cause), and a worker that dies fails every command it held with a `MeshError`
naming its exit status. Commands travel in order over one pipe per worker, so steps and saves apply in the
order they were called; a worker answers a step once it is done, which resolves that step's future here.

A step's contents on their way to a worker are copied once: `share_items` writes each device's items back to
back into a shared-memory segment of their own; the command carries only the segment's name and the items'
offsets (and the small per-item arrays), pickled once; the worker maps the segment and its trainer reads the
items as views of it (`attach_segment`), never copying them out. The segment is unlinked here once every
worker answered, and a worker closes its mapping once no view of it is left (views keep a mapping alive, so
none outlives it).

Progress (a save's or a resume's `progress` callback) is relayed over the same pipes, as the helpers' notes:
the worker's stand-in callback sends a report up and waits for the verdict; here the report is handed to the workers's progress thread,
which calls the caller's callback and sends the verdict back down. Neither end ever waits for the other on its
reading side: a worker reads its pipe on a thread of its own (commands queue for its main thread, verdicts go
straight to the waiting report), and the callback never runs on a reader thread here, so answers keep flowing
however long it takes. Which reports: a save relays the writer's (rank 0's; no other worker writes or reports,
as a process of rank > 0 on one device); a resume, where every worker reads the whole file and reports the same
points, relays each point once, when the first worker reaches it, and hands that one verdict to every worker
reaching it. So the callback sees exactly the reports of one device, and a stop stops every worker at the same
point with the same `Stopped` (nothing placed anywhere), while no worker waits for another (one failing, or
waiting in a collective, never holds up the rest). A callback that raises stops the workers there, and the
call raises the callback's own exception, as on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import queue
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

from .. import vocab
from ..config import TrainerStepStats
from ..data.items import ChoiceTapes
from ..enums import Modality
from ..notices import Notices
from ..replica.checkpoint import ProgressCallback
from .helper import Helper, Link, NotDelivered, ProcessDied, close_all
from .world import MeshError

WORKER_CLOSE_SECONDS = 30.0
"""How long `Workers.close` lets the workers close their trainers and leave their world before it kills them."""


def route(sizes: np.ndarray, bags: np.ndarray | None, devices: int) -> list[np.ndarray]:
    """Each device's items (ascending indices): every bag whole on one device, bags placed largest first
    on the device with the least size so far (ties: the lower device; equal bags: the earlier one)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    count = len(sizes)
    bags = np.arange(count) if bags is None else np.asarray(bags, dtype=np.int64)
    unique, first, inverse = np.unique(bags, return_index=True, return_inverse=True)
    totals = np.bincount(inverse, weights=sizes, minlength=len(unique))
    order = sorted(range(len(unique)), key=lambda b: (-totals[b], first[b]))
    load = np.zeros(devices, dtype=np.float64)
    device_of_bag = np.zeros(len(unique), dtype=np.int64)
    for b in order:
        d = int(np.argmin(load))
        device_of_bag[b] = d
        load[d] += totals[b]
    device_of_item = device_of_bag[inverse]
    return [np.flatnonzero(device_of_item == d) for d in range(devices)]


def item_sizes(modalities: Sequence[Modality], contents: Sequence[Any], columns: int) -> np.ndarray:
    """The positions each item is expected to take: its prefix and bytes for text (cut at a row), a row
    for a media item (decoded on its device, downscaled to fit a row)."""
    prefix = len(vocab.prefix(Modality.Text, None))
    return np.array(
        [
            min(prefix + len(c), columns) if m == Modality.Text else columns
            for m, c in zip(modalities, contents, strict=True)
        ],
        dtype=np.int64,
    )


# --------------------------------------------------------------------------------------------------
# The calling process's side


Verb = Callable[[dict[str, Any], torch.device, Any, ProgressCallback], Any]
"""What a worker runs for a command: verb(state, device, argument, progress) on the worker's main thread, with the
worker's state ("trainer", "mesh": each closed when the worker exits; "retired": segments of steps done). It
answers the command's value, or a `Future` of it. It crosses the pipe by reference, so it is a module-level
function of uform's (the worker imports its module)."""

_GO, _STOP, _RAISED = "go", "stop", "raised"
"""A report's verdict: go on, stop (the callback answered False), or stop for an exception of the callback."""


class ProgressRelay:
    """The calling process's end of one call's progress relay (see the module's docstring).

    Reports are paired by their order: every worker reporting reads or writes the same tensors with the same
    `progress_steps`, so the k-th reports of every worker are the same (done, total). The first worker to make
    its k-th report has the callback decide point k; workers reporting it while that runs wait for the same
    verdict, and those reporting it later get it at once. A worker therefore only ever waits for the callback,
    never for another worker, and the callback runs once per point, in order, on the workers's progress thread.
    """

    def __init__(
        self,
        callback: ProgressCallback,
        reply: Callable[[int, int, str], None],
        runner: Callable[[Callable[[], None]], None],
    ) -> None:
        self.callback = callback
        self._reply = reply  # (device index, ident, verdict): sends the verdict down that worker's pipe
        self._runner = runner  # runs a decision on the progress thread
        self._lock = threading.Lock()
        self._reports: dict[int, int] = {}  # reports each device has made so far
        self._verdicts: list[str] = []  # the verdict of every point decided so far
        self._waiting: list[tuple[int, int]] = []  # (device, ident) of the workers waiting at the next point
        self.failure: BaseException | None = None
        """What the callback raised, if it did: the call raises it (the workers only stopped for it)."""

    def report(self, index: int, ident: int, done: int, total: int) -> None:
        """Device `index` reported (done, total) for its command `ident` and waits (a reader thread calls this)."""
        with self._lock:
            point = self._reports.get(index, 0)
            self._reports[index] = point + 1
            verdict = self._verdicts[point] if point < len(self._verdicts) else None
            first = False
            if verdict is None:  # the next point to decide (a worker reports k + 1 only after k was decided)
                self._waiting.append((index, ident))
                first = len(self._waiting) == 1
        if verdict is not None:
            self._reply(index, ident, verdict)
        elif first:
            self._runner(lambda: self._decide(done, total))

    def _decide(self, done: int, total: int) -> None:
        try:
            verdict = _STOP if self.callback(done, total) is False else _GO  # exactly False stops, as on one device
        except BaseException as error:  # KeyboardInterrupt too: it is re-raised in the calling thread
            self.failure = error
            verdict = _RAISED
        with self._lock:
            self._verdicts.append(verdict)
            waiting, self._waiting = self._waiting, []
        for index, ident in waiting:
            self._reply(index, ident, verdict)


def first_failure(futures: Sequence[Future], relay: ProgressRelay | None = None) -> BaseException | None:
    """What a call over the workers raises once every worker answered, None if none failed: the progress
    callback's own exception where it raised (the workers only stopped for it), else a device's own error
    ahead of its peers' MeshErrors (a stalled world follows from the error that stalled it)."""
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if not errors:
        return None
    if relay is not None and relay.failure is not None:
        return relay.failure
    causes = [e for e in errors if not isinstance(e, MeshError)]
    return (causes or errors)[0]


class Workers:
    """The worker processes of an executor, started on first use: one `uform.runtime.helper.Helper` per device,
    whose calls are commands (a `Verb` and its argument) and whose notes are progress reports."""

    def __init__(self, devices: Sequence[torch.device], threads: int = 0) -> None:
        self.devices = list(devices)
        self.threads = threads
        self._helpers: list[Helper] = []
        self._send = threading.Lock()  # one call's commands reach every worker before the next call's
        self._ids = itertools.count()
        self._relays: dict[int, ProgressRelay] = {}  # by the ident of each worker's command that relays
        self._progress: ThreadPoolExecutor | None = None  # where relayed callbacks run (its thread starts on need)
        self.started = False

    def start(self) -> None:
        if self.started:
            return
        self._progress = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uform-progress")
        for index, device in enumerate(self.devices):
            # A fresh interpreter on a module of uform's (not multiprocessing's spawn, which would run the
            # caller's main module again in each worker: a script without a main guard would start them anew).
            helper = Helper(
                run_worker,
                (str(device), self.threads),
                name=f"uform-device-{index}",
                on_note=functools.partial(self._report, index),
                lost=functools.partial(self._lost, index),
            )
            helper.start()
            self._helpers.append(helper)
        self.started = True

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, one per device, in device order (empty before the first use)."""
        return [pid for pid in (helper.pid for helper in self._helpers) if pid is not None]

    def _lost(self, index: int, died: ProcessDied) -> MeshError:
        """What every command a dead worker held fails with (and every later one)."""
        return MeshError(
            f"mesh: the worker of {self.devices[index]} (device {index} of this executor) stopped "
            f"({died.status}); restart every process, and resume continues the run"
        )

    def _report(self, index: int, note: tuple[int, int, int]) -> None:
        """A progress report of a command still running (on the worker's reader): its worker waits for the
        verdict."""
        ident, done, total = note
        relay = self._relays.get(ident)
        if relay is None:  # nothing to relay to (cannot happen: a worker reports only when asked)
            self._reply(index, ident, _GO)
        else:
            relay.report(index, ident, done, total)

    def call(self, commands: Sequence[tuple[Verb, Any]], relay: ProgressRelay | None = None) -> list[Future]:
        """Sends command i to worker i (all under one lock, so every worker sees the calls in one order);
        the workers' progress reports for these commands go to `relay`."""
        self.start()
        futures = []
        with self._send:
            for index, (verb, argument) in enumerate(commands):
                helper = self._helpers[index]
                ident = next(self._ids)
                if relay is not None:
                    self._relays[ident] = relay
                try:
                    future = helper.submit((verb, argument), ident=ident)
                except NotDelivered as error:
                    self._relays.pop(ident, None)
                    future = Future()
                    died = helper.died
                    future.set_exception(
                        self._lost(index, died)
                        if died is not None
                        else MeshError(f"mesh: the worker of {self.devices[index]} is gone ({error})")
                    )
                else:
                    future.add_done_callback(functools.partial(self._answered, ident))
                futures.append(future)
        return futures

    def _answered(self, ident: int, _: Future) -> None:
        self._relays.pop(ident, None)

    def everyone(self, verb: Verb, argument: Any = None, relay: ProgressRelay | None = None) -> list[Any]:
        """The same command to every worker; answers their values or raises the first error (the progress
        callback's own exception where it raised)."""
        futures = self.call([(verb, argument)] * len(self.devices), relay)
        try:
            return [f.result() for f in futures]
        except BaseException:
            if relay is not None and relay.failure is not None:
                raise relay.failure from None  # the workers' errors only say they stopped for it
            raise

    def relay(self, callback: ProgressCallback | None) -> ProgressRelay | None:
        """The relay of one call's progress to `callback` (None: the call reports nothing)."""
        if callback is None:
            return None
        return ProgressRelay(callback, self._reply, self._run_progress)

    def _run_progress(self, decide: Callable[[], None]) -> None:
        # One thread for every relay: the callbacks run one at a time, as a one-device trainer's saves do on
        # its queue thread, and never on a reader thread, which must go on reading the workers' answers.
        assert self._progress is not None
        with contextlib.suppress(RuntimeError):  # closed: the workers were told to exit, which fails the report
            self._progress.submit(decide)

    def _reply(self, index: int, ident: int, verdict: str) -> None:
        """Sends a report's verdict to the worker waiting for it (a gone worker's reader fails its call)."""
        self._helpers[index].notify((ident, verdict))

    def close(self) -> None:
        if not self.started:
            return
        with self._send:
            close_all(self._helpers, WORKER_CLOSE_SECONDS)
        if self._progress is not None:  # a callback still running is the caller's; its verdict goes nowhere
            self._progress.shutdown(wait=False)
            self._progress = None
        self._helpers = []
        self.started = False


def merge_answers(
    futures: list[Future],
    plan: list[np.ndarray],
    count: int,
    checked: Any,
    succeeded: Callable[[int], None],
    notices: Notices,
) -> Future:
    """One future of the step's answer from the workers' answers; `succeeded` runs before it resolves, with the
    steps the workers have taken (the same on every worker: a step skipped as non-finite is skipped by all), and
    the workers' held-back warnings are replayed through `notices`, so each shows once, in this process."""
    done: Future = Future()
    done.set_running_or_notify_cancel()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish() -> None:
        failure = first_failure(futures)
        if failure is not None:
            done.set_exception(failure)
            return
        answers = [f.result() for f in futures]
        succeeded(answers[0]["steps"])
        for answer in answers:
            notices.replay(answer.get("notices", []))
        if checked.stats is not None:
            stats = checked.stats
            first = answers[0]["stats"]
            for f in dataclasses.fields(TrainerStepStats):
                setattr(stats, f.name, first[f.name])
            for name in ("truncated", "dropped", "skipped"):
                if hasattr(stats, name):
                    setattr(stats, name, sum(a["stats"].get(name, 0) for a in answers))
        if checked.arena is None:
            done.set_result(None)
            return
        width = next((a["embeddings"].shape[1] for a in answers if a["embeddings"] is not None), 0)
        rows = torch.zeros(count, width)
        present = torch.zeros(count, dtype=torch.bool)
        for items, answer in zip(plan, answers, strict=True):
            if answer["embeddings"] is not None and len(items):
                rows[torch.from_numpy(items)] = torch.from_numpy(answer["embeddings"])
                present[torch.from_numpy(items)] = torch.from_numpy(answer["present"])
        done.set_result(checked.arena.land(rows, present, checked.scalar))

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                finish()
            except BaseException as error:  # pragma: no cover - a bug in merging
                done.set_exception(error)

    for f in futures:
        f.add_done_callback(one_done)
    return done


def share_items(
    segment: list[shared_memory.SharedMemory], contents: Sequence[Any], items: np.ndarray
) -> dict[str, Any]:
    """Copies the bytes of `items` into one new shared-memory segment (the only copy they take on their
    way to the worker); answers its name and the offsets of every item in it."""
    lengths = np.array([len(contents[i]) for i in items], dtype=np.int64)
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    memory = shared_memory.SharedMemory(create=True, size=max(1, int(offsets[-1])))
    segment.append(memory)  # this process owns it: unlinked once every worker answered the step
    view = memory.buf
    assert view is not None
    for k, i in enumerate(items.tolist()):
        view[offsets[k] : offsets[k + 1]] = memoryview(contents[i]).cast("B")
    del view
    return {"name": memory.name, "offsets": offsets}


def release_segments(segments: list[shared_memory.SharedMemory]) -> None:
    for memory in segments:
        with contextlib.suppress(Exception):
            memory.close()
        with contextlib.suppress(Exception):
            memory.unlink()


# --------------------------------------------------------------------------------------------------
# The worker process's side


class _Verdicts:
    """A worker's end of the progress relay: a report goes up the pipe, and the reporting thread waits for the
    verdict, which the worker's reader thread hands over (the main thread may be the one waiting)."""

    def __init__(self, report: Callable[[int, int, int], object]) -> None:
        self._report = report  # (ident, done, total) up to the calling process
        self._lock = threading.Lock()
        self._waiting: dict[int, Future] = {}  # by the ident of the command that reports
        self._gone: str | None = None

    def callback(self, ident: int) -> ProgressCallback:
        """The stand-in for the caller's callback during command `ident`."""

        def progress(done: int, total: int) -> bool:
            verdict: Future = Future()
            with self._lock:
                if self._gone is not None:
                    raise RuntimeError(f"progress: {self._gone}")
                self._waiting[ident] = verdict
            self._report(ident, done, total)
            said = verdict.result()
            if said == _RAISED:  # the caller raises the callback's own exception; this only stops the call
                raise RuntimeError("progress: the callback raised in the calling process")
            if said not in (_GO, _STOP):  # why the calling process will not answer (see `close`)
                raise RuntimeError(f"progress: {said}")
            return said == _GO

        return progress

    def settle(self, ident: int, verdict: str) -> None:
        with self._lock:
            waiting = self._waiting.pop(ident, None)
        if waiting is not None:
            waiting.set_result(verdict)

    def close(self, why: str) -> None:
        """The calling process will answer no more: a waiting report, and any later one, fails the call."""
        with self._lock:
            self._gone = why
            waiting, self._waiting = list(self._waiting.values()), {}
        for verdict in waiting:
            verdict.set_result(why)


def run_worker(link: Link, device_name: str, threads: int) -> None:
    """A worker's loop (a `uform.runtime.helper.Helper`'s target): commands in order, answers as they complete
    (steps answer when done).

    A command's verb is a `Verb`: the module that sends it owns what it does (the mesh joins and leaves a world,
    the trainer builds, steps and saves), so this loop knows none of them."""
    # A Ctrl-C reaches the whole process group, a scheduler's SIGTERM often every process of the job: stopping is
    # the calling process's to decide (`uform.interrupts`: finish the step, save), and a worker whose caller is
    # gone ends on its pipe's EOF.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(device_name)
    endpoint = link.open()
    if not endpoint.ready():
        return
    retired_segments: list[shared_memory.SharedMemory] = []
    state: dict[str, Any] = {"trainer": None, "mesh": None, "retired": retired_segments}

    def answer(ident: int, value: Any) -> None:
        try:
            endpoint.reply(ident, value)
        except Exception as error:  # an answer that does not pickle
            endpoint.fail(ident, error)

    verdicts = _Verdicts(lambda ident, done, total: endpoint.note((ident, done, total)))
    commands: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        # The pipe is read here, not by the main thread: a command may wait for a verdict (a save's or a
        # resume's progress) on the main thread or the trainer's, and the verdict comes down this pipe.
        while True:
            try:
                frame = endpoint.receive()
            except (EOFError, OSError):
                commands.put(None)
                verdicts.close("the calling process is gone")
                return
            if frame is None:
                commands.put(None)
                verdicts.close("the executor was closed")
                return
            try:
                payload = frame.load()
            except BaseException as error:  # a command whose verb or argument does not load here
                if frame.kind == "call":
                    endpoint.fail(frame.ident, error)
                continue
            if frame.kind == "note":
                verdicts.settle(*payload)
            else:
                commands.put((frame.ident, *payload))

    threading.Thread(target=read, daemon=True, name="uform-worker-reader").start()

    def resolved(ident: int, value: Future) -> None:
        try:
            result = value.result()
        except BaseException as error:
            endpoint.fail(ident, error)
        else:
            answer(ident, result)

    while True:
        command = commands.get()
        if command is None:
            break
        ident, verb, argument = command
        try:
            value = verb(state, device, argument, verdicts.callback(ident))
        except BaseException as error:
            endpoint.fail(ident, error)
            continue
        if isinstance(value, Future):  # answered once done (a step): the next command need not wait for it
            value.add_done_callback(functools.partial(resolved, ident))
        else:
            answer(ident, value)
    trainer = state["trainer"]
    if trainer is not None:
        with contextlib.suppress(BaseException):
            trainer.close()
    if state["mesh"] is not None:
        with contextlib.suppress(BaseException):
            state["mesh"].close()
    state.clear()
    gc.collect()  # a failed step's traceback may still hold views of its segment
    for memory in retired_segments:
        try:
            memory.close()
        except BufferError:  # still viewed: the mapping goes with the process, which exits now
            # SharedMemory has no public way to give up a mapping that is still viewed, and its __del__ would
            # retry close() and print the BufferError at exit: drop its reference to the mmap (stdlib private).
            memory._mmap = None  # type: ignore[attr-defined]
    endpoint.close()


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """The calling process's segment `name`, mapped here and left to the caller: this worker has a resource
    tracker of its own (it is not a multiprocessing child), which must not unlink the segment when it exits."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    memory = shared_memory.SharedMemory(name=name)  # registers the name with this worker's tracker: undo that
    resource_tracker.unregister(f"/{memory.name}", "shared_memory")  # the tracker's name has the leading slash
    return memory


def choice_share(
    choices: ChoiceTapes, items: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One device's part of a step's checked choices: (data, offsets, targets, offsets) tapes of `items`."""
    parts = [choices.of(i) for i in items]
    offsets = np.cumsum([0] + [len(legal) for legal, _ in parts]).astype(np.int64)
    data = np.concatenate([legal for legal, _ in parts]) if parts else np.zeros(0, dtype=np.uint8)
    targets = np.concatenate([target for _, target in parts]) if parts else np.zeros(0, dtype=np.float32)
    return data.astype(np.uint8), offsets, targets.astype(np.float32), offsets
