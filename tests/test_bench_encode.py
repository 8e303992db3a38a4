"""bench/encode.py runs end to end on the CPU at a tiny geometry (the lead runs it on a GPU at the seed's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

torch.set_num_threads(2)

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "encode.py"


def test_encode_bench_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_encode", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = "--device cpu --depth 1 --hidden 128 --rows 2 --columns 128 --segments 8 --texts 12 --text-bytes 40"
    tiny += f" --images 3 --image-side 32 --workers 1 --repeats 1 --out {tmp_path}"
    results = bench.main(tiny.split())
    for kind, count in (("text", 12), ("image", 3), ("decode", 3)):
        assert results[kind]["items"] == count and results[kind]["items_per_s"] > 0
    assert json.loads((tmp_path / "bench-encode.json").read_text())["text"]["items"] == 12
