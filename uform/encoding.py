"""`uform.encode_file` (`uform encode`): one embedding per record of a JSONL, CSV or Parquet file, streamed into
Parquet or `.npy` (`embedding_writer`), at a Matryoshka width and a scalar type.

Records are read by the readers `uform train` uses (`uform.sources`: media fields name files relative to the
manifest; a Parquet cell may hold the bytes) and mapped by a field mapping as training maps them, restricted to
what an embedding needs: exactly one item field a record (text, image, video or audio), plus `id` and `ignore`.
The default mapping is `{"id": "id", "text": "text", "image": "image", "video": "video", "audio": "audio"}`;
a field it does not name is refused naming the field and the record, as in training.

Streaming: records are pulled from the reader a batch at a time, that batch is embedded (`Model.encode`, which
packs it into the model's capacity) and written, then the next is pulled; nothing holds more than one batch of
records, contents or vectors, whatever the input's size.

A record that cannot be embedded (its media file missing, undecodable, or past a limit) is written as a null row
(Parquet null; `.npy` NaN, -128 under i8, with `valid` False), never as a zero vector; its record id and reason
are reported: a `MediaWarning` naming the first (once per call, every one counted in the model's notices as
"encode.failed"), and the summary the call answers lists the first `MAX_REPORTED`.
"""

from __future__ import annotations

import math
import os
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
from .sources.fields import Fields, read_record
from .sources.record import Record
from .sources.source import Shard, open_source

__all__ = ["DEFAULT_FIELDS", "MAX_REPORTED", "EncodeSummary", "encode_file", "encode_records"]

DEFAULT_FIELDS = {"id": "id", "text": "text", "image": "image", "video": "video", "audio": "audio"}
"""The mapping `encode_file` reads records by when none is given."""
MAX_REPORTED = 20
"""Failed records a summary lists by id (every one is counted)."""
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
    (records, failed, the first `MAX_REPORTED` failures as (id, reason))."""
    total = failed = 0
    failures: list[tuple[str, str]] = []
    pending: list[Record] = []

    def flush() -> None:
        nonlocal total, failed
        ids: list[str] = []
        modalities: list[Modality] = []
        contents: list[bytes] = []
        sent: list[int] = []
        reasons: dict[int, str] = {}
        for record in pending:
            items = read_record(record, fields)
            count = len(items.modalities) + (items.missing is not None)
            if count != 1:
                raise ValueError(
                    f"record {items.id}: {count} items; encode embeds one item a record (map the other item "
                    'fields to "ignore", or write one record per item)'
                )
            if items.missing is not None:
                reasons[len(ids)] = f"missing file {items.missing}"
            else:
                sent.append(len(ids))
                modalities.append(items.modalities[0])
                contents.append(items.contents[0])
            ids.append(items.id)
        pending.clear()
        n = len(ids)
        out = torch.full((n, width), _invalid(scalar), dtype=_torch_dtype(scalar))
        valid = torch.zeros(n, dtype=torch.bool)
        if sent:
            embedded, ok = model.encode(modalities, contents, width, outputs_scalar=scalar, errors="mask")
            at = torch.tensor(sent, dtype=torch.long)
            out[at] = embedded
            valid[at] = ok
            for k in torch.nonzero(~ok).flatten().tolist():
                reasons[sent[k]] = _reason(model, modalities[k], contents[k], width)
        for row in sorted(reasons):
            failed += 1
            if len(failures) < MAX_REPORTED:
                failures.append((ids[row], reasons[row]))
            model.notices.warn(
                "encode.failed",
                f"encode: record {ids[row]} could not be embedded ({reasons[row]}); its row is written null "
                "(Parquet null; .npy NaN, -128 under i8, valid False). Further ones are counted, not shown",
                MediaWarning,
                stacklevel=4,
            )
        writer.write(ids, out, valid)
        total += n
        if bar is not None:
            bar.update(n)

    for record in records:
        pending.append(record)
        if len(pending) == batch:
            flush()
    if pending:
        flush()
    return total, failed, failures


def _reason(model: Model, modality: Modality, content: bytes, width: int) -> str:
    """Why one item could not be embedded: the item alone, asked to raise (only failed items pay this)."""
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
    batch: int = 256,
    executor: Executor | None = None,
    progress: bool = False,
    jpeg: str = "host",
) -> EncodeSummary:
    """Embeds every record of `input` into `output` (see the module docstring) and answers what it wrote.

    `model`: a `Model`, or the path of an exported model folder or a trainer checkpoint (loaded with `uform.load`
    on `executor`: None picks the first CUDA device where there is one, else the CPU). `input`: a JSONL, CSV or
    Parquet path (or glob), or any iterable of records. `output`: `.parquet` or `.npy`. `fields`: the mapping
    (default `DEFAULT_FIELDS`). `width`: a Matryoshka width (default the full width); `dtype`: "f32", "f16",
    "bf16" or "i8"; `batch`: records embedded at once; `progress`: a tqdm bar on stderr; `jpeg`: where a model
    loaded here decodes JPEGs ("host" or "device", as `uform.load` takes it; a `Model` keeps its own).

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
        chosen = model.hidden if width is None else width
        if isinstance(chosen, bool) or not isinstance(chosen, int) or not 1 <= chosen <= model.hidden:
            raise ValueError(f"width: must be an int in [1, hidden = {model.hidden}], got {width!r}")
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
