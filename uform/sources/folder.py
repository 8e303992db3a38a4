"""A plain folder of files grouped by stem: `cat.jpg` and `cat.txt` make one record, fields `jpg` and
`txt`, as a tar shard's members would (the stem is the name up to its first dot)."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator

from . import shards
from .record import KEY, Record
from .tar import split_key


def read_folder(folder: str) -> Iterator[Record]:
    """The records of a folder's files (not its subfolders), by stem in sorted order; every value bytes,
    read when its record is reached."""
    groups: dict[str, dict[str, str]] = {}
    for name in shards.listing(folder):
        base = posixpath.basename(name.replace("\\", "/"))
        if base.startswith("."):
            continue
        key, field = split_key(base)
        group = groups.setdefault(key, {})
        group[field] = name
    for key in sorted(groups):
        record: Record = {KEY: key}
        for field, name in sorted(groups[key].items()):
            record[field] = shards.read_bytes(name)
        yield record
