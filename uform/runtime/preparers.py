"""The prepare stage of a trainer's steps, on the trainer's threads or in preparer processes of its own.

A step has a prepare stage (decode its media items in a `DecodePool`, then `data.batch.prepare`: pack, corrupt,
pair; FlexAttention's block tables on CUDA) and a device stage (copy, forward, backward, AdamW). `prepare_step` is
the prepare stage as one function of the run, the step's checked arguments and its number; every draw in it is
keyed by (seed, step, stream), so it answers the same arrays wherever and in whatever order it runs.

In process (``host_processes=0``), the trainer's two host threads call `prepare_step` themselves. Their Python and
numpy work then shares the interpreter lock with the device thread, which launches the step's kernels: on an H200
at the reference geometry (docs/design.md §1) with 128 JPEGs a step, that costs 13-18% of the step (BENCHMARKS.md). `Preparers`
moves the work out: the trainer's process keeps only the device stage and one copy of the finished arrays. The
shape is PyTorch DataLoader's (worker processes that build whole batches; a pin-memory thread in the main process,
`torch/utils/data/dataloader.py`), with two differences: a step is numbered when it is called, and its number keys
its draws, so any process may prepare any step and the answers never depend on which one did, or when; and the
arrays come back through shared memory that the trainer's process copies once, into page-locked memory on CUDA.

The processes (``host_processes=N``, all started by the first step: the one it needs in its thread, the others behind it):

- Each preparer process is started with the run's config, its `MediaPolicy` and the side of the block tables
  its steps carry (the flex attention path's; 0 for none), owns a
  `DecodePool` of its own (``media.workers`` split over the N processes; started lazily, so a text-only process
  never starts decoders) and prepares up to `PREPARE_SLOTS` steps at once on two threads of its own: while one waits
  for its step's media, the other packs. It is a `uform.runtime.child.Child` (a fresh interpreter on a module of uform's,
  which never imports the trainer's main module, so a training script needs no main guard), and its decoders
  come from a fork server of its own that preloads the decoding libraries. It ignores SIGINT (the trainer's
  process handles Ctrl-C), exits when its pipe to the trainer reports end of file (the trainer's process died),
  killing its decoders, and is ended by `close` (also run at interpreter exit, and when the object is collected).
- A step travels as one message: its contents are copied once, back to back, into the input area of one of the
  process's slots in its shared-memory slab (a `uform.runtime.helper.Helper`'s: a sparse file under /dev/shm,
  unlinked at once and mapped by the preparer process through its descriptor, so no name outlives a killed process), and the rest of its checked arguments (modalities, bags, groups, sides, choices,
  relations) pickled beside them with protocol 5, large buffers out of band into the same area. The preparer process
  reads the contents as views of the slab (no copy) and answers the `Batch`, the block tables and the skipped
  items the same way, into the slot's output area (`uform.runtime.slab.write_out_of_band`, the decoders' own mechanism);
  the step's media arrays are built there in the first place (`Built`: its decoders' units, views of their slabs,
  are stacked straight into the area), so the answer names them where they lie and a unit is copied once between
  a decoder's slab and the trainer's process. The trainer's process maps the answer's arrays from the slab and
  copies each once, into page-locked memory on CUDA (where the asynchronous copy to the GPU reads it) or an owned
  array on the CPU; the slot is then free for the next step (a step whose wait was interrupted keeps its slot
  until its answer came back). Pages of a slab are reserved before they are written (``posix_fallocate``), so a full /dev/shm
  sends the message through the pipe instead of killing a process with SIGBUS; areas keep the pages they reached.
- Failures answer the step that met them, in the trainer's process: a strict `MediaError` naming the item (the
  trainer unchanged), any other exception of the prepare stage as itself, and a preparer process that died (killed, out
  of memory) a `PreparerError` for every step it held; the next step starts a new process. An exception
  crosses back as the helper's transport carries it (`uform.runtime.remote_error`): its own type where that
  imports here, its message unchanged, the preparer process's traceback as its ``__cause__``. A skipped item comes
  back as (index, reason) and the trainer warns with `MediaWarning` in its own process. Decode time limits are the
  preparer process's `DecodePool`'s, as in process.

This module imports numpy and the light uform modules only (torch loads lazily, in the trainer's process), so a
preparer process starts without torch.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import TrainerInitVramConfig
from ..data.batch import Alloc, Batch, draws_media_masks, prepare
from ..data.blocks import block_tables
from ..data.items import ChoiceTapes
from ..enums import LateInteractionSide, Modality
from ..media.decode import MediaPolicy, decode_items
from ..media.units import Units
from ..relations import Edges, Relations
from .child import START_METHOD
from .decoders import DecodePool, decode_parallelism
from .heap import keep_heap
from .helper import BOOT_SECONDS, Endpoint, Frame, Helper, Link, NotDelivered, ProcessDied, close_all
from .slab import SLAB_ALIGN, reserve_area
from .slots import (
    DECODER_CONTEXT,
    DECODER_PRELOAD,
    IN_BAND_BELOW,
    Built,
    contents_views,
    enum_codes,
    enum_members,
    write_contents,
)

if TYPE_CHECKING:
    import torch

__all__ = ["PREPARE_SLOTS", "PrepareJob", "Prepared", "PreparerError", "Preparers", "prepare_step"]

PREPARE_SLOTS = 2
"""Steps one preparer process prepares at once (two threads: one packs while the other waits for its media)."""

_INPUT_BYTES = 1 << 30
"""Each slot's input area (virtual: pages are reserved as steps reach them); contents beyond it cross the pipe."""
_OUTPUT_BYTES = 1 << 30
"""Each slot's output area, likewise."""

_DEFAULT_CONTEXT = START_METHOD


class PreparerError(RuntimeError):
    """A preparer process died (killed, out of memory) while it held a step; the step was not taken."""


# ---- the prepare stage, wherever it runs ----------------------------------------------------------------------


@dataclass
class PrepareJob:
    """What the prepare stage reads of a step: its checked arguments (the `CheckedStep` but the arena and
    the stats, which stay with the caller)."""

    modalities: list[Modality]
    contents: Sequence[bytes | memoryview]
    bags: np.ndarray | None = None
    groups: np.ndarray | None = None
    sides: list[LateInteractionSide] | None = None
    choices: ChoiceTapes | None = None
    relations: Any = None


@dataclass
class Prepared:
    """What the prepare stage answers: the step's batch, FlexAttention's block tables (empty off the flex path) and
    the media items that did not decode, as (index, reason)."""

    batch: Batch
    tables: dict[str, np.ndarray]
    failed: list[tuple[int, str]]


def decode_media(
    config: TrainerInitVramConfig, policy: MediaPolicy, decoders: Callable[[], DecodePool], job: PrepareJob
) -> tuple[dict[int, Units], list[tuple[int, str]]]:
    """The prepare stage's first half: the step's media items decoded in `decoders()` (the pool, made only when
    the step has media), each to at most a row past its prefix; the units of those that decoded and (index,
    reason) of those that did not (`MediaError` for the first of them under a strict `policy`)."""
    items = [i for i, m in enumerate(job.modalities) if m != Modality.Text]
    if not items:
        return {}, []
    late = config.late_interaction.weight > 0
    max_units = config.batch.max_columns_per_row - (2 if late else 1)  # the prefix: marker (+ side marker)
    keyed = draws_media_masks(config)
    return decode_items(decoders(), policy, config.batch, job.modalities, job.contents, items, max_units, keyed)


def prepare_step(
    config: TrainerInitVramConfig,
    policy: MediaPolicy,
    tiles: int,
    decoders: Callable[[], DecodePool],
    job: PrepareJob,
    step: int,
    alloc: Alloc = np.empty,
) -> Prepared:
    """Decodes the step's media items in `decoders()` (the pool, made on first need), then packs, corrupts and
    pairs the step (`data.batch.prepare`, its media arrays made by `alloc`) and, where `tiles` is not 0 (the flex
    attention path), builds its block tables of that tile side. Raises `MediaError` naming the first item that
    failed under a strict `policy`."""
    units, failed = decode_media(config, policy, decoders, job)  # views of the decoders' slabs, held until dropped
    skipped = None
    if units or failed:
        skipped = np.zeros(len(job.modalities), dtype=bool)
        for i, _ in failed:
            skipped[i] = True
    batch = prepare(
        config,
        job.modalities,
        job.contents,
        bags=job.bags,
        groups=job.groups,
        sides=job.sides,
        relations=job.relations,
        step=step,
        units=units,
        skipped=skipped,
        choices=job.choices,
        alloc=alloc,
    )
    del units  # copied into the batch: the decoders may write over those bytes again
    tables = block_tables(batch.segments, tiles) if tiles else {}
    return Prepared(batch, tables, failed)


def adopt(answer: Prepared, pin: bool) -> dict[str, torch.Tensor]:
    """The host tensors of an answer whose arrays may be views of a slab: each array copied once (into
    page-locked memory when `pin`), and the batch made to hold those copies (`Batch.adopt`)."""
    host = answer.batch.host_tensors(pin, copy=True, tables=answer.tables)
    answer.batch.adopt(host)
    answer.tables = {}
    return host


# ---- the trainer's side -------------------------------------------------------------------------------------


class _Preparer:
    """The trainer's view of one preparer process: its helper and its slots."""

    def __init__(self, index: int, helper: Helper) -> None:
        self.index = index
        self.helper = helper
        self.free = list(range(PREPARE_SLOTS))
        self.reserved = [0] * PREPARE_SLOTS  # bytes of each input area backed so far
        self.broken = False  # a send failed: no later step goes to it (its reader buries it)

    @property
    def dead(self) -> bool:
        return self.broken or self.helper.died is not None

    @property
    def busy(self) -> int:
        return PREPARE_SLOTS - len(self.free)

    @property
    def pending(self) -> int:
        """Steps sent to it and not answered yet."""
        return self.helper.pending

    @property
    def slab(self) -> Any:
        """The trainer's mapping of its slab (None: everything crosses the pipe)."""
        return self.helper.slab

    @property
    def reader(self) -> threading.Thread | None:
        return self.helper.reader


class Preparers:
    """Preparer processes that run `prepare_step` for a trainer (see the module's docstring); `prepare` may be called
    from several threads at once. The first `prepare` starts them all (`_start_behind`)."""

    def __init__(
        self,
        count: int,
        config: TrainerInitVramConfig,
        policy: MediaPolicy,
        tiles: int,
        pin: bool,
        context: str = _DEFAULT_CONTEXT,
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"host_processes: expected an int >= 1, got {count!r}")
        self.count = count
        self.pin = pin
        # What a preparer process needs of the run: no mesh, no progress callback (neither crosses a process).
        self._config = dataclasses.replace(config, mesh=None, progress=None)
        self._policy = policy
        self._tiles = tiles
        self.decoders = max(1, (policy.workers or decode_parallelism()) // count)
        """Decoding processes of each preparer process."""
        self._context = context
        self.input_bytes = _INPUT_BYTES
        self.output_bytes = _OUTPUT_BYTES
        self._processes: list[_Preparer | None] = [None] * count
        self._starting: set[int] = set()  # indices whose process is starting (outside the lock)
        self._launched = False  # whether the first start (which starts the others behind it) happened
        self._cond = threading.Condition()
        self._closed = False
        self._owner = os.getpid()
        self._finalizer = multiprocessing.util.Finalize(
            self, _shutdown, args=(self._processes, self._owner), exitpriority=10
        )

    # -- public ----------------------------------------------------------------------------------------------

    def prepare(self, job: PrepareJob, step: int) -> tuple[Batch, dict[str, torch.Tensor], list[tuple[int, str]]]:
        """`prepare_step` of step `step` in a preparer process: answers the batch (holding its own memory), its host
        tensors (page-locked when pinning) and the failed media items. Raises what the prepare stage raised, or
        `PreparerError` when the process died holding the step."""
        for _attempt in range(3):
            host, slot = self._acquire()
            future: Any = None
            try:
                try:
                    future = self._send(host, slot, job, step)
                except NotDelivered:  # it died before the job reached it: the job may go to a new process
                    continue
                try:
                    answer: Prepared = future.result()  # its arrays are views of the slab until adopted
                except ProcessDied as died:
                    raise PreparerError(
                        f"uform: step {step}: the preparer process (pid {died.pid}) died ({died.status}) while it "
                        "prepared the step; the step was not taken, and the next step starts a new preparer process"
                    ) from None
                tensors = adopt(answer, self.pin)
                return answer.batch, tensors, answer.failed
            finally:
                if future is None or future.done():
                    self._release(host, slot)
                else:  # an interrupted wait: the process still prepares the step into this slot, so it stays taken
                    future.add_done_callback(functools.partial(self._released, host, slot))
        raise PreparerError(f"uform: step {step}: preparer processes keep dying before they take a step")

    @property
    def processes(self) -> list[Any]:
        """The preparer processes running now (for inspection and tests)."""
        with self._cond:
            return [h.helper.process for h in self._processes if h is not None and not h.dead]

    def close(self) -> None:
        """Ends the preparer processes (they end their decoders). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._finalizer()

    # -- slots ----------------------------------------------------------------------------------------------

    def _acquire(self) -> tuple[_Preparer, int]:
        """A free slot of the least busy live preparer process (started or restarted here, outside the lock, so the
        other processes' answers keep flowing meanwhile); waits while every slot is taken or starting."""
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("uform: the trainer's preparer processes were closed")
                if os.getpid() != self._owner:
                    raise RuntimeError("uform: preparer processes cannot be used in a forked child")
                for index, host in enumerate(self._processes):
                    if host is not None and host.dead:  # its reader reaped it; a step still reading keeps its slab
                        self._processes[index] = None
                candidates = [
                    (h.busy if h else 0, i)
                    for i, h in enumerate(self._processes)
                    if (h is None and i not in self._starting) or (h is not None and h.free)
                ]
                if candidates:
                    _, index = min(candidates)
                    host = self._processes[index]
                    if host is not None:
                        return host, host.free.pop()
                    self._starting.add(index)
                    behind = self._start_behind(index)
                    break
                self._cond.wait()
        for other in behind:
            threading.Thread(target=self._start_quietly, args=(other,), name=f"uform-host-start-{other}").start()
        try:
            started = self._start(index)
        except BaseException:
            self._install(index, None)
            raise
        if self._install(index, started):
            return started, started.free.pop()
        raise RuntimeError("uform: the trainer's preparer processes were closed")

    def _start_behind(self, index: int) -> list[int]:
        """The first start of the trainer's life (under the lock) marks every other process as starting, so
        they boot behind it, each on a thread of its own: a process started only once the steps in flight
        first need it would pay its boot, and its first step's page faults, inside a timed run (measured on
        the H200: two preparers 75 ms a text step against one's 53, from that alone)."""
        if self._launched:
            return []
        self._launched = True
        others = [i for i, h in enumerate(self._processes) if h is None and i != index and i not in self._starting]
        self._starting.update(others)
        return others

    def _start_quietly(self, index: int) -> None:
        """Starts process `index` behind the first; one that fails to start stays unstarted, so the next
        `prepare` that needs it starts it again and raises its error there."""
        try:
            started: _Preparer | None = self._start(index)
        except BaseException:
            started = None
        self._install(index, started)

    def _install(self, index: int, started: _Preparer | None) -> bool:
        """Ends the start of process `index`: `started` takes its place (None: it failed); answers False,
        having ended it, when the processes were closed while it started."""
        with self._cond:
            self._starting.discard(index)
            self._cond.notify_all()
            if started is None:
                return False
            if not self._closed:
                self._processes[index] = started
                return True
        _shutdown([started], self._owner)  # closed while it started: the finalizer already ran, so end it here
        return False

    def _released(self, host: _Preparer, slot: int, _future: Any) -> None:
        self._release(host, slot)

    def _release(self, host: _Preparer, slot: int) -> None:
        with self._cond:
            if not host.dead:
                host.free.append(slot)
            self._cond.notify_all()

    # -- a preparer process's life --------------------------------------------------------------------------------

    def _start(self, index: int) -> _Preparer:
        helper = Helper(
            _preparer_main,
            (self.input_bytes, self.output_bytes, self._config, self._policy, self._tiles, self.decoders),
            name=f"uform-host-{index}",
            context=self._context,
            slab_bytes=PREPARE_SLOTS * (self.input_bytes + self.output_bytes),
            slab_prefix="uform-host-",
            views=True,  # an answer's arrays are copied out once, by `adopt`, before the slot is reused
            daemon=False,  # under multiprocessing: it starts the decoder processes, which a daemonic process may not
            # The callback holds the condition, not this object, so an unclosed Preparers is still collected
            # (and its finalizer ends the processes).
            on_exit=functools.partial(_wake, self._cond),
        )
        helper.start()
        try:
            helper.ready.result(BOOT_SECONDS)
        except BaseException as error:
            helper.close(0)
            if isinstance(error, FutureTimeout):
                status = "it did not answer"
            elif isinstance(error, ProcessDied):
                status = f"it exited ({error.status})"
            else:
                raise
            raise PreparerError(
                f"uform: a preparer process failed to start: {status} (its error is on standard error)"
            ) from None
        return _Preparer(index, helper)

    def _send(self, host: _Preparer, slot: int, job: PrepareJob, step: int) -> Any:
        """Writes the job into the slot's input area and sends it; answers the future of its answer. Raises
        `NotDelivered` when the process is gone."""
        helper = host.helper
        slab = helper.slab  # ours until the answer is copied out, even if the process dies meanwhile
        start = slot * (self.input_bytes + self.output_bytes)
        end = start + self.input_bytes
        fd = helper.slab_fd
        offsets, inline = write_contents(slab, fd, host.reserved, slot, start, self.input_bytes, job.contents)
        total = int(offsets[-1])
        record = (
            enum_codes(job.modalities),
            offsets if inline is None else None,
            inline,
            job.bags,
            job.groups,
            None if job.sides is None else enum_codes(job.sides),
            job.choices,
            _portable_relations(job.relations),
        )
        at = start + -(-total // SLAB_ALIGN) * SLAB_ALIGN
        try:
            return helper.submit(
                (slot, step, record),
                area=(at, end),
                reserve=lambda length: reserve_area(fd, host.reserved, slot, start, at - start + length),
                in_band_below=IN_BAND_BELOW,
            )
        except NotDelivered:
            with self._cond:  # no later step goes to it; its reader buries it once it reads end of file
                host.broken = True
            helper.kill()
            raise


def _wake(cond: threading.Condition, _: object = None) -> None:
    with cond:
        cond.notify_all()


def _shutdown(hosts: Sequence[_Preparer | None], owner: int) -> None:
    """Ends every preparer process: each is asked to exit (it ends its decoders), stragglers are killed."""
    if os.getpid() != owner:  # a forked child does not own them
        return
    close_all([h.helper for h in hosts if h is not None])
    if isinstance(hosts, list):
        hosts[:] = [None] * len(hosts)


def _portable_relations(relations: Any) -> Any:
    """The step's relations with every edge field a numpy array (as `relations` reads them), so that any
    sequence the caller used crosses to the preparer process."""
    if not isinstance(relations, Relations):
        return relations
    sets = {}
    for name in ("attract", "repel", "ignore"):
        edges = getattr(relations, name)
        arrays: dict[str, Any] = {f: v if isinstance(v, np.ndarray) else np.asarray(v) for f, v in vars(edges).items()}
        sets[name] = Edges(**arrays)
    return Relations(**sets)


# ---- the preparer process ---------------------------------------------------------------------------------------


def _preparer_main(
    link: Link,
    input_bytes: int,
    output_bytes: int,
    config: TrainerInitVramConfig,
    policy: MediaPolicy,
    tiles: int,
    decoders: int,
) -> None:
    """A preparer process's whole life: map the slab, say ready, then prepare each step it is sent on a thread of
    its own until the trainer asks it to exit or is gone (its process died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's process's to handle
    keep_heap()  # a step's arrays are the same sizes step after step: from the heap, not fresh pages
    # This process's main module is uform.runtime.child's boot (no file, no module name), so the decoders' fork server
    # imports nothing of the trainer's script: it preloads the decoding libraries instead, once.
    if DECODER_CONTEXT == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(DECODER_PRELOAD)
    endpoint = link.open()
    state = _PreparerState(endpoint, input_bytes, output_bytes, config, policy, tiles, decoders)
    if not endpoint.ready():
        return
    jobs = ThreadPoolExecutor(PREPARE_SLOTS, thread_name_prefix="uform-host-job")
    while True:
        try:
            frame = endpoint.receive()
        except (EOFError, OSError):  # the trainer's process is gone: nothing is waiting for any answer
            state.abandon()
            os._exit(0)
        if frame is None:
            break
        jobs.submit(state.run, frame)
    jobs.shutdown(wait=True)
    state.close()


class _PreparerState:
    """What a preparer process's job threads share."""

    def __init__(
        self,
        endpoint: Endpoint,
        input_bytes: int,
        output_bytes: int,
        config: TrainerInitVramConfig,
        policy: MediaPolicy,
        tiles: int,
        decoders: int,
    ) -> None:
        self.endpoint = endpoint
        self.input_bytes = input_bytes
        self.output_bytes = output_bytes
        self.config = config
        self.policy = policy
        self.tiles = tiles
        self.workers = decoders
        self.reserved = [0] * PREPARE_SLOTS  # bytes of each output area backed so far
        self.pool: DecodePool | None = None
        self.lock = threading.Lock()

    def decoders(self) -> DecodePool:
        with self.lock:
            if self.pool is None:
                self.pool = DecodePool(self.workers, self.policy.limits.timeout_seconds, DECODER_CONTEXT)
            return self.pool

    def run(self, frame: Frame) -> None:
        endpoint = self.endpoint
        try:
            slot, step, record = frame.load()
            job = self._job(slot, record)
            start = slot * (self.input_bytes + self.output_bytes) + self.input_bytes
            end = start + self.output_bytes
            built = Built(endpoint.slab, endpoint.slab_fd, self.reserved, slot, start, end)
            answer = prepare_step(self.config, self.policy, self.tiles, self.decoders, job, step, built)
            del job, record
            built.reply(endpoint, frame.ident, answer)
        except BaseException as error:  # the trainer's process raises it for the step
            endpoint.fail(frame.ident, error)

    def _job(self, slot: int, record: tuple) -> PrepareJob:
        modalities, offsets, inline, bags, groups, sides, choices, relations = record
        start = slot * (self.input_bytes + self.output_bytes)
        contents = contents_views(self.endpoint.slab, start, offsets, inline)
        return PrepareJob(
            modalities=enum_members(modalities, Modality),
            contents=contents,
            bags=bags,
            groups=groups,
            sides=None if sides is None else enum_members(sides, LateInteractionSide),
            choices=choices,
            relations=relations,
        )

    def abandon(self) -> None:
        """The trainer's process died: kill the decoders now (a decode in flight may hold the pool's lock)."""
        if self.pool is not None:
            self.pool.abandon()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.endpoint.close()
