"""examples/vector_index.py (issue 15, item 5): a usearch index built from `uform encode`'s output (i8 Parquet, f16
.npy), null rows left out, queried with the model: a record's own text finds that record first."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from export_cases import manifest, trained_run

import uform
from uform.cli import main

pytest.importorskip("usearch")
torch.set_num_threads(2)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vector_index.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vector_index", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("dtype", "output"), [("i8", "vectors.parquet"), ("f16", "vectors.npy")])
def test_an_index_of_encoded_records_finds_each_text_first(tmp_path: Path, dtype: str, output: str) -> None:
    folder = tmp_path / "model"
    uform.export(trained_run(tmp_path / "run"), folder)
    records_path, records = manifest(tmp_path / "data")
    vectors = tmp_path / output
    argv = ["encode", str(folder), "--input", str(records_path), "--output", str(vectors), "--cpu", "--quiet"]
    assert main([*argv, "--dtype", dtype, "--width", "64"]) == 0
    index = str(tmp_path / "vectors.usearch")
    vector_index = example()
    good = [r for r in records if r["id"] not in ("broken", "missing")]
    assert vector_index.build(str(vectors), index) == len(good)  # the two null rows are left out
    texts = [r for r in good if "text" in r]
    found = vector_index.query(str(folder), index, [r["text"] for r in texts], top=3)
    for record, hits in zip(texts, found, strict=True):
        assert hits[0][0] == record["id"], (record, hits)
        assert hits[0][1] < (0.02 if dtype == "i8" else 1e-3)  # its own vector, up to the scalar's rounding
        assert all(h[0] not in ("broken", "missing") for h in hits)
    assert vector_index.main(["query", str(folder), index, texts[0]["text"], "--top", "2"]) == 0
