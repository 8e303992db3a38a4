"""`uform.encode_file` (`uform encode`): one embedding per record of a JSONL, CSV or Parquet file, streamed into
Parquet or `.npy` (`embedding_writer`), at a Matryoshka width and a scalar type.

Records are read by the readers `uform train` uses (`uform.sources`: media fields name files relative to the
manifest; a Parquet cell may hold the bytes) and mapped by a field mapping as training maps them, restricted to
what an embedding needs: exactly one item field a record (text, image, video or audio), plus `id` and `ignore`.
The default mapping is `{"id": "id", "text": "text", "image": "image", "video": "video", "audio": "audio"}`;
a field it does not name is refused naming the field and the record, as in training.

Streaming: records are pulled from the reader a batch at a time (`batch` records, or fewer once their items
reach `BATCH_BYTES`), embedded (packed into the model's capacity) and written. The batches go through the model
as one stream of calls (`Model.encode_stream`: the next batch is decoded and packed while this one's last
device batches run), and the batch after that is read on a thread of its own meanwhile, so its files are read
while the device works. Nothing holds more than three batches
of records and contents, or one of vectors, whatever the input's size.

A record that cannot be embedded (its media file missing, undecodable, or past a limit) is written as a null row
(Parquet null; `.npy` NaN, -128 under i8, with `valid` False), never as a zero vector; its record id and reason
are reported: a `MediaWarning` naming the first (once per call, every one counted in the model's notices as
"encode.failed"), and the summary the call answers lists the first `MAX_REPORTED`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from .embedding_writer import open_writer
from .enums import Modality, Scalar
from .media.limits import MediaError
from .notices import MediaWarning
from .runtime.executor import Executor
from .serve import Model, load
from .serve_args import check_width
from .sources.fields import Fields, read_record
from .sources.record import Record
from .sources.source import Shard, open_source

__all__ = [
    "BATCH_BYTES",
    "DEFAULT_BATCH",
    "DEFAULT_FIELDS",
    "MAX_REPORTED",
    "EncodeSummary",
    "encode_file",
    "encode_records",
]

DEFAULT_FIELDS = {"id": "id", "text": "text", "image": "image", "video": "video", "audio": "audio"}
"""The mapping `encode_file` reads records by when none is given."""
MAX_REPORTED = 20
"""Failed records a summary lists by id (every one is counted)."""
DEFAULT_BATCH = 4096
"""Records a batch holds by default: every `Model.encode` call pays a start (its first batch decoded and packed)
and a tail (the device draining), so calls of 256 JPEGs ran at 1,787 a second on the H200 and calls of 4,096 at
4,971 (BENCHMARKS.md, "Issue 12, nineteenth day")."""
BATCH_BYTES = 256 << 20
"""A batch is also closed once its items' bytes reach this (256 MiB), so batches of large media (video) stay
bounded in memory whatever `batch` says."""
_POLL_S = 0.05
"""How often a reader waiting for its batch to be taken looks for a stop."""
_DTYPES = {"f32": Scalar.F32, "f16": Scalar.F16, "bf16": Scalar.BF16, "i8": Scalar.I8}


@dataclass
class EncodeSummary:
    """What an `encode_file` call wrote."""

    output: str
    records: int
    """Rows written, one per record."""
    failed: int
    """Records that could not be embedded (null rows)."""
    width: int
    dtype: str
    failures: list[tuple[str, str]] = field(default_factory=list)
    """The first `MAX_REPORTED` failed records: (record id, reason)."""


def _fields(mapping: Mapping[str, Any] | None) -> Fields:
    parsed = Fields.parse(DEFAULT_FIELDS if mapping is None else mapping)
    for name, role in parsed.roles.items():
        if role.modality is None and role.kind not in ("id", "ignore"):
            raise ValueError(f'fields.{name}: {role.kind!r} plays no part in an embedding; map it to "ignore"')
        if role.modality is not None and role.kind != "positive":
            raise ValueError(
                f"fields.{name}: encode embeds items by modality alone; map it to {role.modality.name.lower()!r}"
            )
    return parsed


def _records(input: Any, fields: Fields) -> Iterator[Record]:
    """The input's records, streamed: a path (or glob) through `open_source`, or any iterable of records (a
    generator too: read once)."""
    if isinstance(input, (str, os.PathLike)):
        source = open_source(os.fspath(input), fields=fields)
        for shard in range(len(source.shards)):
            yield from source.records(shard)
    elif isinstance(input, Iterable) and not isinstance(input, (bytes, Mapping)):
        yield from Shard("records", "iterable", input).records(fields.media)
    else:
        raise TypeError(f"input: expected a path or an iterable of records, got {type(input).__name__}")


def _invalid(scalar: Scalar) -> float:
    return -128 if scalar == Scalar.I8 else math.nan


def encode_records(
    model: Model,
    records: Iterable[Record],
    writer: Any,
    fields: Fields,
    width: int,
    scalar: Scalar,
    batch: int,
    bar: Any = None,
) -> tuple[int, int, list[tuple[str, str]]]:
    """Embeds `records` a `batch` at a time into `writer` (an `embedding_writer.EmbeddingWriter`); answers
    (records, failed, the first `MAX_REPORTED` failures as (id, reason)). The next batch is read on a thread of
    its own while this one is embedded (`_ReadAhead`), and the batches go through the model as one stream of
    calls (`Model.encode_stream`), so the device does not wait for each batch's start."""
    total = failed = 0
    # The first MAX_REPORTED failures: [id, reason, modality, content]; a reason the decoder gave is asked for
    # once the stream is done (the model serves one caller at a time), so only these few items are held.
    first: list[list[Any]] = []
    ahead = _ReadAhead(_batches(records, fields, batch))
    read: collections.deque[_Batch] = collections.deque()  # batches pulled, not yet written, in order

    def calls() -> Iterator[tuple[list[Modality], list[bytes]]]:  # pulled on the model's preparing thread
        for pending in ahead:
            read.append(pending)
            if pending.sent:
                yield pending.modalities, pending.contents

    def write(pending: _Batch, embedded: torch.Tensor | None = None, ok: torch.Tensor | None = None) -> None:
        nonlocal total, failed
        n = len(pending.ids)
        out = torch.full((n, width), _invalid(scalar), dtype=_torch_dtype(scalar))
        valid = torch.zeros(n, dtype=torch.bool)
        broken: dict[int, tuple[str | None, Modality | None, bytes]] = {
            row: (reason, None, b"") for row, reason in pending.reasons.items()
        }
        if embedded is not None and ok is not None:
            at = torch.tensor(pending.sent, dtype=torch.long)
            out[at] = embedded
            valid[at] = ok
            for k in torch.nonzero(~ok).flatten().tolist():
                broken[pending.sent[k]] = (None, pending.modalities[k], pending.contents[k])
        for row in sorted(broken):
            failed += 1
            if len(first) < MAX_REPORTED:
                first.append([pending.ids[row], *broken[row]])
        writer.write(pending.ids, out, valid)
        total += n
        if bar is not None:
            bar.update(n)

    try:
        stream = model.encode_stream(calls(), width, outputs_scalar=scalar, errors="mask")
        with contextlib.closing(stream):
            for embedded, ok in stream:
                while not read[0].sent:  # batches of missing files alone, read before this one
                    write(read.popleft())
                write(read.popleft(), embedded, ok)
        while read:
            write(read.popleft())
    finally:
        ahead.close()
    for entry in first:
        if entry[1] is None:
            entry[1] = _reason(model, entry[2], entry[3], width)
    if failed:  # the first shown, every one counted
        record, reason = first[0][0], first[0][1]
        model.notices.warn(
            "encode.failed",
            f"encode: record {record} could not be embedded ({reason}); its row is written null (Parquet null; "
            ".npy NaN, -128 under i8, valid False). Further ones are counted, not shown",
            MediaWarning,
            count=failed,
            stacklevel=3,
        )
    return total, failed, [(entry[0], entry[1]) for entry in first]


@dataclass
class _Batch:
    """One batch of records as read: every record's id, and the items of those that have one to send."""

    ids: list[str] = field(default_factory=list)
    modalities: list[Modality] = field(default_factory=list)
    contents: list[bytes] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    """The row (in `ids`) of each item sent."""
    reasons: dict[int, str] = field(default_factory=dict)
    """Why each row not sent has no item (its media file is missing)."""
    size: int = 0
    """Bytes of `contents`."""


def _batches(records: Iterable[Record], fields: Fields, batch: int) -> Iterator[_Batch]:
    """`records` read (`read_record`: a record's media files are read here) into batches of `batch` records,
    each closed early once its contents reach `BATCH_BYTES`."""
    pending = _Batch()
    iterator = iter(records)
    try:
        for record in iterator:
            items = read_record(record, fields)
            count = len(items.modalities) + (items.missing is not None)
            if count != 1:
                raise ValueError(
                    f"record {items.id}: {count} items; encode embeds one item a record (map the other item "
                    'fields to "ignore", or write one record per item)'
                )
            if items.missing is not None:
                pending.reasons[len(pending.ids)] = f"missing file {items.missing}"
            else:
                pending.sent.append(len(pending.ids))
                pending.modalities.append(items.modalities[0])
                pending.contents.append(items.contents[0])
                pending.size += len(items.contents[0])
            pending.ids.append(items.id)
            if len(pending.ids) == batch or pending.size >= BATCH_BYTES:
                yield pending
                pending = _Batch()
        if pending.ids:
            yield pending
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:  # a source's own cleanup (its open files) runs here, not whenever it is collected
            close()


class _ReadAhead:
    """An iterator run on a thread of its own, one element ahead of its consumer: a batch's records and files
    are read while the model works on the batches before it. What the iterator raises is raised to the consumer
    after the elements before it, as it would have been without the thread; `close` stops the thread once its
    element in hand is read (or within `_POLL_S` while it waits for one to be taken) and joins it."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._taken = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(source,), name="uform-encode-reader", daemon=True)
        self._thread.start()

    def _main(self, source: Iterator[Any]) -> None:
        try:
            for element in source:
                if not self._put(("element", element)):
                    return
            self._put(("done", None))
        except BaseException as error:  # handed to the consumer, which raises it
            self._put(("error", error))
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a generator's own cleanup (open files) runs on the thread that ran it
                close()

    def _put(self, message: tuple[str, Any]) -> bool:
        """Hands `message` over and waits until it is taken, so the thread reads the element after it only
        while the consumer works on this one: two elements held at most. False: stopped first."""
        self._taken.clear()
        self._queue.put(message)
        while not self._taken.wait(_POLL_S):
            if self._stop.is_set():
                return False
        return True

    def __iter__(self) -> Iterator[Any]:
        while True:
            kind, value = self._queue.get()
            self._taken.set()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _reason(model: Model, modality: Modality, content: bytes, width: int) -> str:
    """Why one item could not be embedded: the item alone, asked to raise (only the first `MAX_REPORTED` failed
    items of an `encode_records` call pay this)."""
    try:
        model.encode([modality], [content], width, errors="raise")
    except MediaError as error:
        return error.reason
    return "could not be embedded"  # pragma: no cover - an item fails alone as it failed in its batch


def _torch_dtype(scalar: Scalar) -> torch.dtype:
    return {Scalar.F32: torch.float32, Scalar.F16: torch.float16, Scalar.BF16: torch.bfloat16, Scalar.I8: torch.int8}[
        scalar
    ]


def encode_file(
    model: Any,
    input: Any,
    output: str | os.PathLike,
    *,
    fields: Mapping[str, Any] | None = None,
    width: int | None = None,
    dtype: str = "f32",
    batch: int = DEFAULT_BATCH,
    executor: Executor | None = None,
    progress: bool = False,
    jpeg: str = "host",
) -> EncodeSummary:
    """Embeds every record of `input` into `output` (see the module docstring) and answers what it wrote.

    `model`: a `Model`, or the path of an exported model folder or a trainer checkpoint (loaded with `uform.load`
    on `executor`: None picks the first CUDA device where there is one, else the CPU). `input`: a JSONL, CSV or
    Parquet path (or glob), or any iterable of records. `output`: `.parquet` or `.npy`. `fields`: the mapping
    (default `DEFAULT_FIELDS`). `width`: a Matryoshka width (default the full width); `dtype`: "f32", "f16",
    "bf16" or "i8"; `batch`: records embedded at once (fewer once their bytes reach `BATCH_BYTES`); `progress`: a
    tqdm bar on stderr; `jpeg`: where a model loaded here decodes JPEGs ("host" or "device", as `uform.load` takes
    it; a `Model` keeps its own).

    Every argument is checked before anything is read or written; the output appears whole, or not at all.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {list(_DTYPES)}, got {dtype!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: expected a positive int, got {batch!r}")
    if not isinstance(output, (str, os.PathLike)) or not isinstance(os.fspath(output), str):
        raise TypeError(f"output: expected a str path, got {type(output).__name__}")
    target = os.fspath(output)
    if not target.lower().endswith((".parquet", ".npy")):
        raise ValueError(f"output: {target!r} must end in .parquet or .npy")
    if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
        raise FileNotFoundError(f"output: its folder {os.path.dirname(os.path.abspath(target))} does not exist")
    if executor is not None and not isinstance(executor, Executor):
        raise TypeError(f"executor: expected an Executor or None, got {type(executor).__name__}")
    mapping = _fields(fields)
    scalar = _DTYPES[dtype]
    owned = not isinstance(model, Model)
    made = owned and executor is None
    if owned:
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model: expected a Model or a path, got {type(model).__name__}")
        if executor is None:
            executor = Executor.for_vram([0]) if torch.cuda.is_available() else Executor.cpu()
        try:
            model = load(model, executor, jpeg=jpeg)
        except BaseException:
            if made:
                executor.close()
            raise
    try:
        chosen = model.hidden if width is None else check_width(width, model.hidden)
        writer = open_writer(target, chosen, scalar)
        bar = tqdm(desc="uform encode", unit="records", disable=not progress, dynamic_ncols=True)
        try:
            records, failed, failures = encode_records(
                model, _records(input, mapping), writer, mapping, chosen, scalar, batch, bar
            )
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        writer.close()
    finally:
        if owned:
            model.close()
        if made and executor is not None:
            executor.close()
    return EncodeSummary(target, records, failed, chosen, dtype, failures)
