"""The bench scripts that answer numbers run end to end on the CPU at a tiny scale (the lead runs them on a
GPU at the reference geometry of docs/design.md §1): bench/encode.py (its --file path too); bench/onnx_cpu.py; bench/maxsim.py, whose current MaxSim agrees with the previous one it
keeps as the reference; bench/scaling.py through an executor of two CPU workers; bench/train_shards.py (uform.fit from tar shards against the library loop); bench/pairs.py (uform's side);
bench/data_wait.py's video and audio steps; bench/profile_host.py --timeline; bench/attention.py's layouts and FLOP
count; bench/kernel_trace.py's reading of a profiler trace; bench/loss_curve.py's windows; bench/copy_rate.py; bench/decode.py's JPEG rates; bench/graphs.py's CPU path; bench/mlp.py's CPU rows; and bench/spy.py's reading of
py-spy's samples (and of the interpreter lock's holder), with bench/pairs.py --spy and bench/encode.py --spy /
--spy-gil where py-spy is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from uform.model.attention import attend, document_mask

torch.set_num_threads(2)

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_encode_bench_smoke(tmp_path: Path) -> None:
    tiny = "--device cpu --depth 1 --hidden 128 --rows 2 --columns 128 --segments 8 --texts 12 --text-bytes 40"
    tiny += f" --images 3 --image-side 32 --workers 1 --repeats 1 --phases --stream 2 --out {tmp_path}"
    results = load("encode").main(tiny.split())
    for kind, count in (("text", 12), ("image", 3)):
        assert results[kind]["items"] == count and results[kind]["items_per_s"] > 0
        assert results[f"{kind}_stream"]["calls"] == 2 and results[f"{kind}_stream"]["items_per_s"] > 0
        cpu = results[kind]["cpu"]  # where the host's CPUs went over the timed calls (/proc)
        assert cpu["host_cpus"] >= 1 and cpu["ours"] >= 0
        # /proc counts the host's CPU time in ticks: over a call this short none may pass, and then the bench
        # leaves "host_busy" out rather than divide by zero.
        assert 0 <= cpu.get("host_busy", 0.0) <= 1
        phases = results[kind]["phases"]  # the stages of one more call, by the thread that ran them
        assert phases["wall_s"] > 0 and phases["uform-serve-host"]["stage.prepare"][1] >= 1
        assert phases["MainThread"]["_device"][1] == phases["uform-serve-host"]["stage.prepare"][1]
    assert results["image"]["phases"]["uform-serve-decode_0"]["decode_items"][1] == 1
    decode = results["decode"]
    assert decode["items"] == 3 and decode["pools"][0]["workers"] == 1 and decode["pools"][0]["items_per_s"] > 0
    assert decode["in_process_ms_per_item"] > 0 and decode["plan_us_per_item"] > 0
    assert decode["window"] == 16  # a window of the model's, twice its 8 segments, as serving decodes
    written = json.loads((tmp_path / "bench-encode.json").read_text())
    assert written["text"]["items"] == 12
    assert written["uform_from"] == str(BENCH.parent / "uform")  # the checkout the bench sits in ran


def test_encode_bench_times_the_file_path_too(tmp_path: Path) -> None:
    tiny = "--device cpu --depth 1 --hidden 128 --rows 2 --columns 128 --segments 8 --texts 12 --text-bytes 40"
    tiny += f" --images 3 --image-side 32 --workers 1 --repeats 1 --file --batch 5 --width 64 --out {tmp_path}"
    results = load("encode").main([*tiny.split(), "--host-processes", "1,0", "--window", "4", "--timeline"])
    for kind, count in (("text_file", 12), ("image_file", 3)):
        assert results[kind]["items"] == count and results[kind]["items_per_s"] > 0
        assert results[kind]["width"] == 64 and results[kind]["dtype"] == "f16"
    for kind, count in (("text_host_0", 12), ("image_host_0", 3)):  # side by side: in process, against one
        assert results[kind]["items"] == count and results[kind]["items_per_s"] > 0
    timeline = results["text"]["timeline"]  # one more call: when its batches reached the device
    marks = timeline["marks"]
    assert 0 < timeline["first_s"] == marks[0][0] <= marks[-1][0] <= timeline["wall_s"] and marks[-1][1] == 12
    assert [done for _, done in marks] == sorted(done for _, done in marks) and len(marks) >= 2


def test_onnx_cpu_bench_smoke(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    tiny = "--depth 1 --hidden 128 --rows 2 --columns 64 --segments 8 --texts 8 --text-bytes 30 --images 2"
    results = load("onnx_cpu").main(f"{tiny} --image-side 32 --repeats 1 --out {tmp_path}".split())
    for kind, count in (("text", 8), ("image", 2)):
        row = results[kind]
        assert row["items"] == count and row["torch_items_per_s"] > 0 and row["onnxruntime_items_per_s"] > 0
        assert row["least_cosine"] > 1 - 1e-4
    assert json.loads((tmp_path / "bench-onnx-cpu.json").read_text())["text"]["items"] == 8


def test_maxsim_bench_smoke(tmp_path: Path) -> None:
    results = load("maxsim").main(f"--device cpu --scale 0.03 --steps 1 --warmup 0 --out {tmp_path}".split())
    runs = results["runs"]
    assert set(runs) == {"reference/eager", "float32/eager", "float16/eager"}
    assert all(r["ms"] > 0 for r in runs.values())
    assert runs["float32/eager"]["check"]["ok"] and runs["float16/eager"]["check"]["ok"]
    assert runs["float32/eager"]["check"]["values_max_abs"] <= 1e-5
    assert json.loads((tmp_path / "bench-maxsim.json").read_text())["runs"].keys() == runs.keys()


def test_scaling_bench_smoke(tmp_path: Path) -> None:
    tiny = "--cpu --launcher executor --devices 2 --depth 1 --hidden 128 --rows 2 --columns 128 --segments 8"
    command = [sys.executable, str(BENCH / "scaling.py"), *tiny.split(), "--steps", "2", "--warmup", "1"]
    command += ["--world-compile", "blocks", "--term"]
    subprocess.run(command, check=True, env={**os.environ, "OUT": str(tmp_path)}, timeout=300, capture_output=True)
    results = json.loads((tmp_path / "bench-scaling-executor-blocks.json").read_text())
    assert results["world_compile"] == "blocks" and results["many"]["world_size"] == 2
    assert results["one"]["tokens_per_s"] > 0 and results["many"]["tokens_per_s"] > 0 and results["efficiency"] > 0
    for world in ("one", "many"):  # --term: each world again without the contrastive term, the difference its cost
        r = results[world]
        assert r["masked_ms"] > 0 and r["term_ms"] == pytest.approx(r["ms"] - r["masked_ms"])
        assert r["term_share"] == pytest.approx(r["term_ms"] / r["ms"])


def test_train_shards_bench_smoke(tmp_path: Path) -> None:
    tiny = "--depth 1 --hidden 128 --rows 4 --columns 640 --segments 8 --records 32 --shards 2 --steps 3"
    tiny += " --warmup 1 --cpu"
    environment = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(BENCH.parent)}
    subprocess.run([sys.executable, str(BENCH / "train_shards.py"), *tiny.split()], env=environment, check=True)
    result = json.loads((tmp_path / "bench-train-shards.json").read_text())
    assert result["library_pairs_per_second"] > 0 and result["fit_pairs_per_second"] > 0
    assert result["records"] == 32 and result["loader_cpu_ms_per_step"] > 0


def test_pairs_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    tiny = "--cpu --skip-open-clip --depth 1 --hidden 128 --pairs 4 --rows 4 --columns 640 --segments 8 --steps 3"
    tiny += " --warmup 1"
    monkeypatch.setenv("OUT", str(tmp_path))
    bench = load("pairs")  # in this process: each run would pay a fresh interpreter's imports otherwise
    result = bench.main(tiny.split())
    assert result["uform_pairs_per_second"] > 0 and result["geometry"]["pairs"] == 4
    assert result["uform_items_dropped"] == 0
    assert json.loads((tmp_path / "bench-pairs.json").read_text())["uform_items_dropped"] == 0
    result = bench.main([*tiny.split(), "--fed"])  # the image-text step's data wait
    assert result["uform_fed_ms"] > 0 and result["uform_prepare_ms"] > 0 and result["uform_prepare_one_ms"] > 0
    assert result["uform_decode_one_ms"] > 0 and result["uform_prepare_at_once"] == 2  # fit's depth on the CPU
    assert result["uform_data_wait"] == pytest.approx(1 - result["uform_fed_ms"] / result["uform_step_ms"])
    stage = bench.main([*tiny.split(), "--prepare-only", "--rows", "0", "--channels", "3"])  # no step taken, RGB
    assert stage["uform_prepare_ms"] > 0 and "uform_pairs_per_second" not in stage
    assert stage["geometry"]["rows"] == 2  # --rows 0: as many as 4 pairs of 318 positions fill at 640 columns
    assert stage["geometry"]["channels"] == 3
    scaled = [*tiny.split(), "--devices", "2"]
    scaling = bench.main(scaled)  # two CPU workers, each pair routed whole to one
    assert scaling["devices"] == 2 and scaling["one"]["dropped"] == scaling["many"]["dropped"] == 0
    assert scaling["one"]["pairs_per_second"] > 0 and scaling["many"]["pairs_per_second"] > 0
    assert scaling["efficiency"] > 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        bench.main([*scaled, "--fed"])
    assert refused.value.code == 2 and "one device's pipeline" in capsys.readouterr().err
    # One row holds two of the four pairs' images: items are dropped, and the rate counts pairs trained only.
    result = bench.main(tiny.replace("--rows 4", "--rows 1").split())
    assert 3 * 2 <= result["uform_items_dropped"] <= 3 * 6 and result["uform_pairs_per_second"] > 0


def test_attention_bench_layouts_and_flops() -> None:
    """bench/attention.py (GPU only) times attention over two packed layouts; their segments and the useful FLOPs
    it divides by are checked here against a count made by hand."""
    bench = load("attention")
    text = bench.layout("text", 4, 1024)
    assert text.shape == (4, 1024)
    assert sorted(np.unique(text, return_counts=True)[1].tolist()) == [256] * 16  # tile-aligned, rows full
    pairs = bench.layout("pairs", 4, 1024)
    for row in pairs:
        assert np.all(np.diff(row) >= 0)  # ids never decrease along a row, padding last
    _, counts = np.unique(pairs, return_counts=True)
    padding = counts[-1]
    assert counts[:-1].tolist() == [257, 61] * 12  # three image-caption pairs a row
    assert padding == 4 * (1024 - 3 * (257 + 61))
    assert bench.padding_id("pairs", 4, 1024) == 24 and bench.padding_id("text", 4, 1024) is None
    by_hand = 4 * 3 * 3.5 * 4 * (257 * 257 + 61 * 61) * 64 * 8  # 4 rows of 3 pairs; the padding does nothing useful
    assert bench.useful_flops(pairs, 8, 64, 24) == by_hand
    assert bench.useful_flops(text, 8, 64, None) == 16 * 3.5 * 4 * 256 * 256 * 64 * 8


def test_attention_bench_dense_buckets_equal_the_document_mask() -> None:
    """bench/attention.py's `--dense` rows: segments gathered by length into plain SDPA (here its math backend on
    the CPU) give the document-masked answer and gradients at every real position; padding is left out."""
    bench = load("attention")
    segments = bench.layout("pairs", 2, 1024)
    pad = int(segments.max())
    assert [b.shape for b in bench.length_buckets(segments, pad)] == [(6, 257), (6, 61)]
    generator = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, 1024, 2, 16, generator=generator).requires_grad_() for _ in range(3)]
    weight = torch.randn(2, 2, 1024, 16, generator=generator) * torch.from_numpy(segments != pad)[:, None, :, None]
    found = []
    for forward in (
        bench.dense_runner(*(t.transpose(1, 2) for t in leaves), segments, pad, "math")[1],
        lambda: attend(*(t.transpose(1, 2) for t in leaves), document_mask(torch.from_numpy(segments), "dense")),
    ):
        for t in leaves:
            t.grad = None
        out = forward()
        (out * weight).sum().backward()
        found.append([(out * (weight != 0)).detach(), *(t.grad.clone() for t in leaves)])
    for a, b in zip(*found, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_attention_bench_gathered_row_gathers_the_images_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/attention.py's "gathered" row runs serving's gathered path over the "images" layout (padding carries
    the largest id, which is no segment's) and answers the document-masked reference at every real position; a
    layout whose segments differ in length is refused rather than timed as something else."""
    bench = load("attention")
    kinds = []
    made = bench.document_mask

    def recorded(*args: Any, **kwargs: Any) -> Any:
        mask = made(*args, **kwargs)
        kinds.append(mask.kind)
        return mask

    monkeypatch.setattr(bench, "document_mask", recorded)
    segments = bench.layout("images", 2, 1024)
    pad = int(segments.max())
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 2, 16, generator=generator).transpose(1, 2) for _ in range(3))
    _, forward = bench.gathered_runner(q, k, v, torch.from_numpy(segments), segments)
    assert kinds == ["gathered"]
    real = torch.from_numpy(segments != pad)[:, None, :, None]
    want = attend(q, k, v, document_mask(torch.from_numpy(segments), "dense"))
    torch.testing.assert_close(forward() * real, want * real, atol=1e-5, rtol=1e-4)
    pairs = bench.layout("pairs", 2, 1024)
    with pytest.raises(ValueError, match="one length"):
        bench.gathered_runner(q, k, v, torch.from_numpy(pairs), pairs)


def test_attention_bench_reads_kernel_options_from_the_command_line() -> None:
    bench = load("attention")
    label, options = bench.named_options("bwd:32/64/64/32/4/2")
    assert label == "flex bwd 32/64/64/32 w4 s2"
    assert options == {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
        "bwd_num_warps": 4,
        "bwd_num_stages": 2,
    }
    assert bench.named_options("fwd:64/64/4/3")[1] == {
        "fwd_BLOCK_M": 64,
        "fwd_BLOCK_N": 64,
        "fwd_num_warps": 4,
        "fwd_num_stages": 3,
    }
    label, both = bench.named_options("fwd:64/64/4/2+bwd:64/64/64/64/4/3")
    assert label == "flex fwd 64/64 w4 s2 bwd 64/64/64/64 w4 s3" and len(both) == 10
    for wrong in ("bwd:64/64/4/3", "fwd:64/64/4/2+", "fwd:64/x/4/3", "mid:64/64/4/3"):
        with pytest.raises(ValueError, match="--configs"):
            bench.named_options(wrong)


def test_data_wait_bench_builds_video_and_audio_steps(tmp_path: Path) -> None:
    """bench/data_wait.py's video and audio steps (MP4 clips, FLAC encoded from pygame's WAV) are prepared end to end
    on the CPU (`--host-only`; the GPU runs the timed steps), every item placed."""
    tiny = "--executor cpu --threads 1 --host-only --host-steps 1 --images 0 --clips 2 --clip-frames 6"
    tiny += " --recordings 2 --audio flac --texts 4 --depth 1 --hidden 128 --rows 8 --columns 1024 --segments 16"
    tiny += " --workers 1"
    environment = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(BENCH.parent)}
    subprocess.run([sys.executable, str(BENCH / "data_wait.py"), *tiny.split()], env=environment, check=True)
    result = json.loads((tmp_path / "bench-data-wait.json").read_text())
    assert result["items"]["clips"] == 2 and result["items"]["recordings"] == 2 and result["items"]["audio"] == "flac"
    assert result["placed"] == 8 and result["dropped"] == 0


def test_profile_host_timeline_times_every_process_of_the_prepare_stage() -> None:
    """bench/profile_host.py --timeline: one step's stages in the trainer's process, its preparer process and its
    decoder, each from the function's own timer there."""
    tiny = "--timeline --steps 1 --images 3 --texts 3 --workers 1 --depth 1 --hidden 128 --rows 4 --columns 512"
    tiny += " --segments 16"
    environment = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    run = subprocess.run(
        [sys.executable, str(BENCH / "profile_host.py"), *tiny.split()],
        env=environment,
        check=True,
        capture_output=True,
    )
    rows = {tuple(line.split()[:3]) for line in run.stdout.decode().splitlines()[2:]}
    assert ("decoder", "MainThread", "decode_chunk") in rows
    assert ("preparer", "uform-host-job", "prepare") in rows and ("trainer", "MainThread", "adopt") in rows


def test_step_bench_counts_the_towers_own_parameters() -> None:
    """bench/step.py's useful FLOPs: 6 x the tower's matrix parameters x positions (counted here off uform's own
    `Tower`) plus same-segment attention, 4 L² D a block forward and 3.5x that with backward."""
    from uform.model.tower import Tower

    bench = load("step")
    depth, hidden, rows, columns, segments = 2, 128, 4, 256, 8
    matrices = sum(p.numel() for p in Tower(depth, hidden).parameters() if p.dim() == 2)
    length = rows * columns // segments
    by_hand = 6 * matrices * rows * columns + 3.5 * depth * segments * 4 * length**2 * hidden
    assert bench.useful_flops(depth, hidden, rows, columns, segments) == by_hand


def test_kernel_trace_reads_kernels_busy_time_and_the_gaps_between_them(tmp_path: Path) -> None:
    import gzip

    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "kernel", "name": "norm", "ts": 50.0, "dur": 100.0},  # overlaps: busy is their union
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 160.0, "dur": 40.0},  # a 10 us gap before
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 3200.0, "dur": 200.0},  # a 3 ms gap before
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaHostAlloc", "ts": 150.0, "dur": 3000.0, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 300.0, "dur": 5.0, "tid": 7},  # too short to name
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    kernel_trace = load("kernel_trace")
    summary = kernel_trace.summarize(kernel_trace.load_events(str(path)), steps=2)
    assert summary["kernels_ms"] == pytest.approx(0.44 / 2)
    assert summary["busy_ms"] == pytest.approx(0.39 / 2) and summary["span_ms"] == pytest.approx(3.4 / 2)
    assert summary["gaps_ms"] == pytest.approx(3.01 / 2)
    assert summary["gaps_by_size_ms"] == pytest.approx({"<20us": 0.005, ">=2ms": 1.5})
    worst = summary["longest_gaps"][0]
    assert worst["ms"] == pytest.approx(3.0) and worst["after"] == "Memcpy HtoD" and worst["before"] == "gemm"
    assert worst["host"] == [("cudaHostAlloc", 7, 3.0)]
    assert summary["top_kernels_ms"][0] == ("gemm", pytest.approx(0.15))
    assert "gap 3.00 ms after 'Memcpy HtoD'" in kernel_trace.report(summary, "steps")
    with pytest.raises(ValueError, match="no device events"):
        kernel_trace.summarize(events[4:], steps=1)


def test_loss_curve_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    tiny = "--cpu --depth 1 --hidden 128 --rows 2 --columns 128 --segments 8 --steps 12 --window 6 --seed 3"
    results = load("loss_curve").main(tiny.split())
    assert len(results["curve"]) == 2 and results["finite"] and all(np.isfinite(results["curve"]))
    assert results["curve"][0] > results["curve"][1]  # twelve steps of a fresh tower lower the loss (6 were noise)
    assert json.loads((tmp_path / "bench-loss-curve.json").read_text())["curve"] == results["curve"]


def test_decode_bench_leaves_out_a_modality_of_no_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/decode.py's decode rates, JPEGs alone (`--clips 0 --recordings 0`), on one decoder process."""
    monkeypatch.setenv("OUT", str(tmp_path))
    tiny = "--items 4 --clips 0 --recordings 0 --workers 1 --skip-prepare"
    (row,) = load("decode").main(tiny.split())["decode"]
    assert row["modality"] == "image" and row["items"] == 4 and row["units"] == 256 and row["inline"] > 0
    assert json.loads((tmp_path / "bench-decode.json").read_text())["decode"][0]["modality"] == "image"
    variants = load("decode").main(["--jpeg-variants", "--repeats", "1"])["jpeg_variants"]
    assert len(variants) == 4 and all(ms > 0 for ms in variants.values())
    rows = load("decode").main(["--core-scaling", "1,2", "--seconds", "0.3"])["core_scaling"]
    assert [r["processes"] for r in rows] == [1, 2] and all(r["images_s"] > 0 and r["pool_images_s"] > 0 for r in rows)
    assert rows[1]["per_process"] == pytest.approx(rows[1]["images_s"] / 2)
    keys = load("decode").main(["--keys", "1", "--seconds", "0.2", "--repeats", "2"])["keys"]
    assert len(keys) == 2 and all(r["keyed_images_s"] > 0 and r["unkeyed_images_s"] > 0 for r in keys)


def test_copy_rate_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    result = load("copy_rate").main(["--mib", "1", "--repeats", "2"])
    copies = {name: r for name, r in result.items() if isinstance(r, dict)}
    assert len(copies) == 8 and all(r["worst"] <= r["median"] <= r["best"] for r in copies.values())
    assert json.loads((tmp_path / "bench-copy-rate.json").read_text())["mib"] == 1


def test_graphs_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/graphs.py's CPU path steps the trainer's network outside its verbs (the graphs need CUDA)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    tiny = "--cpu --depth 1 --hidden 128 --rows 2 --columns 256 --segments 4 --steps 2 --warmup 1"
    result = load("graphs").main(tiny.split())
    assert result["compiled"]["ms"] > 0 and "graphs" not in result
    assert json.loads((tmp_path / "bench-graphs.json").read_text())["geometry"]["segments"] == 4
    with pytest.raises(SystemExit):  # a variant it does not know is refused before anything is built
        load("graphs").main([*tiny.split(), "--variants", "tuned,fast"])


def test_mlp_bench_smoke(tmp_path: Path) -> None:
    """bench/mlp.py on the CPU: both rows run the separate kernels (the epilogues are CUDA's), each within bf16's
    rounding of the float64 reference, and say that cuBLASLt did not run."""
    result = load("mlp").main(
        ["--device", "cpu", "--positions", "64", "--hidden", "64", "--repeats", "2", "--out", str(tmp_path)]
    )
    for path in ("separate", "fused"):
        assert result[path]["ms"] > 0 and len(result[path]["errors"]["mean"]) == 4
        assert max(result[path]["errors"]["mean"]) < 2e-2
    assert result["fused"]["cublaslt"] is False
    assert json.loads((tmp_path / "bench-mlp.json").read_text())["args"]["hidden"] == 64


def test_thread_cpu_by_name_counts_a_busy_thread() -> None:
    """bench/common.py's per-thread CPU (bench/step.py --fed prints whose CPU a fed step takes)."""
    common = load("common")
    before = common.thread_cpu_seconds()
    started = time.process_time()
    while time.process_time() - started < 0.2:  # this thread busy for 0.2 s of CPU
        pass
    spent = common.thread_cpu_per_step(before, common.thread_cpu_seconds(), 2)
    assert spent and list(spent.values()) == sorted(spent.values(), reverse=True)
    assert 50 <= sum(spent.values()) <= 200  # 200 ms over two "steps", within /proc's 10 ms ticks and others' CPU


def test_spy_reads_py_spy_samples_per_thread(tmp_path: Path) -> None:
    """bench/spy.py's reading of py-spy's raw samples: per thread, shares of the frames a sample ended in and of
    those anywhere on its stack; a thread far quieter than the busiest is left out."""
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (1): MainThread;<module> (a.py:1);step (a.py:9);wait (threading.py:331) 30\n"
        "thread (1): MainThread;<module> (a.py:1);step (a.py:9);launch (b.py:4) 10\n"
        "thread (2): pt_autograd_0;backward (c.py:2) 20\n"
        "thread (3): quiet;idle (d.py:1) 1\n"
    )
    summary = load("spy").summarize(str(raw), top=3)
    threads = summary["threads"]
    assert list(threads) == ["thread (1): MainThread", "thread (2): pt_autograd_0"]
    main = threads["thread (1): MainThread"]
    assert main["samples"] == 40 and main["self"] == [("wait (threading.py:331)", 0.75), ("launch (b.py:4)", 0.25)]
    assert dict(main["inclusive"]) == {"wait (threading.py:331)": 0.75, "launch (b.py:4)": 0.25}  # not the entry
    assert "pt_autograd_0" in load("spy").report(summary)
    assert "held" not in main and "held_total" not in summary


def test_spy_states_the_share_of_slots_each_thread_held_the_interpreter_lock(tmp_path: Path) -> None:
    """With the lock holder's samples only (`--spy-gil`), each thread's samples are shares of every sample slot
    (the rate times the seconds), and so are all threads' together: how busy the lock was."""
    raw = tmp_path / "spy-gil.txt"
    raw.write_text(
        "thread (1): MainThread;<module> (a.py:1);launch (b.py:4) 300\n"
        "thread (2): uform-serve-host;pack (c.py:2) 150\n"
        "thread (2): uform-serve-host;pack (c.py:3) 50\n"
    )
    summary = load("spy").summarize(str(raw), slots=1000)
    assert summary["held_total"] == 0.5 and summary["slots"] == 1000
    assert summary["threads"]["thread (1): MainThread"]["held"] == 0.3
    assert summary["threads"]["thread (2): uform-serve-host"]["held"] == 0.2
    text = load("spy").report(summary)
    assert "the lock held in 50.0% of 1000 sample slots" in text and "holding the lock 30.0% of the slots" in text


def bench_output(script: str, arguments: str, out: Path) -> str:
    """What `bench/<script>` printed, run as a script with `arguments`, $OUT at `out`."""
    environment = {**os.environ, "OUT": str(out), "PYTHONPATH": str(BENCH.parent)}
    command = [sys.executable, str(BENCH / script), *arguments.split()]
    return subprocess.run(command, env=environment, check=True, capture_output=True).stdout.decode()


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="needs py-spy")
def test_pairs_bench_spies_on_its_own_threads(tmp_path: Path) -> None:
    tiny = "--cpu --skip-open-clip --depth 1 --hidden 128 --pairs 4 --rows 4 --columns 640 --segments 8 --steps 12"
    out = bench_output("pairs.py", tiny + " --warmup 1 --spy 1", tmp_path)
    assert "py-spy samples by thread" in out and "MainThread" in out
    assert (tmp_path / "spy-pairs.txt").stat().st_size > 0


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="needs py-spy")
def test_encode_bench_spies_on_serving_threads_and_on_the_lock(tmp_path: Path) -> None:
    tiny = "--device cpu --depth 1 --hidden 128 --rows 4 --columns 256 --segments 16 --texts 16 --images 8"
    tiny += (
        " --image-side 64 --workers 1 --pool-workers 1 --repeats 1 --spy 1 --spy-gil 1 --host-processes 1 --spy-host 1"
    )
    out = bench_output("encode.py", tiny, tmp_path)
    assert "py-spy samples by thread" in out and "uform-serve-host" in out
    assert "py-spy samples of the interpreter lock's holder by thread" in out
    assert "no serving host process ran the text calls" in out  # a call of texts alone packs in process
    for name in ("encode-text", "encode-image", "encode-text-gil", "encode-image-gil", "encode-image-host"):
        assert (tmp_path / f"spy-{name}.txt").stat().st_size > 0
