"""A source: a spec opened into shards, each read record by record when asked (never a dataset whole).

`open_source(spec, fields=...)` takes a path, a glob, a brace pattern, a list of them (each shard read by
the reader its name says: `.jsonl`, `.csv`, `.parquet`, `.tar` / `.tar.gz` / `.tgz`, or a folder), or
any re-iterable of records (a list of dicts, a Hugging Face `datasets.Dataset`: iterated as it is, so
`datasets` is never imported here), which is one shard.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import shards
from .fields import Fields
from .folder import read_folder
from .manifest import read_csv, read_jsonl
from .parquet import read_parquet
from .record import KEY, Record
from .tar import read_tar

READERS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".tar": "tar", ".tgz": "tar"}
"""The reader each shard name's ending selects (`.tar.gz` reads as a tar; a folder as a folder)."""


def reader_of(name: str) -> str:
    """The reader of shard `name`; `ValueError` for an ending none reads."""
    lower = name.lower().rstrip("/")
    if lower.endswith(".tar.gz"):
        return "tar"
    for ending, reader in READERS.items():
        if lower.endswith(ending):
            return reader
    if shards.is_folder(name):
        return "folder"
    raise ValueError(
        f"spec: {name!r} is none of the formats read (JSONL, CSV, Parquet, a WebDataset tar or a folder): "
        f"expected one of {sorted(READERS)} or a folder"
    )


@dataclass
class Shard:
    """One shard of a source: a file or folder read by `reader`, or an in-memory iterable."""

    name: str
    reader: str
    items: Iterable[Mapping[str, Any]] | None = None

    def records(self, media: frozenset[str]) -> Iterator[Record]:
        """The shard's records in its own order, streamed; `media` names the fields that are media."""
        if self.reader == "jsonl":
            return read_jsonl(self.name, media)
        if self.reader == "csv":
            return read_csv(self.name, media)
        if self.reader == "parquet":
            return read_parquet(self.name, media)
        if self.reader == "tar":
            return read_tar(self.name)
        if self.reader == "folder":
            return read_folder(self.name)
        return self._iterated()

    def _iterated(self) -> Iterator[Record]:
        assert self.items is not None
        for index, item in enumerate(self.items):
            if not isinstance(item, Mapping):
                raise TypeError(f"{self.name}[{index}]: a record is a mapping of fields, got {type(item).__name__}")
            record = dict(item)
            record.setdefault(KEY, f"{self.name}[{index}]")
            yield record


@dataclass
class Source:
    """The shards of a spec and the field mapping their records are read by."""

    shards: list[Shard]
    fields: Fields

    def records(self, shard: int) -> Iterator[Record]:
        """Shard `shard`'s records, streamed."""
        return self.shards[shard].records(self.fields.media)


def open_source(spec: Any, *, fields: Mapping[str, Any] | Fields) -> Source:
    """The `Source` of `spec` (see the module's docstring), its records read by `fields` (a mapping of field
    names to role words, `uform.sources.fields`). `ValueError` for a spec naming no shard or a format none
    reads, or a bad mapping; a one-shot iterator is a `TypeError` (a second epoch or a resume reads again)."""
    checked = fields if isinstance(fields, Fields) else Fields.parse(fields)
    if isinstance(spec, (str, os.PathLike)) or (
        isinstance(spec, (list, tuple)) and all(isinstance(s, (str, os.PathLike)) for s in spec)
    ):
        names = shards.expand(spec)
        return Source([Shard(name, reader_of(name)) for name in names], checked)
    if isinstance(spec, Iterable) and not isinstance(spec, (bytes, Mapping)):
        if iter(spec) is spec:
            raise TypeError(
                "spec: a one-shot iterator is read once; a source is read again each epoch and on a resume, so "
                "give a list, a dataset or another re-iterable"
            )
        return Source([Shard(type(spec).__name__, "iterable", spec)], checked)
    raise TypeError(
        f"spec: expected a path, a glob, a URL, a list of them or an iterable of records, got {type(spec).__name__}"
    )
