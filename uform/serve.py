"""Serving what a trainer trained: `load` a checkpoint into a `Model`, then `encode`, `tokens`, `maxsim` and
`text_choose` any number of items.

Shape legend: N items of a call, R rows, C columns, S segment slots, D hidden, W token-vector width, T token
vectors of a call.

Loading. `load(path, executor)` reads a checkpoint that `Trainer.save` wrote, through the same checks as a
resume (`stored_run`, `checkpoint.read_checkpoint`: regular files only, safetensors only, never pickle): the
header is validated, its config resolved and the network it would build checked against the tensors the file
holds, then every tensor is read and the SHA-256 digest over tensors and metadata is verified before anything
is built, so a truncated, bit-flipped, forged or foreign file is refused with a `CheckpointError` naming the
file. The network is
rebuilt from the stored, resolved config and its weights (the optimizer moments are read, for the digest,
and dropped), moved to the executor's device and frozen in eval mode.

A call. Every argument is checked first (the trainer's rules and messages: `ValueError` or `TypeError`
naming the field); a refused call changes nothing. The items are then taken in windows of `2 S` in the
caller's order; a window's media items are decoded in the decode worker pool (`uform.runtime.decoders.DecodePool`, as in
training), its items sorted by length, longest first, and cut into batches by first fit: an item lands in
the lowest of R rows of C columns with room, and a batch closes when the next item finds none or S items are
in (under FlexAttention the same R x C positions are packed in rows several times as wide, `packing_rows`, so
items of a few hundred positions leave less of each row empty; an item is still cut at C). A window's last,
part-filled batch is packed with the next window. Each batch goes through the trainer's own packing (`data.batch.prepare`, with the contrastive objective so
nothing is corrupted, and one bag so the packer's first fit is the one planned here and drops nothing), then
one forward. A host thread prepares the next batches while the device runs this one; on CUDA, by default, a
call with media items is decoded, sorted and packed in host processes of its own (`load(host_processes=...)`,
`uform.runtime.serve_host`: each takes a contiguous share of the call, and the host thread copies each batch
they pack into page-locked memory), so this process's interpreter lock is left to the device's launches.
Answers land in the caller's order; an item's answer never depends on its neighbours (attention never crosses a segment and
positions restart in every segment), so a call of many batches answers what each item alone would.

Per item as in training: a text longer than a row is cut at the row's width; media are decoded at the run's
geometry and downscaled / cut to fit a row; the prefix is the modality marker, plus the side marker where the
run trained late interaction. On the CPU a forward takes only the rows its batch uses; on CUDA the model is
compiled once for the full capacity (FlexAttention, bf16 autocast, as the trainer's step).

Media that cannot be decoded or break a limit never answer a vector that looks real. By default
(`errors="raise"`) the call raises `MediaError` naming the first such item (`contents[i]: reason`) before it
answers anything, and an arena it was given is left as it was. A caller that would rather keep the rest asks
`errors="mask"`: `encode` then answers `(embeddings, valid)`, the rows of invalid items NaN (-128 under
`Scalar.I8`, a value no real row takes), `tokens` answers `(data, offsets, valid)`, invalid items without
vectors, and one `MediaWarning` per model (not per item) names the first ones, every one counted in
`Model.notices`. A decoder that crashes or hangs is killed and replaced by the pool; the serving process never
goes down with it.

Items longer than a row are cut, as in training, at the run's `batch.max_columns_per_row`: one
`CapacityWarning` per model says so, again whenever the share of a call's items cut has doubled, and
`Model.notices` counts them (kind "capacity.truncated").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import device_pictures, vocab
from .arena import Arena, as_scalar
from .config import TrainerInitVramConfig
from .data.batch import MEDIA_KINDS, media_features
from .data.items import is_tape, parse_contents, parse_modalities, parse_sides, tape_items
from .data.windows import CallItems, Packed, Packing, call_batches, pack_batch, packing_rows
from .enums import LateInteractionSide, Modality, Objective, Scalar
from .media.decode import MediaPolicy, decode_items, warn_skipped
from .media.limits import MediaError
from .media.units import Units
from .model.attention import compiled_flex_available
from .model.inputs import DeviceBatch, to_device, to_host
from .model.network import Network
from .notices import Notices
from .replica.capacity import warn_truncated
from .replica.checkpoint import Stopped, report_points
from .replica.stored_model import read_served
from .runtime.decoders import DecodePool
from .runtime.executor import Executor
from .runtime.serve_host import ServeHost

__all__ = ["Model", "load"]

ProgressCallback = Callable[[int, int], "bool | None"]
"""Called as `progress(done, total)` with items done; answering exactly `False` stops the call."""

_QUEUE_DEPTH = 4
"""Prepared batches the host thread may hold ahead of the device."""

_MAXSIM_BLOCK = 1 << 24
"""Similarity entries one block of `maxsim` holds at most (64 MiB of f32)."""

ERRORS = ("raise", "mask")
"""What a call does with a media item it cannot embed (`errors`): raise `MediaError`, or answer a mask."""

_INVALID_I8 = -128
"""The value of every entry of an invalid `Scalar.I8` row: outside the [-127, 127] that real rows take."""

DEFAULT_HOST_PROCESSES = 2
"""Host processes of a model on CUDA that does not say (`load(host_processes=None)`); measured in BENCHMARKS.md,
"Issue 12, seventeenth day"."""

# --------------------------------------------------------------------------------------------------
# Loading


def load(
    path: str | bytes | os.PathLike,
    executor: Executor | None = None,
    *,
    rows: int = 0,
    segments: int = 0,
    media: MediaPolicy | None = None,
    precision: str | None = None,
    compiled: bool | None = None,
    jpeg: str = "host",
    host_processes: int | None = None,
    progress: ProgressCallback | None = None,
    progress_steps: int = 0,
) -> Model:
    """The serving model of the trainer checkpoint at `path` (or of the model folder `uform.export` wrote there),
    on `executor`'s device (the CPU when None).

    `rows` and `segments` are one forward's capacity (zero derives the run's `max_rows_per_device` and
    `max_segments_per_device`); a row spans the run's `max_columns_per_row`, so items are cut as in training.
    `media` bounds media items (its limits and decoding workers; what a broken one does is each call's
    `errors`, and `strict=True` makes every call raise). `precision` is
    "bf16" (autocast, as the trainer's step) or "f32"; None derives bf16 on CUDA and f32 on the CPU.
    `compiled` compiles the forward with `torch.compile` and FlexAttention; None derives True on CUDA.
    `jpeg` is where JPEGs decode: "host" (the decoder processes, through Pillow, as training decodes them) or
    "device" (CUDA only, through torchvision's nvJPEG, for the JPEGs that need no more than decoding: baseline,
    YCbCr, upright, fitting a row; the others still on the host; `uform.device_pictures`). An H200 decodes ~4x
    the JPEGs a second of 16 host decoders; its pixels may differ from the host's by a few levels.
    `host_processes` runs the host stage (decode, sort, pack) of each call with media items in that many
    processes of their own (`uform.runtime.serve_host`; the decoders split among them), leaving this process's
    interpreter lock to the device's launches; 0 runs it here, on a thread (as a call of texts alone always
    runs). None derives 2 on CUDA where JPEGs decode on the host, else 0 (`jpeg="device"` decodes in this process,
    on its GPU). However many, an item's answer is the same (bitwise where the batches are).
    `progress(done, total)` counts the tensors read, at most `progress_steps` (zero derives ten) times.

    Raises `CheckpointError` (a `ValueError`) naming the file when it is not a whole, intact uform trainer
    checkpoint or exported model folder (`replica.stored_model`: weights, config and companion files checked
    against its digest); never unpickles anything.
    """
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path: expected a str, bytes or os.PathLike, got {type(path).__name__}")
    executor = Executor.cpu() if executor is None else executor
    if not isinstance(executor, Executor):
        raise TypeError(f"executor: expected an Executor, got {type(executor).__name__}")
    media = MediaPolicy() if media is None else media
    if not isinstance(media, MediaPolicy):
        raise TypeError(f"media: expected a MediaPolicy, got {type(media).__name__}")
    rows, segments = _natural(rows, "rows"), _natural(segments, "segments")
    steps = _natural(progress_steps, "progress_steps") or 10
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected a callable or None, got {type(progress).__name__}")
    device = executor.device
    bf16 = _precision(precision, device)
    compiled = device.type == "cuda" if compiled is None else compiled
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled: expected a bool or None, got {type(compiled).__name__}")
    decode = _jpeg_decoder(jpeg, device)
    if host_processes is None:
        host_processes = DEFAULT_HOST_PROCESSES if device.type == "cuda" and decode is None else 0
    host_processes = _natural(host_processes, "host_processes")
    if host_processes and decode is not None:
        raise ValueError('host_processes: jpeg="device" decodes in this process, on its GPU; pass host_processes=0')

    shown = os.fsdecode(os.fspath(path))
    # The header alone first, every field of it checked and the stored config's network against the tensors
    # the file holds; then the data, its digest verified; only then is anything built from the config.
    served = read_served(path, progress, steps)
    config, step = served.config, served.step
    network = Network(config)
    network.load_state_dict(served.weights, strict=True)
    del served
    network.requires_grad_(False)
    network.eval()
    network.to(device)
    return Model(
        network,
        config,
        device,
        rows=rows,
        segments=segments,
        media=media,
        bf16=bf16,
        compiled=compiled,
        path=shown,
        step=step,
        jpeg_decoder=decode,
        host_processes=host_processes,
        _token=_PRIVATE,
    )


def _jpeg_decoder(jpeg: Any, device: torch.device) -> device_pictures.Decoder | None:
    """The GPU JPEG decoder `load(jpeg=...)` asks for (None: the host's decoders)."""
    if jpeg not in ("host", "device"):
        raise ValueError(f'jpeg: must be "host" or "device", got {jpeg!r}')
    if jpeg == "host":
        return None
    if device.type != "cuda":
        raise ValueError(f'jpeg: "device" decodes on a CUDA device (nvJPEG); this model is on {device.type}')
    return device_pictures.nvjpeg(device)


def _natural(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{field}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{field}: must not be negative, got {value}")
    return int(value)


def _precision(precision: str | None, device: torch.device) -> bool:
    """Whether the forward runs under bf16 autocast."""
    if precision is None:
        return device.type == "cuda"
    if precision not in ("bf16", "f32"):
        raise ValueError(f"precision: expected 'bf16', 'f32' or None, got {precision!r}")
    return precision == "bf16"


# --------------------------------------------------------------------------------------------------
# One call's work, as the host thread hands it to the device


@dataclass
class _Job(CallItems):
    """A checked call: what to pack (`data.windows.CallItems`) and what to read out."""

    width: int = 0  # encode: the Matryoshka width
    errors: str = "raise"  # what a broken media item does (ERRORS)
    cut: int = 0  # text_choose: items whose head was cut before packing


@dataclass
class _Prepared:
    """One batch on the host, ready for the device."""

    members: np.ndarray  # [n] the call's items, in packing order
    tensors: dict[str, Tensor]
    picks: Tensor  # the rows the readout takes, page-locked on CUDA (so its copy waits on nothing): encode, each
    # member's segment slot [n]; tokens, the flat positions of every member's vectors [T]; choose, each MASK's [n]
    counts: np.ndarray  # tokens: [n] vectors per member
    truncated: int  # members cut to fit a row
    failed: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (item, reason): pictures the
    # device and the host both refused (`jpeg="device"`), answered invalid
    owners: list[Tensor] = dataclasses.field(default_factory=list)  # the tensors whose memory the media arrays
    # of `tensors` are (`_media_alloc`), held until the batch's device work is done


@dataclass
class _Run:
    """One call in a pipeline of calls (`Model._runs`): its batches' readouts as they land."""

    job: _Job
    points: list[int]  # where its progress reports
    answers: list[tuple[_Prepared, Any]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    truncated: int = 0  # items cut to fit a row (the call's own cut first)
    done: int = 0  # items handed to the device or skipped
    at: int = 0  # the next report point
    complete: bool = False  # every batch launched


# --------------------------------------------------------------------------------------------------
# The model


class Model:
    """A trained network served for inference; make one with `uform.load` (or `Model.from_trainer`).

    Verbs: `encode` (pooled embeddings), `tokens` and `maxsim` (late interaction), `text_choose` (calibrated
    choices). One call runs at a time per model (a lock serialises callers); `close` stops its decoders.
    """

    def __init__(
        self,
        network: Network,
        config: TrainerInitVramConfig,
        device: torch.device,
        *,
        rows: int,
        segments: int,
        media: MediaPolicy,
        bf16: bool,
        compiled: bool,
        path: str | None = None,
        step: int = 0,
        trainer: Any = None,
        notices: Notices | None = None,
        jpeg_decoder: device_pictures.Decoder | None = None,
        host_processes: int = 0,
        _token: object = None,
    ) -> None:
        if _token is not _PRIVATE:
            raise TypeError("Model: make one with uform.load(path, executor) or Model.from_trainer(trainer)")
        b = config.batch
        self.network = network
        self.config = config
        """The run's resolved config, as the checkpoint stored it."""
        self.device = device
        self.path = path
        """The checkpoint the model was loaded from (None for a trainer's live network)."""
        self._step = step
        self._trainer = trainer
        self.rows = rows or b.max_rows_per_device
        """Rows one forward packs at most."""
        self.columns = b.max_columns_per_row
        """Positions one item spans at most: the run's row, so items are cut where training cut them."""
        self.segments = segments or b.max_segments_per_device
        """Items one forward carries at most."""
        self.window = 2 * self.segments
        """Items decoded and sorted together (a call's memory for decoded media is bounded by this)."""
        self.media = media
        self.jpeg_decoder = jpeg_decoder
        """The GPU decoder of the JPEGs it may take (`load(jpeg="device")`); None: every image on the host."""
        self.bf16 = bf16
        self.compiled = compiled
        self._late = config.late_interaction.weight > 0
        self._prefix = len(vocab.prefix(Modality.Text, LateInteractionSide.None_ if self._late else None))
        self._live = media_features(config)
        # The run's config as packing sees it at serving: nothing corrupted, one bag per batch.
        self._serving = dataclasses.replace(
            config,
            objective=Objective.Contrastive,
            batch=dataclasses.replace(b, max_bags_per_device=0),
        )
        self.attention = "flex" if compiled and compiled_flex_available(device) else "dense"
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # batches cross on it
        self.packing = packing_rows(self.rows, self.columns) if self.attention == "flex" else (self.rows, self.columns)
        """(rows, columns) a batch packs into: `rows` x `columns` positions, in wider rows where the forward's
        attention is FlexAttention's (`packing_rows`); the dense path's mask grows as a row's width squared."""
        self._pooled_fn: Callable[..., Tensor] = self._pooled_forward
        self._states_fn: Callable[..., Tensor] = self._states_forward
        if compiled:
            self._pooled_fn = torch.compile(self._pooled_forward, dynamic=False)
            self._states_fn = torch.compile(self._states_forward, dynamic=False)
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread whose call (or stream) holds the lock
        self._decoders: DecodePool | None = None
        self.host_processes = host_processes
        """Processes a call's host stage runs in where it has media items (`load(host_processes=...)`; 0: this
        process); a model that keeps decoded units (`keep_decoded`) decodes here, in the process that keeps them."""
        self._serve_host: ServeHost | None = None
        self.keep_decoded = False
        """Whether the model keeps every media item's decoded units (or why it failed), by its bytes, for later
        calls on the same items: set by an evaluator that scores the same held-out items again and again."""
        self._decoded: dict[tuple[Modality, bytes], Units | str] = {}
        self.notices = Notices() if notices is None else notices
        """The model's warnings, each kind shown once and counted over its calls: `notices.counts()` answers
        {"media": items answered invalid under errors="mask", "capacity.truncated": items cut to a row}."""

    @classmethod
    def from_trainer(cls, trainer: Any, *, segments: int = 0) -> Model:
        """A model over a trainer's network, for evaluation during training, on a trainer of any number of
        devices. On one device it serves the live network (weights shared, never copied or changed): each call
        reads the weights as they are, in eval mode, and puts the network back in the mode it was in. Over
        several devices, whose networks live in the workers, it serves a copy of the weights as they stand after
        every step called so far (`Trainer.weights`), on the executor's first device; make a new model to see
        later steps. Runs eagerly with the dense attention path (bf16 autocast on CUDA, as training).
        Its warnings are the trainer's (`Trainer.notices`): evaluating every few steps warns once per run."""
        device = trainer.device
        config = trainer.config
        if trainer.executor.has_workers():
            weights = trainer.weights()
            network, live, step = weights.network(device), None, weights.step
        else:
            network, live, step = trainer.network, trainer, 0
        return cls._over(network, config, device, trainer.media, trainer.notices, segments, step, live)

    @classmethod
    def from_replica(cls, replica: Any, media: MediaPolicy, *, segments: int = 0) -> Model:
        """A model over one device's replica (`uform.replica.replica.Replica`: a device worker's, evaluating
        through the fleet), serving its live network as `from_trainer` does on one device; its warnings are
        the replica's (`Replica.notices`)."""
        return cls._over(replica.network, replica.config, replica.device, media, replica.notices, segments, 0, replica)

    @classmethod
    def _over(
        cls,
        network: Network,
        config: TrainerInitVramConfig,
        device: torch.device,
        media: MediaPolicy,
        notices: Notices,
        segments: int,
        step: int,
        live: Any,
    ) -> Model:
        return cls(
            network,
            config,
            device,
            rows=0,
            segments=min(_natural(segments, "segments") or 1 << 62, config.batch.max_segments_per_device),
            media=media,
            bf16=device.type == "cuda",
            compiled=False,
            step=step,
            trainer=live,
            notices=notices,
            _token=_PRIVATE,
        )

    @property
    def host_pids(self) -> list[int]:
        """The process ids of the host processes running now (none before a call with media items needed them)."""
        return [p.pid for p in self._serve_host.processes] if self._serve_host is not None else []

    @property
    def step(self) -> int:
        """The optimizer steps the run had taken when the checkpoint was saved (a trainer's: now)."""
        return self._trainer.steps_taken if self._trainer is not None else self._step

    @property
    def hidden(self) -> int:
        """The pooled embeddings' full width."""
        return self.config.hidden

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...]:
        """The widths the run trained (its Matryoshka prefixes and the full width)."""
        return tuple(sorted({*self.config.contrastive.matryoshka_dimensions, self.config.hidden}))

    def __repr__(self) -> str:
        where = self.path if self.path is not None else "a trainer's network"
        return (
            f"Model({where!r}, depth={self.config.depth}, hidden={self.hidden}, step={self.step}, "
            f"device={self.device}, capacity={self.rows}x{self.columns} / {self.segments} items)"
        )

    def close(self) -> None:
        """Stops the media decoders (started on the first media item) and the host processes (started by the first
        call that uses them); the model stays usable."""
        self._refuse_reentry("close")
        with self._lock:
            if self._decoders is not None:
                self._decoders.close()
                self._decoders = None
            if self._serve_host is not None:
                self._serve_host.close()
                self._serve_host = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- verbs -------------------------------------------------------------------------------------

    def encode(
        self,
        modalities: Any,
        contents: Any,
        width: int | None = None,
        *,
        sides: Any = (),
        arena: Arena | None = None,
        outputs_scalar: Scalar | str | int = Scalar.F32,
        errors: str = "raise",
        progress: ProgressCallback | None = None,
        progress_steps: int = 0,
    ) -> Any:
        """The L2-normalised pooled embeddings [N, width] of the items, on the host, in `outputs_scalar`.

        `modalities` and `contents` as a trainer step takes them. `width` (default the full width) keeps each
        embedding's first `width` values and re-normalises them (a Matryoshka prefix; the widths the run
        trained are `matryoshka_dimensions`). `sides` gives each item's late-interaction side (its prefix,
        where the run trained late interaction; empty is `None` for every item, as a step). With an `arena`
        the embeddings land there too (`arena.present` marks the rows that hold one). `progress(done, total)`
        counts items, at most `progress_steps` (zero: ten) reports, the last at completion; answering False
        raises `Stopped`, and the arena is left as it was.

        `errors` says what a media item that cannot be decoded (or breaks a limit) does: "raise" (the default)
        raises `MediaError` naming it before anything is answered; "mask" answers `(embeddings, valid)`,
        `valid` [N] bool False where an item could not be embedded, whose row is NaN (-128 under `Scalar.I8`),
        never a vector that looks real.

        On the same items and weights this answers what a `Contrastive` step's arena answered.
        """
        job = self._encode_job(modalities, contents, width, sides, "raise")
        if arena is not None and not isinstance(arena, Arena):
            raise TypeError(f"arena: expected an Arena, got {type(arena).__name__}")
        scalar = Scalar.parse(outputs_scalar, "outputs_scalar")
        job.errors = _check_errors(errors)
        steps = _check_progress(progress, progress_steps)
        return _embeddings(job, self._run(job, progress, steps), scalar, arena)

    def encode_stream(
        self,
        calls: Iterable[Any],
        width: int | None = None,
        *,
        outputs_scalar: Scalar | str | int = Scalar.F32,
        errors: str = "raise",
    ) -> Generator[Any, None, None]:
        """`encode` of each call of `calls`, answered in order: each call a `(modalities, contents)` pair,
        answered as `encode(modalities, contents, width, outputs_scalar=..., errors=...)` answers it, bitwise.

        One pipeline runs through them all: the next call's items are decoded and packed (and its first batches
        launched) while this call's last batches run on the device, so a stream of calls keeps the device busy
        where separate calls each wait for their first batch and drain their last (`uform encode` embeds its
        batches of records so). `calls` is pulled on the model's preparing thread, one call ahead of the device
        (a generator that reads files reads them there); a call it refuses raises, naming `calls[k]`, after the
        calls before it are answered. The model serves nothing else until the iterator is exhausted or closed: a
        call to it from inside the loop raises `RuntimeError` (another thread's call waits).
        """
        scalar, errors = Scalar.parse(outputs_scalar, "outputs_scalar"), _check_errors(errors)
        if width is not None:
            _check_width(width, self.hidden)
        if not isinstance(calls, Iterable) or isinstance(calls, (str, bytes, Mapping)):
            raise TypeError(f"calls: expected an iterable of (modalities, contents) pairs, got {type(calls).__name__}")

        def jobs() -> Iterator[_Job]:
            for k, call in enumerate(calls):
                if not isinstance(call, (tuple, list)) or len(call) != 2:
                    raise TypeError(f"calls[{k}]: expected a (modalities, contents) pair, got {type(call).__name__}")
                try:
                    yield self._encode_job(call[0], call[1], width, (), errors)
                except (TypeError, ValueError) as error:
                    kind = TypeError if isinstance(error, TypeError) else ValueError
                    raise kind(f"calls[{k}]: {error}") from error

        def answers() -> Generator[Any, None, None]:
            with contextlib.closing(self._runs(jobs(), None, 0)) as runs:
                for done in runs:
                    self._warn_run(done, 2)
                    yield _embeddings(done.job, done.answers, scalar, None)

        return answers()

    def _encode_job(self, modalities: Any, contents: Any, width: Any, sides: Any, errors: str) -> _Job:
        """One `encode` call's arguments checked into its job."""
        mods, items = self._items(modalities, contents)
        width = self.hidden if width is None else _check_width(width, self.hidden)
        return _Job("encode", mods, items, parse_sides(sides, len(mods)), width=int(width), errors=errors)

    def tokens(
        self,
        modalities: Any,
        contents: Any,
        side: Any,
        *,
        errors: str = "raise",
        progress: ProgressCallback | None = None,
        progress_steps: int = 0,
    ) -> Any:
        """The late-interaction vectors of each item, as a `(data, offsets)` tape: data [T, W] f32 on the
        host, L2-normalised rows; offsets [N + 1] int64, item i's vectors `data[offsets[i]:offsets[i + 1]]`.

        `side` (one `LateInteractionSide` for every item, or one per item) is the item's side marker and role:
        a `Query` answers its first `max_query_span` content positions past the prefix, a `Document` (and a
        `QueryAndDocument`, whose document role covers its query role) every content position, as the
        late-interaction loss scored them. Needs a checkpoint whose run trained late interaction
        (`late_interaction.weight > 0`).

        `errors` as `encode` takes it: "raise" (the default) raises `MediaError` naming a media item that
        cannot be decoded; "mask" answers `(data, offsets, valid)`, `valid` [N] bool False for such an item,
        which has no vectors.
        """
        if self.network.token_head is None:
            raise ValueError(
                "tokens: this checkpoint's run has late_interaction.weight 0, so it trained no token head; "
                "serve token vectors from a run that trained late interaction"
            )
        mods, items = self._items(modalities, contents)
        n = len(mods)
        sides = _parse_side(side, n)
        errors = _check_errors(errors)
        steps = _check_progress(progress, progress_steps)
        span = self.config.late_interaction.max_query_span
        limits = np.array([span if s == LateInteractionSide.Query else -1 for s in sides], dtype=np.int64)

        job = _Job("tokens", mods, items, sides, span=limits, errors=errors)
        width = self.config.late_interaction.width
        per_item: list[Tensor] = [torch.zeros(0, width)] * n
        valid = np.zeros(n, dtype=bool)
        for prepared, answer in self._run(job, progress, steps):
            for item, vectors in zip(prepared.members.tolist(), answer.split(prepared.counts.tolist()), strict=True):
                per_item[item] = vectors
            valid[prepared.members] = True
            for item, _ in prepared.failed:
                per_item[item], valid[item] = torch.zeros(0, width), False
        counts = np.array([len(v) for v in per_item], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        data = torch.cat(per_item) if n else torch.zeros(0, width)
        return (data, offsets, valid) if errors == "mask" else (data, offsets)

    def maxsim(self, queries: Any, documents: Any) -> Tensor:
        """Late-interaction scores [Q, N] (f32, host) of query tapes against document tapes (as `tokens`
        answers them): `score(q, d) = sum over q's vectors of the max over d's vectors of their dot product`.
        A query without vectors scores 0; so does every query vector against a document without vectors."""
        q, q_offsets = _vectors_tape(queries, "queries")
        d, d_offsets = _vectors_tape(documents, "documents")
        if q.shape[1] != d.shape[1]:
            raise ValueError(f"documents: vectors of width {d.shape[1]}, but the queries' are {q.shape[1]} wide")
        return maxsim_scores(q, q_offsets, d, d_offsets, self.device)

    def text_choose(
        self,
        texts: Any,
        choices: Any,
        *,
        progress: ProgressCallback | None = None,
        progress_steps: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The probability of each legal byte of each text, as a `(data, offsets)` tape shaped like `choices`
        (data f32, each item's entries summing to one; offsets int64, a copy of the choices' offsets).

        `texts`: a sequence of bytes or str (or a `(data, offsets)` tape); `choices`: each item's legal bytes,
        a `(data, offsets)` tape (data uint8) or a sequence of bytes-like, at least one and at most the run's
        `max_choices_per_item` (256 when zero) distinct bytes per item. As the choices loss reads them: the
        text's bytes then a MASK, the head of the text cut when the row is too short; `p` is the softmax over
        the legal bytes' logits of the masked text head at the MASK. Needs a run whose text head trained: a
        Masked or Joint run, or any run with a positive `choices.weight`.
        """
        if self.config.objective == Objective.Contrastive and self.config.choices.weight <= 0:
            raise ValueError(
                "text_choose: this checkpoint's run trained Objective.Contrastive alone without choices, so its "
                "masked text head never trained; choices need a Masked or Joint run, or choices.weight > 0"
            )
        items = _texts(texts)
        n = len(items)
        legal, offsets = _choices(choices, n, self.config.batch.max_choices_per_item or vocab.BYTES)
        steps = _check_progress(progress, progress_steps)
        room = self.columns - self._prefix - 1  # bytes of text a row holds beside the prefix and the MASK
        cut = [bytes(t[len(t) - room :]) if len(t) > room else bytes(t) for t in items]
        job = _Job("choose", [Modality.Text] * n, [t + b"\0" for t in cut], None, cut=sum(len(t) > room for t in items))
        data = np.zeros(int(offsets[-1]), dtype=np.float32)
        for prepared, logits in self._run(job, progress, steps):
            for item, row in zip(prepared.members.tolist(), logits, strict=True):
                a, b = int(offsets[item]), int(offsets[item + 1])
                chosen = row[torch.from_numpy(legal[a:b].astype(np.int64))]
                data[a:b] = torch.softmax(chosen.double(), dim=0).float().numpy()
        return data, offsets

    # ---- checks --------------------------------------------------------------------------------------

    def _items(self, modalities: Any, contents: Any) -> tuple[list[Modality], list[bytes | memoryview]]:
        mods = parse_modalities(modalities)
        items = parse_contents(contents, len(mods))
        for i, m in enumerate(mods):
            if m != Modality.Text and MEDIA_KINDS[m] not in self._live:
                slice_field = "chunk_samples" if m == Modality.Audio else "patch_side"
                raise ValueError(
                    f"modalities[{i}]: {m} items are out of this run (its batch.{m}.{slice_field} is zero)"
                )
        return mods, items

    # ---- the work ------------------------------------------------------------------------------------

    def _run(self, job: _Job, progress: ProgressCallback | None, steps: int) -> list[tuple[_Prepared, Any]]:
        """Every batch of the call through the device: answers (batch, readout) pairs once all are done."""
        with contextlib.closing(self._runs(iter([job]), progress, steps)) as runs:
            done = next(runs)
        self._warn_run(done, 3)
        return done.answers

    def _refuse_reentry(self, what: str) -> None:
        """A clear error, not a hang, for a call made while this thread's own call holds the model: from inside
        the loop over an `encode_stream`, or from a `progress` callback."""
        if self._holder == threading.get_ident():
            raise RuntimeError(
                f"Model: {what} while this thread's own call or encode_stream is still running on the model (a "
                "model serves one call at a time); finish or close the stream first, or use a second model"
            )

    def _warn_run(self, done: _Run, stacklevel: int) -> None:
        """The warnings of a finished call: its media that could not be decoded, its items cut to fit a row."""
        verb = _VERB_NAMES[done.job.verb]
        counted = f"the valid mask {verb} answers and Model.notices"
        warn_skipped(self.notices, done.skipped, done.job.modalities, counted, None, stacklevel + 1)
        advice = (
            f"a model serves at its run's batch.max_columns_per_row ({self.columns} positions a row, its prefix "
            f"included); train with a larger batch.max_columns_per_row to {verb} longer items whole. Counted in "
            "Model.notices"
        )
        warn_truncated(self.notices, done.truncated, len(done.job.modalities), verb, advice, stacklevel + 1)

    def _runs(self, jobs: Iterator[_Job], progress: ProgressCallback | None, steps: int) -> Generator[_Run, None, None]:
        """Every batch of every call of `jobs` through the device, one pipeline for them all: each call's
        `_Run` is answered once its last batch has landed, while the next call's first batches are prepared
        (and launched) behind it, so the device does not wait for a call's start between two calls. `jobs` is
        pulled on the preparing thread; what it raises comes after the calls before it. Holds the model's
        lock until closed."""
        self._refuse_reentry("a call")
        with self._lock:
            self._holder = threading.get_ident()
            handoff: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
            stop = threading.Event()
            host = threading.Thread(
                target=self._preparer_main, args=(jobs, handoff, stop), name="uform-serve-host", daemon=True
            )
            was_training = self.network.training
            self.network.eval()
            host.start()
            try:
                pending: collections.deque[_Run] = collections.deque()  # calls not yet answered, oldest first
                # One batch's readout stays in flight while the next batch is launched, so the device never
                # idles through a readback and the next launch (the trainer's deferred steps, for serving).
                landing: tuple[_Run, tuple[_Prepared, Tensor, Any]] | None = None
                run: _Run | None = None
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
                        run = _Run(job, sorted(report_points(len(job.modalities), steps)), truncated=job.cut)
                        pending.append(run)
                        continue
                    assert run is not None  # every other message follows its call's "job"
                    if kind == "done":
                        run.complete = True
                        if landing is not None and handoff.empty():  # nothing to launch behind it: land it now
                            landing[0].answers.append(_landed(landing[1]))
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
                            landing[0].answers.append(_landed(landing[1]))
                        landing = (run, launched)
                        run.truncated += prepared.truncated
                        run.skipped.extend(prepared.failed)
                        run.done += len(prepared.members)
                    if progress is not None and kind in ("batch", "skipped"):
                        self._progress(run, progress)
                    while pending and pending[0].complete and (landing is None or landing[0] is not pending[0]):
                        yield self._answered(pending.popleft(), progress)
                if landing is not None:
                    landing[0].answers.append(_landed(landing[1]))
                while pending and pending[0].complete:
                    yield self._answered(pending.popleft(), progress)
                if failure is not None:
                    raise failure
            finally:
                stop.set()
                while host.is_alive():  # let a host thread blocked on a full hand-off see the stop
                    with contextlib.suppress(queue.Empty):
                        handoff.get(timeout=0.05)
                host.join()
                self.network.train(was_training)
                self._holder = None

    @staticmethod
    def _progress(run: _Run, progress: ProgressCallback) -> None:
        """Reports `run`'s items done at its next report point(s); False from the callback stops the call."""
        total = len(run.job.modalities)
        if run.done < total and run.at < len(run.points) and run.done >= run.points[run.at]:
            while run.at < len(run.points) and run.points[run.at] <= run.done:
                run.at += 1
            if progress(run.done, total) is False:
                raise Stopped(f"{_VERB_NAMES[run.job.verb]} stopped at {run.done} of {total} items")

    @staticmethod
    def _answered(run: _Run, progress: ProgressCallback | None) -> _Run:
        """`run`, its last batch landed: the callback's last report first."""
        total = len(run.job.modalities)
        if progress is not None and progress(total, total) is False:
            raise Stopped(f"{_VERB_NAMES[run.job.verb]} stopped at {total} of {total} items")
        return run

    def _preparer_main(self, jobs: Iterator[_Job], handoff: queue.Queue, stop: threading.Event) -> None:
        """The preparing thread: each call of `jobs` as ("job", job), its batches, ("done",); ("end",) after
        the last; ("error", error) for what it raised."""
        try:
            for job in jobs:
                handoff.put(("job", job))
                with contextlib.closing(self._host(job, stop)) as messages:  # closed here: its decoding thread joins
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

    def _host(self, job: _Job, stop: threading.Event) -> Generator[tuple[str, Any], None, None]:
        """The prepare stage: windows of the call decoded, sorted and cut into prepared batches
        (`data.windows.call_batches`), in this process or, for a call with media, in the host processes (a text
        call's packing is short beside its forward, and ran 2% faster here: BENCHMARKS.md, "Issue 12, seventeenth
        day")."""
        remote = self.host_processes and not self.keep_decoded and self.jpeg_decoder is None
        if remote and any(m != Modality.Text for m in job.modalities):
            return self._remote(job, stop)

        def decode(window: range) -> tuple[dict[int, Units], list[tuple[int, str]], dict[int, Any]]:
            return self._decode(job, window)

        def pack(members: list[int], rows: int, units: dict[int, Units], pictures: dict[int, Any]) -> _Prepared:
            return self._prepare(job, members, rows, units, pictures)

        return call_batches(self._shape(), job, decode, pack, stop)

    def _remote(self, job: _Job, stop: threading.Event) -> Generator[tuple[str, Any], None, None]:
        """The prepare stage in the host processes (`runtime.serve_host`), as the model's attributes stand now:
        each batch copied out of its area there."""
        host = self._serve_host
        if host is None or host.count != self.host_processes or host.policy is not self.media:
            if host is not None:
                host.close()
            host = self._serve_host = ServeHost(self.media, self.host_processes)
        cuda = self.device.type == "cuda"
        for kind, value in host.batches(self._shape(), job, stop):
            if kind != "batch":
                yield kind, value
                continue
            packed: Packed = value  # views of the host process's area until the next message is asked for
            picks = torch.from_numpy(packed.picks)
            prepared = _Prepared(
                members=np.array(packed.members, copy=True),
                tensors=packed.batch.host_tensors(cuda, copy=True, tables=packed.tables or None),
                picks=picks.pin_memory() if cuda else picks.clone(),  # either way a copy of its own
                counts=np.array(packed.counts, copy=True),
                truncated=packed.truncated,
            )
            del packed, value
            yield kind, prepared

    def _shape(self) -> Packing:
        """How this model packs a call, as its attributes stand now."""
        return Packing(
            config=self._serving,
            columns=self.columns,
            prefix=self._prefix,
            segments=self.segments,
            packing=self.packing,
            fixed=self.compiled,
            flex=self.attention == "flex",
            window=self.window,
        )

    def _decode(
        self, job: _Job, window: range
    ) -> tuple[dict[int, Units], list[tuple[int, str]], dict[int, Tensor | None]]:
        """A window's media: the units of each item that decoded (a placeholder for a JPEG the device decodes),
        (item, reason) of each that did not, and the pictures the device decoded (None: refused), by item."""
        items = [i for i in window if job.modalities[i] != Modality.Text]
        pictures: dict[int, Tensor | None] = {}
        if not items:
            return {}, [], pictures
        keys = {i: (job.modalities[i], bytes(job.contents[i])) for i in items} if self.keep_decoded else {}
        kept = {i: self._decoded[k] for i, k in keys.items() if k in self._decoded}
        fresh = [i for i in items if i not in kept]
        units: dict[int, Units] = {i: u for i, u in kept.items() if not isinstance(u, str)}
        if self.jpeg_decoder is not None:  # JPEGs the device decodes: planned from their headers here
            planned = self._device_units(job, fresh)
            units.update(planned)
            fresh = [i for i in fresh if i not in planned]
            # Decoded here, on the decoding thread, while the window before is packed and the device runs it.
            sources = [plan.source for plan in planned.values() if plan.source is not None]
            pictures = dict(zip(planned, device_pictures.decode_all(sources, self.jpeg_decoder), strict=True))
        failed = [(i, u) for i, u in kept.items() if isinstance(u, str)]
        if fresh:
            if self._decoders is None:
                self._decoders = DecodePool(self.media.workers, self.media.limits.timeout_seconds)
            max_units = self.columns - self._prefix
            new_units, new_failed = decode_items(  # unkeyed: serving draws no masks
                self._decoders, self.media, self.config.batch, job.modalities, job.contents, fresh, max_units, False
            )
            if self.keep_decoded:  # kept for the evaluator's life: off the decoders' slabs, which they would hold
                new_units = {i: u.owned() for i, u in new_units.items()}
                self._decoded.update({keys[i]: u for i, u in new_units.items()})
                self._decoded.update({keys[i]: why for i, why in new_failed})
            units.update(new_units)
            failed.extend(new_failed)
        return units, sorted(failed), pictures

    def _picture_shape(self) -> dict[str, Any]:
        """What a picture decodes to at serving (the run's image slice, a row's room, the limits), as
        `device_pictures` takes it both when it plans a JPEG and when it falls back to the host path."""
        image = self.config.batch.image
        limits = self.media.limits
        return {
            "patch_side": image.patch_side,
            "channels": image.channels,
            "max_units": self.columns - self._prefix,
            "limits": limits,
        }

    def _device_units(self, job: _Job, items: list[int]) -> dict[int, Units]:
        shape = self._picture_shape()
        out = {}
        for i in items:
            if job.modalities[i] == Modality.Image:
                planned = device_pictures.device_units(bytes(job.contents[i]), **shape)
                if planned is not None:
                    out[i] = planned
        return out

    def _prepare(
        self,
        job: _Job,
        members: list[int],
        rows: int,
        units: dict[int, Units],
        pictures: dict[int, Tensor | None],
    ) -> _Prepared:
        """One batch packed (`data.windows.pack_batch`) into host tensors, page-locked on CUDA, where the JPEGs the
        device decodes are tiled into place."""
        cuda = self.device.type == "cuda"
        owners: list[Tensor] = []
        packed = pack_batch(self._shape(), job, members, rows, units, _media_alloc(owners, cuda))
        batch = packed.batch
        deferred = None
        if self.jpeg_decoder is not None and "image" in batch.media:
            parts = [(i, units[i]) for i in members if job.modalities[i] == Modality.Image]
            values = batch.media["image"]["values"]
            batch.media["image"]["values"], deferred = device_pictures.split(values, parts, cuda)
        tensors = batch.host_tensors(cuda, tables=packed.tables or None)
        failed: list[tuple[int, str]] = []
        if deferred is not None:  # tiled on the device, in the stream's order, after the batch before
            decoded = [pictures[i] for i in deferred.members]
            tensors["image.values"], failed = device_pictures.fill(
                deferred, tensors["image.values"], self.device, decoded, **self._picture_shape()
            )
            if failed and job.errors == "raise":
                item, reason = min(failed)
                raise MediaError(reason, item=item)
        picks = torch.from_numpy(packed.picks)
        return _Prepared(
            members=packed.members,
            tensors=tensors,
            picks=picks.pin_memory() if cuda else picks,
            counts=packed.counts,
            truncated=packed.truncated,
            failed=failed,
            owners=owners,
        )

    def _device(self, job: _Job, prepared: _Prepared) -> tuple[Tensor, Any]:
        """One batch's forward and readout, launched: answers the readout's host tensor and the CUDA event after
        which it holds the answer (None on the CPU, where it is ready); `_landed` waits for it."""
        device = self.device
        network = self.network
        inputs = self._inputs(prepared)
        # From page-locked memory: a copy from pageable memory would wait for the forward launched before it,
        # so the host could not prepare the next launch meanwhile (measured: 24 ms a text batch on the H200,
        # 15 ms of kernels).
        picks = prepared.picks.to(device, non_blocking=True)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
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

    def _inputs(self, prepared: _Prepared) -> DeviceBatch:
        """A prepared batch's host tensors on the device (`model.inputs.to_device`, as the trainer's step);
        the media units' counts dynamic where the forward is compiled."""
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        rotary = self.network.rotary
        return to_device(
            prepared.tensors,
            self.device,
            rotary,
            attention=self.attention,
            dtype=dtype,
            dynamic=self.compiled,
            copy_stream=self._copy_stream,
        )

    def _pooled_forward(self, batch: DeviceBatch) -> Tensor:
        states = self.network.states(batch)
        return self.network.pooled(states, batch.segments, batch.counts).float()

    def _states_forward(self, batch: DeviceBatch) -> Tensor:
        return self.network.states(batch)


def _landed(launched: tuple[_Prepared, Tensor, Any]) -> tuple[_Prepared, Tensor]:
    """A launched batch's (prepared, readout) once its device work is done (`Model._device`); its inputs'
    memory goes back to the host allocator's cache then, for the batches after it."""
    prepared, host, event = launched
    if event is not None:
        event.synchronize()
    prepared.tensors, prepared.owners = {}, []
    return prepared, host


def _media_alloc(owners: list[Tensor], pin: bool) -> Callable[[tuple[int, ...], type[np.generic]], np.ndarray]:
    """`data.batch.prepare`'s allocator of a batch's media arrays: numpy views of host tensors, page-locked on
    CUDA (`owners` keeps them). The units are written there once, straight from the decoders' slabs: a fresh
    numpy array of a batch's 37 MB of pixels paid the kernel's first-touch faults, then `host_tensors` copied it
    again into page-locked memory; PyTorch's page-locked blocks come back from its cache already mapped, and
    `pin_memory` of memory already page-locked is the tensor itself. Freed only once the batch's device work
    is done (`_landed`): a copy from such a view records no event of its own on the block."""

    def alloc(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        kind = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        tensor = torch.empty(shape, dtype=kind, pin_memory=pin)
        owners.append(tensor)
        return tensor.numpy()

    return alloc


_VERB_NAMES = {"encode": "encode", "tokens": "tokens", "choose": "text_choose"}
_PRIVATE = object()


# --------------------------------------------------------------------------------------------------
# Argument checks


def _check_width(width: Any, hidden: int) -> int:
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise TypeError(f"width: expected an int or None, got {type(width).__name__}")
    if not 1 <= width <= hidden:
        raise ValueError(f"width: must lie in [1, hidden = {hidden}], got {width}")
    return int(width)


def _embeddings(job: _Job, answers: list[tuple[_Prepared, Any]], scalar: Scalar, arena: Arena | None) -> Any:
    """What `encode` answers for `job` from its batches' readouts: the rows of items that could not be embedded
    NaN (-128 under `Scalar.I8`), never a vector that looks real; with `valid` where `errors` is "mask"."""
    n = len(job.modalities)
    # Written with numpy, whose copies run on the calling thread: torch's CPU index_put_ fans out to its
    # intra-op threads, which the decoders and the host stage keep busy, and took 2.7 ms a batch on the
    # H200's host (torch.profiler of an 8,192-text call: 265 ms of its 911).
    out = np.zeros((n, job.width), dtype=np.float32)
    valid = np.zeros(n, dtype=bool)
    for prepared, answer in answers:
        out[prepared.members] = answer.numpy()
        valid[prepared.members] = True
        valid[[item for item, _ in prepared.failed]] = False
    embeddings, present = torch.from_numpy(out), torch.from_numpy(valid)
    landed = arena.land(embeddings, present, scalar) if arena is not None else as_scalar(embeddings, scalar)
    if not valid.all():
        landed[~present] = _INVALID_I8 if scalar == Scalar.I8 else math.nan
    return (landed, present.clone()) if job.errors == "mask" else landed


def _check_errors(errors: Any) -> str:
    if not isinstance(errors, str):
        raise TypeError(f"errors: expected one of {ERRORS}, got {type(errors).__name__}")
    if errors not in ERRORS:
        raise ValueError(f"errors: expected one of {ERRORS}, got {errors!r}")
    return errors


def _check_progress(progress: Any, progress_steps: Any) -> int:
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected a callable or None, got {type(progress).__name__}")
    return _natural(progress_steps, "progress_steps") or 10


def _parse_side(side: Any, count: int) -> list[LateInteractionSide]:
    """One side for every item (a `LateInteractionSide`, its word or value) or a sequence of one per item."""
    if isinstance(side, (LateInteractionSide, str, int)):
        sides = [LateInteractionSide.parse(side, "side")] * count
        field = "side"
    elif isinstance(side, (Sequence, np.ndarray)):
        if len(side) != count:
            raise ValueError(f"side: {len(side)} values, but the call has {count} items; give one side or one per item")
        sides = parse_sides(side, count) or []
        field = "side[{}]"
    else:
        raise TypeError(f"side: expected a LateInteractionSide or one per item, got {type(side).__name__}")
    for i, s in enumerate(sides):
        if s == LateInteractionSide.None_:
            raise ValueError(
                f"{field.format(i)}: an item of side None takes no part in late interaction; "
                "ask for Query, Document or QueryAndDocument"
            )
    return sides


def _texts(texts: Any) -> list[bytes | memoryview]:
    if is_tape(texts):
        return list(tape_items(texts[0], texts[1], "texts"))
    if isinstance(texts, (str, bytes, bytearray, memoryview)) or not isinstance(texts, Sequence):
        raise TypeError(
            f"texts: expected a sequence of bytes or str, or a (data, offsets) tape, got {type(texts).__name__}"
        )
    out: list[bytes | memoryview] = []
    for i, t in enumerate(texts):
        if isinstance(t, str):
            out.append(t.encode("utf-8"))
        elif isinstance(t, (bytes, bytearray, memoryview)):
            out.append(bytes(t))
        else:
            raise TypeError(f"texts[{i}]: expected bytes-like or str, got {type(t).__name__}")
    return out


def _choices(choices: Any, count: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    """The legal bytes of each item as (uint8 data, int64 offsets [count + 1]), checked."""
    if is_tape(choices):
        parts = [np.frombuffer(v, dtype=np.uint8) for v in tape_items(choices[0], choices[1], "choices")]
    elif isinstance(choices, (str, bytes, bytearray, memoryview)) or not isinstance(choices, Sequence):
        raise TypeError(
            f"choices: expected a (data, offsets) tape or a sequence of legal bytes per item, got {type(choices).__name__}"
        )
    else:
        parts = []
        for i, c in enumerate(choices):
            if isinstance(c, str):
                c = c.encode("utf-8")
            if isinstance(c, (bytes, bytearray, memoryview)):
                parts.append(np.frombuffer(bytes(c), dtype=np.uint8))
            elif isinstance(c, np.ndarray) and c.dtype == np.uint8 and c.ndim == 1:
                parts.append(c.copy())
            else:
                raise TypeError(f"choices[{i}]: expected bytes-like (one legal byte each), got {type(c).__name__}")
    if len(parts) != count:
        raise ValueError(f"choices: {len(parts)} items, but texts has {count}; they must be the same length")
    for i, p in enumerate(parts):
        if len(p) == 0:
            raise ValueError(f"choices[{i}]: an item needs at least one legal byte")
        if len(p) > most:
            raise ValueError(f"choices[{i}]: {len(p)} legal bytes, more than max_choices_per_item = {most}")
        if len(np.unique(p)) != len(p):
            raise ValueError(f"choices[{i}]: each legal byte may appear once, got {bytes(p)!r}")
    offsets = np.zeros(count + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return data.astype(np.uint8), offsets


def _vectors_tape(tape: Any, field: str) -> tuple[Tensor, np.ndarray]:
    """A (data [T, W], offsets [N + 1]) tape of vectors, as `tokens` answers it; checked."""
    if not (isinstance(tape, tuple) and len(tape) == 2):
        raise TypeError(f"{field}: expected a (data, offsets) tape, as tokens answers it")
    data, offsets = tape
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if not isinstance(data, Tensor) or data.ndim != 2:
        raise TypeError(f"{field}: a tape's data must be a [vectors, width] tensor or array")
    if not data.is_floating_point():
        raise TypeError(f"{field}: a tape's data must hold float vectors, got {data.dtype}")
    offsets = offsets.numpy() if isinstance(offsets, Tensor) else np.asarray(offsets)
    if offsets.ndim != 1 or len(offsets) == 0 or offsets.dtype.kind not in "iu":
        raise TypeError(f"{field}: a tape's offsets must be a flat integer array of items + 1 entries")
    if offsets[0] != 0 or offsets[-1] != data.shape[0] or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{field}: a tape's offsets must rise from 0 to len(data) = {data.shape[0]}")
    return data, offsets.astype(np.int64)


# --------------------------------------------------------------------------------------------------
# MaxSim


def maxsim_scores(
    queries: Tensor, query_offsets: np.ndarray, documents: Tensor, document_offsets: np.ndarray, device: torch.device
) -> Tensor:
    """[Q, N] f32: for each query and document, the sum over the query's vectors of the best dot product
    with any of the document's (ColBERT's MaxSim, Khattab and Zaharia 2020). Blocks of whole documents keep
    each similarity block under `_MAXSIM_BLOCK` entries."""
    q_count, d_count = len(query_offsets) - 1, len(document_offsets) - 1
    scores = torch.zeros(q_count, d_count, dtype=torch.float32)
    if q_count == 0 or d_count == 0 or queries.shape[0] == 0:
        return scores
    q = queries.to(device, torch.float32)
    d = documents.to(device, torch.float32)
    query_of = torch.repeat_interleave(
        torch.arange(q_count, device=device), torch.from_numpy(np.diff(query_offsets)).to(device)
    )
    document_of = torch.repeat_interleave(
        torch.arange(d_count, device=device), torch.from_numpy(np.diff(document_offsets)).to(device)
    )
    budget = max(1, _MAXSIM_BLOCK // max(1, q.shape[0]))
    first = 0
    while first < d_count:
        last = first + 1
        while last < d_count and document_offsets[last + 1] - document_offsets[first] <= budget:
            last += 1
        a, b = int(document_offsets[first]), int(document_offsets[last])
        best = torch.full((q.shape[0], last - first), -math.inf, device=device)
        if b > a:
            similarity = q @ d[a:b].T  # [Tq, tokens of the block]
            column = (document_of[a:b] - first).expand(q.shape[0], -1)
            best = best.scatter_reduce(1, column, similarity, "amax", include_self=True)
        best = torch.where(torch.isinf(best), 0.0, best)  # a document without vectors adds nothing
        block = torch.zeros(q_count, last - first, device=device).index_add(0, query_of, best)
        scores[:, first:last] = block.cpu()
        first = last
    return scores
