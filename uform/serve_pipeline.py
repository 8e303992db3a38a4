"""A serving model's pipeline of calls: how each call's job flows from the host to the device and back as its
answer. A preparing thread ("uform-serve-host") runs each call's host stage (`serve_stage.HostStage.batches`, as
the model's attributes stand when the call starts: `Pipeline.setting`) and hands its batches on through a short
queue; the caller's thread launches each batch's forward and readout on the device, lands it (`serve_call.landed`)
while the next is launched, answers each call's `Run` in the order of the calls and warns what it could not
answer whole. `Pipeline` owns what that needs beside the host stage: the lock that lets one call at a time through,
the stream the batches cross on and the forwards (compiled once where the model is).

Shape legend: n members of a batch, R rows, C columns, S segment slots, D hidden, W token-vector width, T token
vectors of a batch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from . import device_pictures
from .config import TrainerInitVramConfig
from .data.windows import Packing
from .enums import Objective
from .media.decode import MediaPolicy, warn_skipped
from .media.limits import MediaError
from .model.inputs import DeviceBatch, to_device, to_host
from .model.network import Network
from .notices import Notices
from .page_locks import copies_done
from .replica.capacity import warn_truncated
from .replica.checkpoint import Stopped, report_points
from .serve_args import ProgressCallback
from .serve_call import VERB_NAMES, Job, Prepared, Run, landed
from .serve_stage import HostStage, StageSetting

__all__ = ["Pipeline", "Served"]

_QUEUE_DEPTH = 4
"""Prepared batches the host thread may hold ahead of the device."""


class Served(Protocol):
    """The model whose calls a pipeline runs (`serve.Model` is one; its attributes say what each means): read where
    they are needed, never copied, since a caller may set them between calls."""

    network: Network
    config: TrainerInitVramConfig
    device: torch.device
    columns: int
    segments: int
    window: int
    packing: tuple[int, int]
    media: MediaPolicy
    jpeg_decoder: device_pictures.Decoder | None
    bf16: bool
    compiled: bool
    attention: str
    host_processes: int
    keep_decoded: bool
    notices: Notices


class Pipeline:
    """One serving model's calls through the host stage and the device, one call (or stream of calls) at a time."""

    def __init__(self, served: Served, stage: HostStage, *, prefix: int) -> None:
        self.served = served
        self._stage = stage
        self._prefix = prefix  # a text item's prefix positions
        # The run's config as packing sees it at serving: nothing corrupted, one bag per batch.
        config = served.config
        self._serving = dataclasses.replace(
            config,
            objective=Objective.Contrastive,
            batch=dataclasses.replace(config.batch, max_bags_per_device=0),
        )
        self.lock = threading.Lock()
        """Held by the call (or stream) running now; the model's `close` takes it too."""
        self._holder: int | None = None  # the thread whose call (or stream) holds the lock
        device = served.device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # batches cross on it
        self._pooled_fn: Callable[..., Tensor] = self._pooled_forward
        self._states_fn: Callable[..., Tensor] = self._states_forward
        if served.compiled:  # as the model is built: a later change of `compiled` moves only the packing
            self._pooled_fn = torch.compile(self._pooled_forward, dynamic=False)
            self._states_fn = torch.compile(self._states_forward, dynamic=False)

    def refuse_reentry(self, what: str) -> None:
        """A clear error, not a hang, for a call made while this thread's own call holds the model: from inside
        the loop over an `encode_stream`, or from a `progress` callback."""
        if self._holder == threading.get_ident():
            raise RuntimeError(
                f"Model: {what} while this thread's own call or encode_stream is still running on the model (a "
                "model serves one call at a time); finish or close the stream first, or use a second model"
            )

    def run(self, job: Job, progress: ProgressCallback | None, steps: int) -> list[tuple[Prepared, Any]]:
        """Every batch of the call through the device: answers (batch, readout) pairs once all are done, having
        warned what the call could not answer whole."""
        with contextlib.closing(self.runs(iter([job]), progress, steps)) as runs:
            done = next(runs)
        self.warn(done, 3)  # shown at the line that called the verb
        return done.answers

    def runs(self, jobs: Iterator[Job], progress: ProgressCallback | None, steps: int) -> Generator[Run, None, None]:
        """Every batch of every call of `jobs` through the device, one pipeline for them all: each call's
        `Run` is answered once its last batch has landed, while the next call's first batches are prepared
        (and launched) behind it, so the device does not wait for a call's start between two calls. `jobs` is
        pulled on the preparing thread; what it raises comes after the calls before it. Holds the model's
        lock until closed."""
        self.refuse_reentry("a call")
        with self.lock:
            self._holder = threading.get_ident()
            handoff: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
            stop = threading.Event()
            host = threading.Thread(
                target=self._preparer_main, args=(jobs, handoff, stop), name="uform-serve-host", daemon=True
            )
            was_training = self.served.network.training
            self.served.network.eval()
            host.start()
            try:
                pending: collections.deque[Run] = collections.deque()  # calls not yet answered, oldest first
                # One batch's readout stays in flight while the next batch is launched, so the device never
                # idles through a readback and the next launch (the trainer's deferred steps, for serving).
                landing: tuple[Run, tuple[Prepared, Tensor, Any]] | None = None
                run: Run | None = None
                failure: BaseException | None = None
                while True:
                    message = handoff.get()
                    kind = message[0]
                    if kind == "end":
                        break
                    if kind == "error":
                        failure = message[1]  # raised once the calls finished before it are answered
                        break
                    if kind == "job":
                        job = message[1]
                        run = Run(job, sorted(report_points(len(job.modalities), steps)), truncated=job.cut)
                        pending.append(run)
                        continue
                    assert run is not None  # every other message follows its call's "job"
                    if kind == "done":
                        run.complete = True
                        if landing is not None and handoff.empty():  # nothing to launch behind it: land it now
                            landing[0].answers.append(landed(landing[1]))
                            landing = None
                    elif kind == "skipped":
                        if run.job.errors == "raise":  # the first broken item of the call: its window is the first
                            item, reason = min(message[1])
                            failure = MediaError(reason, item=item)
                            break
                        run.skipped.extend(message[1])
                        run.done += len(message[1])
                    elif kind == "batch":
                        prepared = message[1]
                        launched = (prepared, *self._device(run.job, prepared))
                        if landing is not None:
                            landing[0].answers.append(landed(landing[1]))
                        landing = (run, launched)
                        run.truncated += prepared.truncated
                        run.skipped.extend(prepared.failed)
                        run.done += len(prepared.members)
                    if progress is not None and kind in ("batch", "skipped"):
                        _progress(run, progress)
                    while pending and pending[0].complete and (landing is None or landing[0] is not pending[0]):
                        yield _answered(pending.popleft(), progress)
                if landing is not None:
                    landing[0].answers.append(landed(landing[1]))
                while pending and pending[0].complete:
                    yield _answered(pending.popleft(), progress)
                if failure is not None:
                    raise failure
            finally:
                stop.set()
                while host.is_alive():  # let a host thread blocked on a full hand-off see the stop
                    with contextlib.suppress(queue.Empty):
                        handoff.get(timeout=0.05)
                host.join()
                self._stage.release_leases()  # the batches of a failed call that were never launched
                self.served.network.train(was_training)
                self._holder = None

    def warn(self, done: Run, stacklevel: int) -> None:
        """The warnings of a finished call: its media that could not be decoded, its items cut to fit a row; each
        counted in the model's notices."""
        served = self.served
        verb = VERB_NAMES[done.job.verb]
        counted = f"the valid mask {verb} answers and Model.notices"
        warn_skipped(served.notices, done.skipped, done.job.modalities, counted, None, stacklevel + 1)
        advice = (
            f"a model serves at its run's batch.max_columns_per_row ({served.columns} positions a row, its prefix "
            f"included); train with a larger batch.max_columns_per_row to {verb} longer items whole. Counted in "
            "Model.notices"
        )
        warn_truncated(served.notices, done.truncated, len(done.job.modalities), verb, advice, stacklevel + 1)

    def setting(self) -> StageSetting:
        """How the host stage runs a call, as the model's attributes stand now."""
        served = self.served
        shape = Packing(
            config=self._serving,
            columns=served.columns,
            prefix=self._prefix,
            segments=served.segments,
            packing=served.packing,
            fixed=served.compiled,
            flex=served.attention == "flex",
            window=served.window,
        )
        return StageSetting(
            shape=shape,
            batch=served.config.batch,
            media=served.media,
            device=served.device,
            host_processes=served.host_processes,
            keep_decoded=served.keep_decoded,
            jpeg_decoder=served.jpeg_decoder,
        )

    def _preparer_main(self, jobs: Iterator[Job], handoff: queue.Queue, stop: threading.Event) -> None:
        """The preparing thread: each call of `jobs` as ("job", job), its batches, ("done",); ("end",) after
        the last; ("error", error) for what it raised."""
        try:
            for job in jobs:
                handoff.put(("job", job))
                batches = self._stage.batches(job, self.setting(), stop)
                with contextlib.closing(batches) as messages:  # closed here: its decoding thread joins
                    for message in messages:
                        if stop.is_set():
                            return
                        handoff.put(message)
                handoff.put(("done",))
                if stop.is_set():
                    return
            handoff.put(("end",))
        except BaseException as error:  # handed to the caller's thread, which raises it
            handoff.put(("error", error))

    def _device(self, job: Job, prepared: Prepared) -> tuple[Tensor, Any]:
        """One batch's forward and readout, launched: answers the readout's host tensor and the CUDA event after
        which it holds the answer (None on the CPU, where it is ready); `landed` waits for it."""
        device = self.served.device
        release = prepared.release  # where its tensors view a host process's area (`serve_stage`)
        cuda = device.type == "cuda"
        try:
            inputs = self._inputs(prepared)
        finally:
            if release is not None and cuda:  # the area is free once the copies out of it are done
                assert self._copy_stream is not None
                release(copies_done(self._copy_stream))
        try:
            return self._launch(job, prepared, inputs)
        finally:
            if release is not None and not cuda:  # the forward read the area's views, and is done
                release(None)

    def _launch(self, job: Job, prepared: Prepared, inputs: DeviceBatch) -> tuple[Tensor, Any]:
        """`_device`'s forward and readout, launched, on the batch's device inputs."""
        device = self.served.device
        network = self.served.network
        # From page-locked memory: a copy from pageable memory would wait for the forward launched before it,
        # so the host could not prepare the next launch meanwhile (measured: 24 ms a text batch on the H200,
        # 15 ms of kernels).
        picks = prepared.picks.to(device, non_blocking=True)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.served.bf16):
            if job.verb == "encode":
                pooled = self._pooled_fn(inputs)  # [S, D] f32
                out = F.normalize(pooled[picks, : job.width].float(), dim=-1)  # [n, width]
            else:
                states = self._states_fn(inputs)  # [R, C, D]
                flat = states.reshape(-1, states.shape[-1])
                at = flat[picks]
                if job.verb == "tokens":
                    assert network.token_head is not None
                    out = network.token_head(at).float()  # [T, W]
                else:
                    out = network.text_head(at).float()  # [n, 256]
        if device.type != "cuda":
            return out, None
        host = to_host(out)
        event = torch.cuda.Event(blocking=True)  # waited for by sleeping, not by spinning a core
        event.record(torch.cuda.current_stream(device))
        return host, event

    def _inputs(self, prepared: Prepared) -> DeviceBatch:
        """A prepared batch's host tensors on the device (`model.inputs.to_device`, as the trainer's step);
        the media units' counts dynamic where the forward is compiled; a batch of images of one size gathered into
        dense attention on the flex path (kind "gathered"). H200, 4,096 256² JPEGs a call (BENCHMARKS.md, "Issue 12,
        twenty-second day"): faster than FlexAttention in eight same-call pairs of eight, by 1-9%."""
        served = self.served
        dtype = torch.bfloat16 if served.bf16 else torch.float32
        rotary = served.network.rotary
        return to_device(
            prepared.tensors,
            served.device,
            rotary,
            attention=served.attention,
            dtype=dtype,
            dynamic=served.compiled,
            copy_stream=self._copy_stream,
            gathered=True,
        )

    def _pooled_forward(self, batch: DeviceBatch) -> Tensor:
        network = self.served.network
        states = network.states(batch)
        return network.pooled(states, batch.segments, batch.counts).float()

    def _states_forward(self, batch: DeviceBatch) -> Tensor:
        return self.served.network.states(batch)


def _progress(run: Run, progress: ProgressCallback) -> None:
    """Reports `run`'s items done at its next report point(s); False from the callback stops the call."""
    total = len(run.job.modalities)
    if run.done < total and run.at < len(run.points) and run.done >= run.points[run.at]:
        while run.at < len(run.points) and run.points[run.at] <= run.done:
            run.at += 1
        if progress(run.done, total) is False:
            raise Stopped(f"{VERB_NAMES[run.job.verb]} stopped at {run.done} of {total} items")


def _answered(run: Run, progress: ProgressCallback | None) -> Run:
    """`run`, its last batch landed: the callback's last report first."""
    total = len(run.job.modalities)
    if progress is not None and progress(total, total) is False:
        raise Stopped(f"{VERB_NAMES[run.job.verb]} stopped at {total} of {total} items")
    return run
