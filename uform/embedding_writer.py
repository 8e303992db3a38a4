"""Where `uform encode` writes its embeddings, a batch at a time: Parquet or `.npy`, never more than one batch in
memory, the output appearing whole (renamed into place) or not at all.

Parquet (`.parquet`): columns `id` (string) and `embedding` (a fixed-size list of `width` values: float32,
float16 or int8; bf16, which Parquet has no type for, as its raw bits in uint16), one row group per batch. A
record that could not be embedded has a null `embedding`. The schema's metadata says `uform.dtype` and
`uform.width`.

`.npy` (`vectors.npy`): the [N, width] array (float32, float16, int8; bf16 as its raw bits in uint16, as numpy has
no bfloat16: `torch.from_numpy(a).view(torch.bfloat16)` reads it), with two files beside it: `vectors.ids.jsonl`
(each record's id, one JSON string a line, in row order) and `vectors.valid.npy` ([N] bool, False where a record
could not be embedded). Such a row is NaN (-128 under i8, a value no real row takes), never a zero vector that
would pass for one. The rows stream to a temporary file whose length is only known at the end, so the `.npy`
header is written then and the rows copied behind it.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import secrets
import shutil
from typing import Any

import numpy as np
import torch

from .enums import Scalar

__all__ = ["FORMATS", "EmbeddingWriter", "open_writer", "sidecars"]

FORMATS = (".parquet", ".npy")
_NUMPY = {Scalar.F32: np.float32, Scalar.F16: np.float16, Scalar.BF16: np.uint16, Scalar.I8: np.int8}


def sidecars(output: str) -> tuple[str, str]:
    """The ids and valid-mask files beside a `.npy` output."""
    stem = output[: -len(".npy")]
    return f"{stem}.ids.jsonl", f"{stem}.valid.npy"


def _temp(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")


def _rows(embeddings: torch.Tensor, scalar: Scalar) -> np.ndarray:
    """A batch's [n, width] rows as numpy, bf16 as its raw bits."""
    if scalar == Scalar.BF16:
        return embeddings.contiguous().view(torch.int16).numpy().view(np.uint16)
    return embeddings.numpy()


class EmbeddingWriter(abc.ABC):
    """Writes batches of (ids, embeddings [n, width] in `scalar`, valid [n]) to `path`; `close` puts the finished
    output in place, `abort` removes what was written."""

    def __init__(self, path: str, width: int, scalar: Scalar) -> None:
        self.path = path
        self.width = width
        self.scalar = scalar
        self.rows = 0
        """Rows written so far."""

    @abc.abstractmethod
    def write(self, ids: list[str], embeddings: torch.Tensor, valid: torch.Tensor) -> None:
        """Appends one batch."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finishes the output and renames it into place."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Removes the temporary files; nothing appears at `path`."""


class ParquetWriter(EmbeddingWriter):
    """One row group per batch through `pyarrow.parquet.ParquetWriter`."""

    def __init__(self, path: str, width: int, scalar: Scalar) -> None:
        super().__init__(path, width, scalar)
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa = pa
        value = {Scalar.F32: pa.float32(), Scalar.F16: pa.float16(), Scalar.BF16: pa.uint16(), Scalar.I8: pa.int8()}
        self._type = pa.list_(value[scalar], width)
        metadata = {"uform.dtype": scalar.name.lower(), "uform.width": str(width)}
        self._schema = pa.schema([("id", pa.string()), ("embedding", self._type)], metadata=metadata)
        self._temp = _temp(path)
        self._writer: Any = pq.ParquetWriter(self._temp, self._schema)

    def write(self, ids: list[str], embeddings: torch.Tensor, valid: torch.Tensor) -> None:
        pa = self._pa
        rows = _rows(embeddings, self.scalar)  # [n, width]
        flat = pa.array(rows.reshape(-1), type=self._type.value_type)
        mask = pa.array(~valid.numpy())  # null where the record was not embedded
        column = pa.FixedSizeListArray.from_arrays(flat, self.width, mask=mask)
        self._writer.write_table(pa.Table.from_arrays([pa.array(ids, pa.string()), column], schema=self._schema))
        self.rows += len(ids)

    def close(self) -> None:
        self._writer.close()
        os.replace(self._temp, self.path)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        with contextlib.suppress(OSError):
            os.unlink(self._temp)


class NumpyWriter(EmbeddingWriter):
    """Rows, ids and the valid mask streamed to temporary files; the `.npy` files are assembled at `close`."""

    def __init__(self, path: str, width: int, scalar: Scalar) -> None:
        super().__init__(path, width, scalar)
        self._dtype = np.dtype(_NUMPY[scalar])
        self._ids_path, self._valid_path = sidecars(path)
        self._temps = {name: _temp(name) for name in ("rows", "valid", "ids")}
        self._rows_file = open(self._temps["rows"], "wb")  # noqa: SIM115 (closed by close / abort)
        self._valid_file = open(self._temps["valid"], "wb")  # noqa: SIM115
        self._ids_file = open(self._temps["ids"], "w", encoding="utf-8")  # noqa: SIM115

    def write(self, ids: list[str], embeddings: torch.Tensor, valid: torch.Tensor) -> None:
        self._rows_file.write(np.ascontiguousarray(_rows(embeddings, self.scalar), dtype=self._dtype).tobytes())
        self._valid_file.write(valid.numpy().astype(np.bool_).tobytes())
        self._ids_file.write("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in ids))
        self.rows += len(ids)

    def _assemble(self, raw: str, target: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """`target` as a `.npy` of `shape`: the header, then the raw bytes of `raw` copied behind it."""
        out = _temp(target)
        with open(out, "wb") as f, open(raw, "rb") as rows:
            np.lib.format.write_array_header_1_0(
                f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
            )
            shutil.copyfileobj(rows, f, 1 << 20)
        os.replace(out, target)

    def close(self) -> None:
        for f in (self._rows_file, self._valid_file, self._ids_file):
            f.close()
        self._assemble(self._temps["valid"], self._valid_path, (self.rows,), np.dtype(np.bool_))
        os.replace(self._temps["ids"], self._ids_path)
        self._assemble(self._temps["rows"], self.path, (self.rows, self.width), self._dtype)  # last: the main file
        for name in ("rows", "valid"):
            os.unlink(self._temps[name])

    def abort(self) -> None:
        for f in (self._rows_file, self._valid_file, self._ids_file):
            with contextlib.suppress(OSError):
                f.close()
        for temp in self._temps.values():
            with contextlib.suppress(OSError):
                os.unlink(temp)


def open_writer(path: str, width: int, scalar: Scalar) -> EmbeddingWriter:
    """The writer its name's ending selects (`FORMATS`); `ValueError` naming `output` for another ending."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        return ParquetWriter(path, width, scalar)
    if lower.endswith(".npy"):
        return NumpyWriter(path, width, scalar)
    raise ValueError(f"output: {path!r} must end in one of {list(FORMATS)} (Parquet, or .npy with ids beside)")
