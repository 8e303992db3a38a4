"""A record as the readers answer it: a plain dict from field names to values, with its id under `KEY`.

Values are bytes (media, undecoded; text read from a file), str (inline text of a manifest), numbers or
lists (a manifest's JSON). A manifest's media path whose file is missing reads as a `Missing` value, so
that the loader skips the record (counted, warned once) at the very place it sat in the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEY = "__key__"
"""The field holding a record's id: `shard:line` for a manifest, the member key of a tar shard, the stem
of a folder's files, the row of a Parquet file, the index of an iterable; an `id` role overrides it."""

Record = dict[str, Any]
"""One record: field name to value, its id under `KEY`."""


@dataclass(frozen=True)
class Missing:
    """A media field whose file does not exist (a manifest's path)."""

    path: str
    """The path the manifest named, resolved against the manifest's folder."""


def record_id(record: Record) -> str:
    """The id a message names a record by."""
    return str(record.get(KEY, "?"))
