"""Parquet files through pyarrow (an optional extra, imported only when a Parquet shard is read), streamed
by batches of rows: a column of bytes holds media as they are, a column of strings holds inline text or,
for a media field, a path relative to the file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import shards
from .manifest import resolve_media
from .record import KEY, Record

BATCH_ROWS = 256
"""Rows read at a time: one batch is what a Parquet shard holds in memory beside its row group."""


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq  # local: an optional extra, imported only for a Parquet shard
    except ImportError:
        raise ValueError(
            "a Parquet shard needs pyarrow (pip install 'uform[sources]'), which is not installed"
        ) from None
    return pq


def read_parquet(shard: str, media: frozenset[str]) -> Iterator[Record]:
    """The records of a Parquet file, in row order (ids `shard#row`); a null cell is left out of its record."""
    pq = _pyarrow()
    with shards.open_binary(shard) as raw:
        file = pq.ParquetFile(raw)
        row = 0
        for batch in file.iter_batches(batch_size=BATCH_ROWS):
            for values in batch.to_pylist():
                record: Record = {k: v for k, v in values.items() if v is not None}
                record[KEY] = f"{shard}#{row}"
                row += 1
                paths = frozenset(name for name in media if isinstance(record.get(name), str))
                yield resolve_media(record, paths, shard)
