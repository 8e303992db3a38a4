"""bench/maxsim.py runs end to end on the CPU at a tiny scale (the lead runs it on a GPU at the seed's), and
the current MaxSim agrees with the previous one it keeps as the reference."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

torch.set_num_threads(2)

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "maxsim.py"


def test_maxsim_bench_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_maxsim", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(f"--device cpu --scale 0.03 --steps 1 --warmup 0 --out {tmp_path}".split())
    runs = results["runs"]
    assert set(runs) == {"reference/eager", "float32/eager", "float16/eager"}
    assert all(r["ms"] > 0 for r in runs.values())
    assert runs["float32/eager"]["check"]["ok"] and runs["float16/eager"]["check"]["ok"]
    assert runs["float32/eager"]["check"]["values_max_abs"] <= 1e-5
    assert json.loads((tmp_path / "bench-maxsim.json").read_text())["runs"].keys() == runs.keys()
