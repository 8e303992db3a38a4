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
`uform.runtime.serve_host`: each takes a contiguous share of the call, and each batch they pack crosses to the
GPU from their output area, page-locked in place, `page_locks`), so this process's interpreter lock is left to
the device's launches.
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

Beside this file: the verbs' argument checks (`serve_args`), a call's job, batches and answer (`serve_call`), the
pipeline its calls run through, host thread to device to answers (`serve_pipeline`), the host stage of its calls
(`serve_stage`) and MaxSim's scores (`maxsim`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import device_pictures, vocab
from .arena import Arena
from .config import TrainerInitVramConfig
from .data.batch import MEDIA_KINDS, media_features
from .data.items import parse_contents, parse_modalities, parse_sides
from .data.windows import packing_rows
from .enums import LateInteractionSide, Modality, Objective, Scalar
from .maxsim import maxsim_scores
from .media.decode import MediaPolicy
from .model.attention import compiled_flex_available
from .model.network import Network
from .notices import Notices
from .replica.stored_model import read_served
from .runtime.executor import Executor
from .serve_args import (
    ProgressCallback,
    check_errors,
    check_progress,
    check_width,
    natural,
    parse_choices,
    parse_side,
    parse_texts,
    precision_bf16,
    vectors_tape,
)
from .serve_call import Job, embeddings
from .serve_pipeline import Pipeline
from .serve_stage import HostStage

__all__ = ["Model", "load"]

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
    rows, segments = natural(rows, "rows"), natural(segments, "segments")
    steps = check_progress(progress, progress_steps)
    device = executor.device
    bf16 = precision_bf16(precision, device)
    compiled = device.type == "cuda" if compiled is None else compiled
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled: expected a bool or None, got {type(compiled).__name__}")
    decode = _jpeg_decoder(jpeg, device)
    if host_processes is None:
        host_processes = DEFAULT_HOST_PROCESSES if device.type == "cuda" and decode is None else 0
    host_processes = natural(host_processes, "host_processes")
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
        self.attention = "flex" if compiled and compiled_flex_available(device) else "dense"
        self.packing = packing_rows(self.rows, self.columns) if self.attention == "flex" else (self.rows, self.columns)
        """(rows, columns) a batch packs into: `rows` x `columns` positions, in wider rows where the forward's
        attention is FlexAttention's (`packing_rows`); the dense path's mask grows as a row's width squared."""
        self._stage = HostStage()  # its decoders, host processes and kept units
        self._pipeline = Pipeline(self, self._stage, prefix=self._prefix)  # how its calls run
        self.host_processes = host_processes
        """Processes a call's host stage runs in where it has media items (`load(host_processes=...)`; 0: this
        process); a model that keeps decoded units (`keep_decoded`) decodes here, in the process that keeps them."""
        self.keep_decoded = False
        """Whether the model keeps every media item's decoded units (or why it failed), by its bytes, for later
        calls on the same items: set by an evaluator that scores the same held-out items again and again."""
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
            segments=min(natural(segments, "segments") or 1 << 62, config.batch.max_segments_per_device),
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
        host = self._stage.serve_host
        return [p.pid for p in host.processes] if host is not None else []

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
        self._pipeline.refuse_reentry("close")
        with self._pipeline.lock:
            self._stage.close()

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
        job.errors = check_errors(errors)
        steps = check_progress(progress, progress_steps)
        return embeddings(job, self._pipeline.run(job, progress, steps), scalar, arena)

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
        scalar, errors = Scalar.parse(outputs_scalar, "outputs_scalar"), check_errors(errors)
        if width is not None:
            check_width(width, self.hidden)
        if not isinstance(calls, Iterable) or isinstance(calls, (str, bytes, Mapping)):
            raise TypeError(f"calls: expected an iterable of (modalities, contents) pairs, got {type(calls).__name__}")

        def jobs() -> Iterator[Job]:
            for k, call in enumerate(calls):
                if not isinstance(call, (tuple, list)) or len(call) != 2:
                    raise TypeError(f"calls[{k}]: expected a (modalities, contents) pair, got {type(call).__name__}")
                try:
                    yield self._encode_job(call[0], call[1], width, (), errors)
                except (TypeError, ValueError) as error:
                    kind = TypeError if isinstance(error, TypeError) else ValueError
                    raise kind(f"calls[{k}]: {error}") from error

        def answers() -> Generator[Any, None, None]:
            with contextlib.closing(self._pipeline.runs(jobs(), None, 0)) as runs:
                for done in runs:
                    self._pipeline.warn(done, 2)
                    yield embeddings(done.job, done.answers, scalar, None)

        return answers()

    def _encode_job(self, modalities: Any, contents: Any, width: Any, sides: Any, errors: str) -> Job:
        """One `encode` call's arguments checked into its job."""
        mods, items = self._items(modalities, contents)
        width = self.hidden if width is None else check_width(width, self.hidden)
        return Job("encode", mods, items, parse_sides(sides, len(mods)), width=int(width), errors=errors)

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
        sides = parse_side(side, n)
        errors = check_errors(errors)
        steps = check_progress(progress, progress_steps)
        span = self.config.late_interaction.max_query_span
        limits = np.array([span if s == LateInteractionSide.Query else -1 for s in sides], dtype=np.int64)

        job = Job("tokens", mods, items, sides, span=limits, errors=errors)
        width = self.config.late_interaction.width
        per_item: list[Tensor] = [torch.zeros(0, width)] * n
        valid = np.zeros(n, dtype=bool)
        for prepared, answer in self._pipeline.run(job, progress, steps):
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
        q, q_offsets = vectors_tape(queries, "queries")
        d, d_offsets = vectors_tape(documents, "documents")
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
        items = parse_texts(texts)
        n = len(items)
        legal, offsets = parse_choices(choices, n, self.config.batch.max_choices_per_item or vocab.BYTES)
        steps = check_progress(progress, progress_steps)
        room = self.columns - self._prefix - 1  # bytes of text a row holds beside the prefix and the MASK
        cut = [bytes(t[len(t) - room :]) if len(t) > room else bytes(t) for t in items]
        job = Job("choose", [Modality.Text] * n, [t + b"\0" for t in cut], None, cut=sum(len(t) > room for t in items))
        data = np.zeros(int(offsets[-1]), dtype=np.float32)
        for prepared, logits in self._pipeline.run(job, progress, steps):
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


_PRIVATE = object()
