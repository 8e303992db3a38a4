"""WebDataset tar shards: members grouped into records by key, the extension naming the field.

The key convention is webdataset's: a member `dir/cat.001.jpg` has the key `dir/cat` (its path up to the
first dot of its basename) and the field `001.jpg` (the rest). Members of one key are consecutive in a
well-formed shard; a key that comes back after another is a new record. Read with the stdlib `tarfile` in
streaming mode (`r|*`), so a shard is never held whole nor seeked (a URL streams through fsspec).
"""

from __future__ import annotations

import posixpath
import tarfile
from collections.abc import Iterator

from . import shards
from .record import KEY, Record


def split_key(member: str) -> tuple[str, str]:
    """(key, field) of a member name by webdataset's convention; a name without a dot has an empty field."""
    folder, base = posixpath.split(member)
    stem, dot, field = base.partition(".")
    return (posixpath.join(folder, stem) if folder else stem), field if dot else ""


def read_tar(shard: str) -> Iterator[Record]:
    """The records of one tar shard, in member order; every value bytes. Members whose basename starts with
    a dot (`._x`, metadata) and non-files are skipped."""
    with shards.open_binary(shard) as raw, tarfile.open(fileobj=raw, mode="r|*") as archive:
        record: Record | None = None
        for member in archive:
            if not member.isfile() or posixpath.basename(member.name).startswith("."):
                continue
            key, field = split_key(member.name)
            file = archive.extractfile(member)
            assert file is not None  # a regular file always extracts
            data = file.read()
            if record is None or record[KEY] != key:
                if record is not None:
                    yield record
                record = {KEY: key}
            if field in record:
                raise ValueError(f"{shard}: record {key} has two members for field {field!r}")
            record[field] = data
        if record is not None:
            yield record
