"""A vector index over `uform encode`'s output, queried with the same model: usearch (pip install "uform[index]").

    uform encode runs/model --input records.jsonl --output vectors.parquet --dtype i8
    python examples/vector_index.py build vectors.parquet vectors.usearch
    python examples/vector_index.py query runs/model vectors.usearch "a small red circle" --top 5

`build` reads the Parquet file (or a `.npy` with its `.ids.jsonl` and `.valid.npy` beside it), skips the null rows
of records that could not be embedded, and adds the rest under their row numbers to a cosine index of the file's
scalar type (i8 and f16 are stored as they are: usearch keeps i8 and f16 vectors natively, at a quarter and a half
of f32's memory); the ids go beside the index as `<index>.ids.json`. `query` encodes the query text with the model
at the index's width and scalar type, searches, and prints the nearest ids with their cosine distances.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_SCALARS = {"f32": np.float32, "f16": np.float16, "i8": np.int8}


def read_vectors(path: str) -> tuple[list[str], np.ndarray, np.ndarray, str]:
    """(ids, vectors [N, W], valid [N], dtype word) of `uform encode`'s output: Parquet or .npy."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        dtype = table.schema.metadata[b"uform.dtype"].decode()
        width = int(table.schema.metadata[b"uform.width"])
        column = table.column("embedding").combine_chunks()
        valid = ~np.asarray(column.is_null(), dtype=bool)
        flat = column.flatten().to_numpy(zero_copy_only=False)  # null rows carry no values in the child array
        vectors = np.zeros((len(valid), width), dtype=flat.dtype)
        vectors[valid] = flat.reshape(-1, width)
        return [str(i) for i in table.column("id").to_pylist()], vectors, valid, dtype
    stem = path[: -len(".npy")]
    vectors = np.load(path)
    ids = [json.loads(line) for line in Path(f"{stem}.ids.jsonl").read_text(encoding="utf-8").splitlines()]
    valid = np.load(f"{stem}.valid.npy")
    dtype = {np.dtype(v): k for k, v in _SCALARS.items()}.get(vectors.dtype, "bf16")
    return ids, vectors, valid, dtype


def build(vectors_path: str, index_path: str) -> int:
    """Builds the index of `vectors_path` at `index_path`; answers the vectors added."""
    from usearch.index import Index

    ids, vectors, valid, dtype = read_vectors(vectors_path)
    if dtype not in _SCALARS:
        raise ValueError(f"{vectors_path}: holds {dtype}; encode with --dtype i8, f16 or f32 for an index")
    index = Index(ndim=vectors.shape[1], metric="cos", dtype=dtype)
    rows = np.flatnonzero(valid)
    index.add(rows.astype(np.uint64), np.ascontiguousarray(vectors[rows]))
    index.save(index_path)
    Path(f"{index_path}.ids.json").write_text(json.dumps({"dtype": dtype, "ids": ids}), encoding="utf-8")
    return len(rows)


def query(model_path: str, index_path: str, texts: Sequence[str], top: int = 5) -> list[list[tuple[str, float]]]:
    """The `top` nearest ids (and cosine distances) of each text, encoded by the model at the index's width and
    scalar type."""
    from usearch.index import Index

    import uform

    index = Index.restore(index_path)
    sidecar = json.loads(Path(f"{index_path}.ids.json").read_text(encoding="utf-8"))
    with uform.load(model_path) as model:
        queries = model.encode(["text"] * len(texts), list(texts), index.ndim, outputs_scalar=sidecar["dtype"])
    matches = index.search(queries.numpy(), top)
    keys = np.atleast_2d(matches.keys)
    distances = np.atleast_2d(matches.distances)
    ids = sidecar["ids"]
    return [
        [(ids[int(k)], float(d)) for k, d in zip(row, gaps, strict=True) if d < np.inf]
        for row, gaps in zip(keys, distances, strict=True)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    making = commands.add_parser("build", help="index uform encode's output")
    making.add_argument("vectors", help="vectors.parquet or vectors.npy")
    making.add_argument("index", help="the index file to write")
    asking = commands.add_parser("query", help="the nearest records of query texts")
    asking.add_argument("model", help="the model folder (or checkpoint) that encoded the vectors")
    asking.add_argument("index", help="the index file")
    asking.add_argument("texts", nargs="+", help="query texts")
    asking.add_argument("--top", type=int, default=5)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(f"indexed {build(args.vectors, args.index)} vectors into {args.index}")
        return 0
    for text, found in zip(args.texts, query(args.model, args.index, args.texts, args.top), strict=True):
        print(text)
        for record, distance in found:
            print(f"  {distance:.4f}  {record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
