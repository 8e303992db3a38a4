"""JSONL and CSV manifests: one record per line (per row), media fields naming files relative to the
manifest, text fields inline.

CSV goes through the stdlib `csv` module (quoted fields, embedded commas and newlines); its header names
the fields. A JSONL line is one JSON object. Both stream line by line.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator

from . import shards
from .record import KEY, Missing, Record


def resolve_media(record: Record, media: frozenset[str], manifest: str) -> Record:
    """`record` with each media field read: reads each media field's file (a path relative to the manifest) as bytes; a missing one reads as
    `Missing`. A list of paths reads as a list."""
    for name in media & record.keys():
        value = record[name]
        paths = value if isinstance(value, list) else [value]
        read: list = []
        for path in paths:
            if not isinstance(path, str):
                raise ValueError(
                    f"record {record[KEY]}: field {name!r} is a media field, so it names a file relative to the "
                    f"manifest; got {type(path).__name__}"
                )
            full = shards.join(manifest, path)
            read.append(shards.read_bytes(full) if shards.exists(full) else Missing(full))
        record[name] = read if isinstance(value, list) else read[0]
    return record


def read_jsonl(manifest: str, media: frozenset[str]) -> Iterator[Record]:
    """The records of a JSONL manifest, in line order; blank lines are skipped; `ValueError` names the line
    of a line that is not a JSON object."""
    for number, line in enumerate(shards.lines(manifest), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{manifest}:{number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{manifest}:{number}: a record is a JSON object, got {type(record).__name__}")
        record.setdefault(KEY, f"{manifest}:{number}")
        yield resolve_media(record, media, manifest)


def read_csv(manifest: str, media: frozenset[str]) -> Iterator[Record]:
    """The records of a CSV manifest with a header row, in row order; every value a str (empty cells are
    left out of their record)."""
    with shards.open_binary(manifest) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        reader = csv.DictReader(text)
        for row in reader:
            if None in row:
                raise ValueError(f"{manifest}:{reader.line_num}: more cells than the header names")
            record: Record = {k: v for k, v in row.items() if v not in ("", None)}
            record[KEY] = f"{manifest}:{reader.line_num}"
            yield resolve_media(record, media, manifest)
