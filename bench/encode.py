"""Serving throughput of `uform.load(...).encode`: items per second for text and for JPEG images.

A freshly initialised network at the given geometry (default: the reference geometry of docs/design.md §1, depth 12 x hidden 512, 64 rows x
1024 columns, 256 segments, image patch_side 16) is written as a trainer checkpoint and loaded back with
`uform.load` on `--device` (cuda: compiled, FlexAttention, bf16 autocast; cpu: eager, f32), then timed on:

  text     `--texts` slices of CPython's pydoc topics, `--text-bytes` bytes each (255 by default, so that
           with its one-byte prefix four fill a 1024-column row and 256 fill the batch exactly);
  image    `--images` `--image-side`² JPEGs (quality 90) of smooth colour fields with noise, decoded in
           the model's decoder pool (one process per core unless `--workers`); a 256² image at patch 16 is
           256 patches, so three fit a 1024-column row (192 per batch at the reference geometry);
  decode   the same JPEGs through a decoder pool alone, in chunks as serving decodes them (the media stage's own
           ceiling), on pools of `--pool-workers` sizes, and one image's decode in this process.

With `--file`, the same items go through `uform encode`'s path too (`uform.encode_file`): a JSONL manifest on
disk (texts inline, images as files beside it) read by `uform.sources`, embedded `--batch` records at a time and
written to Parquet at `--width` and `--dtype` ("text_file", "image_file" in the table).

With `--peers` (CUDA only), the same call also times the peers of issue 12's serving goal on random inputs:
transformers' `BertModel` of the same depth and width (8 heads, 4x MLP, SDPA attention, bf16 weights, inference,
`--bert-sequences` sequences of `--bert-tokens` tokens a call: tokens/s against uform's text positions/s), and
open_clip's `VisionTransformer` of the same depth and width (`--image-side` px, patch `--patch-side`, bf16 weights,
compiled, fed ready tensors of `--vit-images` images a call: images/s against uform's from JPEG bytes). transformers
is on the GPU machine; carry open_clip_torch, ftfy and wcwidth as wheels there.

`--packing run` packs every batch into the run's own rows instead of the model's (`Model.packing`: wider rows
under FlexAttention), for an A/B of the two.

`--host-processes N` serves through `load(host_processes=N)` (the host stage in N processes of their own; 0: in
the serving process; default: the model's own choice); `N,M` times each kind through both, side by side (N, M, N
again; "<kind>_host_M" in the table).

`--channels 3` trains the random run's images as RGB (the seed derives 4 channels, RGBA: a JPEG's alpha is always
opaque, yet a quarter of every image batch's bytes is that alpha, decoded, packed and copied; open_clip's ViT takes
RGB).

`--jpeg-device` (CUDA only) times the same JPEGs again through `load(jpeg="device")` (nvJPEG takes every plain
JPEG).

With `--phases`, one more call of each kind runs with serving's stages timed on the threads that run them (the
decoding thread's `HostStage.decode`, the host thread's packing and GPU tiling, the caller's launches and waits).

Over each kind's timed calls the bench also reads where the host's CPUs went (Linux's /proc): the share of all of
them busy, and the cores this process and every process under it (decoders, serving host processes) kept busy;
a host whose CPUs are all busy binds serving however its work is cut.

With `--spy SECONDS`, calls of each kind run again for that long while py-spy samples this process's threads
(bench/spy.py: where each thread's time goes, waiting included); with `--spy-gil SECONDS`, likewise but only the
interpreter lock's holder is sampled: how much of the wall each thread held the lock, and all of them together;
`--spy-host SECONDS` and `--spy-host-gil SECONDS` sample the (first) serving host process's threads the same two
ways.

`--timeline` runs one more call of each kind and reports when its batches reached the device (`encode`'s
progress): how long the first batch took (the call's fixed start), the steady rate between a quarter and three
quarters of the items, and the whole call's rate.

`--stream N` also times the same call N times over as one stream (`Model.encode_stream`: the next call is
prepared while this one's last batches run), whose rate is what a long input embedded a batch at a time gets.

`--window N` decodes and sorts N items together (`Model.window`; 0: the model's, twice its segments).

Each figure is the best of `--repeats` timed calls after one warm-up call (which compiles on CUDA). Prints
a table and writes bench-encode.json under $OUT (or the current folder).

  python bench/encode.py --device cuda --file --peers --jpeg-device
  python bench/encode.py --device cpu --depth 2 --hidden 128 --rows 8 --columns 256 --segments 32 \\
      --texts 256 --images 32 --image-side 64 --file
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Run as a script, the checkout's uform wins over an installed one; its sibling `common` is found when loaded too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    add_channels,
    add_geometry,
    bert_config,
    decode_in_pool,
    family_cpu_seconds,
    host_cpu_jiffies,
    random_checkpoint,
    topic_slices,
    write_json,
)  # sibling modules, not a package
from kernel_trace import load_events, report, summarize
from spy import sampling


def jpegs(count: int, side: int, seed: int = 0) -> list[bytes]:
    """Smooth random colour fields with a little noise, as JPEG (quality 90): realistic entropy per pixel."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    grid = np.linspace(0, 1, side, dtype=np.float32)
    for _ in range(count):
        a, b, c = rng.random((3, 3), dtype=np.float32)
        field = a[None, None, :] + b[None, None, :] * grid[:, None, None] + c[None, None, :] * grid[None, :, None]
        field = field / field.max() * 255 + rng.normal(0, 8, (side, side, 3))
        image = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8), "RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def build_model(args: argparse.Namespace, folder: str, jpeg: str = "host", host_processes: int | None = None) -> Any:
    import uform as u
    from uform.media.decode import MediaPolicy

    path = os.path.join(folder, "bench-encode.safetensors")
    if not os.path.exists(path):
        random_checkpoint(args, path, patch_side=args.patch_side, channels=args.channels)
    executor = u.Executor.for_vram([0]) if args.device == "cuda" else u.Executor.cpu()
    if host_processes is None and jpeg == "host" and args.host_processes != "auto":
        host_processes = int(args.host_processes.partition(",")[0])
    return u.load(path, executor, media=MediaPolicy(workers=args.workers), jpeg=jpeg, host_processes=host_processes)


def manifests(folder: str, texts: list[bytes], images: list[bytes]) -> dict[str, str]:
    """JSONL manifests of the texts (inline) and of the images (files beside the manifest), by kind."""
    out = {}
    with open(os.path.join(folder, "texts.jsonl"), "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"t{i}", "text": text.decode("utf-8", "replace")}) + "\n")
    out["text"] = f.name
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    with open(os.path.join(folder, "images.jsonl"), "w", encoding="utf-8") as f:
        for i, data in enumerate(images):
            with open(os.path.join(folder, "images", f"{i}.jpg"), "wb") as image:
                image.write(data)
            f.write(json.dumps({"id": f"i{i}", "image": f"images/{i}.jpg"}) + "\n")
    out["image"] = f.name
    return out


def timed(call: Any, repeats: int, cpu: dict[str, float] | None = None) -> tuple[float, float]:
    """(seconds of the warm-up call, best seconds of `repeats` calls); with `cpu`, fills it with where the host's
    CPUs went over the timed calls (`cpu_use`)."""
    t0 = time.perf_counter()
    call()
    warm = time.perf_counter() - t0
    best = float("inf")
    before = cpu_reading() if cpu is not None else None
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    if cpu is not None and before is not None:
        cpu.update(cpu_use(before, cpu_reading()))
    return warm, best


def cpu_reading() -> tuple[float, tuple[int, int] | None, float]:
    """(wall clock, the host's CPU ticks, this process's and its children's CPU seconds), for `cpu_use`."""
    return time.perf_counter(), host_cpu_jiffies(), family_cpu_seconds(os.getpid())


def cpu_use(before: tuple, after: tuple) -> dict[str, float]:
    """Between two `cpu_reading`s: the share of the host's CPUs busy ("host_busy", of "host_cpus"), and the cores
    this process with every process under it (the decoders, the serving host processes) kept busy ("ours")."""
    wall = after[0] - before[0]
    out = {"host_cpus": float(os.cpu_count() or 1), "ours": (after[2] - before[2]) / wall if wall > 0 else 0.0}
    if before[1] is not None and after[1] is not None and after[1][1] > before[1][1]:
        out["host_busy"] = (after[1][0] - before[1][0]) / (after[1][1] - before[1][1])
    return out


def profiled(name: str, call: Any, folder: str) -> dict[str, Any]:
    """One more (warm) call under torch.profiler: its wall time against the sum of its kernels (where the two part,
    the device idles), the table of the host's costliest operators written to `folder`/encode-profile-`name`.txt,
    its Chrome trace to encode-trace-`name`.json.gz, and on CUDA where the device waited between its kernels and
    which host calls overlapped the longest waits (bench/kernel_trace.py)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as trace:
        t0 = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    device = torch.autograd.DeviceType.CUDA
    kernels = sum(e.device_time for e in trace.events() if e.device_type == device) / 1e6
    averages = trace.key_averages()
    table = averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70)
    if torch.cuda.is_available():
        table += "\n" + averages.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"encode-profile-{name}.txt"), "w") as out:
        out.write(table)
    path = os.path.join(folder, f"encode-trace-{name}.json.gz")
    trace.export_chrome_trace(path)  # gzipped by the profiler, for its name; kernel_trace reads it as it is
    print(f"profile {name}: wall {wall * 1e3:.1f} ms, kernels {kernels * 1e3:.1f} ms", flush=True)
    result: dict[str, Any] = {"wall_s": wall, "kernels_s": kernels}
    if torch.cuda.is_available():  # where the device waited, and on what (bench/kernel_trace.py)
        summary = summarize(load_events(path), steps=1)
        print(report(summary, "call"), flush=True)
        result["trace"] = summary
    return result


def decode_rates(args: argparse.Namespace, images: list[bytes]) -> dict[str, Any]:
    """The media stage's own ceiling: the JPEGs through `media.decode.decode_items` (chunks of images a decoder
    job, a window of the model's at a time, as serving decodes them) on a pool of each size of `--pool-workers`
    (the first 0: `--workers`), and `decode_item` in this process (one core's rate)."""
    from uform.media.decode import decode_item
    from uform.media.limits import MediaLimits
    from uform.runtime.decoders import DecodePool

    geometry = {"patch_side": args.patch_side, "channels": args.channels or 4}
    window = args.window or 2 * args.segments  # `Model.window`'s default: twice its segments
    out: dict[str, Any] = {"items": len(images), "window": window, "pools": []}
    for workers in [int(w) for w in str(args.pool_workers).split(",")]:
        with DecodePool(workers or args.workers) as pool:
            _, best = timed(lambda pool=pool: decode_in_pool(pool, images, geometry, window=window), args.repeats)
            out["pools"].append({"workers": pool.workers, "items_per_s": len(images) / best})
        print(
            f"{'decode':<6} {len(images) / best:>12,.1f} items/s  ({pool.workers} decoder processes, {window} a window)",
            flush=True,
        )
    alone = images[: min(len(images), 256)]
    _, best = timed(lambda: [decode_item("image", d, geometry, 1023, MediaLimits()) for d in alone], args.repeats)
    out["in_process_ms_per_item"] = best / len(alone) * 1e3
    print(f"{'decode':<6} {best / len(alone) * 1e3:>12.3f} ms an image in this process (one core)", flush=True)
    # What jpeg="device" does on the host instead: the header plan of each JPEG (`device_pictures.device_units`).
    from uform.device_pictures import device_units

    plan = {**geometry, "max_units": 1023, "limits": MediaLimits()}
    _, best = timed(lambda: [device_units(d, **plan) for d in alone], args.repeats)
    out["plan_us_per_item"] = best / len(alone) * 1e6
    print(f'{"plan":<6} {best / len(alone) * 1e6:>12.1f} us an image\'s JPEG header plan (jpeg="device")', flush=True)
    return out


def timeline(model: Any, modalities: list[str], contents: list[bytes], label: str) -> dict[str, float]:
    """One more (warm) call that records when its batches reach the device (`encode`'s progress, 64 reports):
    how long the first took (a call's fixed start: its contents handed over, the first window decoded and packed),
    the steady rate between a quarter and three quarters of the items, and the whole call's rate."""
    marks: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    model.encode(
        modalities, contents, progress=lambda done, total: marks.append((time.perf_counter(), done)), progress_steps=64
    )
    wall = time.perf_counter() - t0
    total = len(contents)
    first = next(t for t, done in marks if done > 0) - t0
    a = min(marks, key=lambda m: abs(m[1] - total / 4))
    b = min(marks, key=lambda m: abs(m[1] - 3 * total / 4))
    steady = (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else float("nan")
    out = {"first_s": first, "steady_items_per_s": steady, "items_per_s": total / wall, "wall_s": wall}
    out["marks"] = [(t - t0, done) for t, done in marks]
    print(
        f"timeline {label}: first batch handed to the device after {first * 1e3:.1f} ms; {steady:,.0f} items/s "
        f"between a quarter and three quarters of the items; {total / wall:,.0f} items/s whole ({wall * 1e3:.0f} ms)",
        flush=True,
    )
    print("  ms:items " + " ".join(f"{(t - t0) * 1e3:.0f}:{done}" for t, done in marks), flush=True)
    return out


def phases(model: Any, modalities: list[str], contents: list[bytes], label: str, folder: str) -> dict[str, Any]:
    """One more (warm) call with serving's stages timed on the threads that run them (`HostStage.decode` on the
    decoding thread, `HostStage.prepare` and its parts on the host thread, `Pipeline._device` and the waits on
    the caller's): where a call's wall time goes, printed as a table and answered as {thread: {stage: [seconds,
    calls]}}."""
    import collections
    import functools
    import queue
    import threading

    import uform.data.windows as windows
    import uform.device_pictures as pictures
    import uform.serve_pipeline as serve_pipeline
    import uform.serve_stage as serve_stage

    spent: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str | None = None) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed_stage(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                entry = spent[(threading.current_thread().name, label or name)]
                entry[0] += time.perf_counter() - t0
                entry[1] += 1

        patched.append((owner, name, original))
        setattr(owner, name, timed_stage)

    wrap(serve_stage.HostStage, "decode", "stage.decode")
    wrap(serve_stage.HostStage, "prepare", "stage.prepare")
    wrap(serve_stage, "planned_on_device")
    for name in ("_device", "_inputs"):
        wrap(serve_pipeline.Pipeline, name)
    wrap(serve_pipeline, "landed")
    wrap(windows, "prepare", "data.batch.prepare")
    wrap(serve_stage, "decode_items")
    wrap(pictures, "decode_all")
    wrap(pictures, "split")
    wrap(pictures, "fill")
    wrap(queue.Queue, "get", "hand-off get")
    wrap(queue.Queue, "put", "hand-off put")
    try:
        t0 = time.perf_counter()
        model.encode(modalities, contents)
        wall = time.perf_counter() - t0
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
    print(f"phases {label}: wall {wall * 1e3:.1f} ms ({len(contents) / wall:,.0f} items/s, stages timed)")
    table: dict[str, Any] = {"wall_s": wall}
    for (thread, stage), (seconds, calls) in sorted(spent.items(), key=lambda kv: (kv[0][0], -kv[1][0])):
        table.setdefault(thread, {})[stage] = [seconds, calls]
        print(f"  {thread:<22} {stage:<20} {seconds * 1e3:9.1f} ms  x{calls}")
    return table


def peer_rates(args: argparse.Namespace) -> dict[str, Any]:
    """BertModel tokens/s and open_clip ViT images/s (inference, bf16, CUDA) at uform's depth and width."""
    from transformers import BertModel

    out: dict[str, Any] = {}
    config = bert_config(args.depth, args.hidden, 30522, max(512, args.bert_tokens))
    bert = BertModel(config).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(1, 30000, (args.bert_sequences, args.bert_tokens), device="cuda")

    def run_bert() -> None:
        with torch.no_grad():
            bert(input_ids=ids).last_hidden_state.float().sum().item()

    warm, best = timed(run_bert, args.repeats)
    tokens = args.bert_sequences * args.bert_tokens
    out["bert"] = {"tokens_per_s": tokens / best, "sequences_per_s": args.bert_sequences / best, "warmup_s": warm}
    print(f"{'BertModel':<10} {tokens / best:>12,.0f} tokens/s ({args.bert_sequences / best:,.0f} sequences/s)")
    import open_clip.model

    vision = open_clip.model.CLIPVisionCfg(
        layers=args.depth, width=args.hidden, head_width=64, patch_size=args.patch_side, image_size=args.image_side
    )
    tower = open_clip.model._build_vision_tower(args.hidden, vision).cuda().to(torch.bfloat16).eval()
    compiled = torch.compile(tower)
    pixels = torch.randn(args.vit_images, 3, args.image_side, args.image_side, device="cuda", dtype=torch.bfloat16)

    def run_vit() -> None:
        with torch.no_grad():
            compiled(pixels).float().sum().item()

    warm, best = timed(run_vit, args.repeats)
    out["open_clip_vit"] = {"images_per_s": args.vit_images / best, "warmup_s": warm}
    print(f"{'open_clip ViT':<13} {args.vit_images / best:>9,.0f} images/s (ready tensors)")
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    add_geometry(parser)
    parser.add_argument("--patch-side", type=int, default=16)
    add_channels(parser)
    parser.add_argument("--texts", type=int, default=8192)
    parser.add_argument("--text-bytes", type=int, default=255)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--image-side", type=int, default=256)
    parser.add_argument("--workers", type=int, default=0, help="decoder processes (0: one per core)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--file", action="store_true", help="also time uform encode's path (manifest -> Parquet)")
    parser.add_argument("--batch", type=int, default=4096, help="--file: records embedded at once")
    parser.add_argument("--width", type=int, default=None, help="--file: a Matryoshka width (default: full)")
    parser.add_argument("--dtype", default="f16", choices=("f32", "f16", "bf16", "i8"), help="--file: scalar type")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench-encode.json")
    parser.add_argument("--peers", action="store_true", help="also BertModel and open_clip's ViT (CUDA)")
    parser.add_argument(
        "--jpeg-device", action="store_true", help='also JPEGs decoded on the GPU (load(jpeg="device"), nvJPEG)'
    )
    parser.add_argument(
        "--profile", action="store_true", help="one more call of each kind under torch.profiler (tables under --out)"
    )
    parser.add_argument(
        "--phases", action="store_true", help="one more call of each kind with serving's stages timed per thread"
    )
    parser.add_argument("--spy", type=float, default=0, help="then calls again under py-spy for this many seconds")
    parser.add_argument(
        "--spy-gil", type=float, default=0, help="then calls again with the interpreter lock's holder sampled"
    )
    parser.add_argument("--spy-host", type=float, default=0, help="--spy of the serving host process")
    parser.add_argument("--spy-host-gil", type=float, default=0, help="--spy-gil of the serving host process")
    parser.add_argument("--timeline", action="store_true", help="one more call: its first batch, its steady rate")
    parser.add_argument(
        "--stream", type=int, default=0, help="also the same call N times as one stream (Model.encode_stream)"
    )
    parser.add_argument("--window", type=int, default=0, help="items decoded and sorted together (0: the model's)")
    parser.add_argument(
        "--pool-workers", default="0", help="decoder pool sizes for the decode row, comma-separated (0: --workers)"
    )
    parser.add_argument(
        "--packing",
        choices=("model", "run"),
        default="model",
        help="rows a batch packs into: the model's (wider rows under FlexAttention) or the run's own",
    )
    parser.add_argument(
        "--host-processes",
        default="auto",
        help="load(host_processes=N) (auto: the model's default); N,M: both, timed side by side",
    )
    parser.add_argument("--bert-sequences", type=int, default=1024)
    parser.add_argument("--bert-tokens", type=int, default=64)
    parser.add_argument("--vit-images", type=int, default=192)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    import uform as u

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict[str, Any] = {"geometry": vars(args), "device": name, "torch": torch.__version__}
    texts = topic_slices(args.texts, args.text_bytes)
    images = jpegs(args.images, args.image_side)
    with tempfile.TemporaryDirectory() as folder:
        model = build_model(args, folder)
        _, twinned, other = args.host_processes.partition(",")
        twin = build_model(args, folder, host_processes=int(other)) if twinned else None
        if twin is not None:
            twin.packing = model.packing
        for served in (model, twin):
            if served is not None and args.window:
                served.window = args.window
        if args.packing == "run":
            model.packing = (model.rows, model.columns)
        results["packing"] = list(model.packing)
        print(f"packing {model.packing[0]} rows x {model.packing[1]} columns a batch", flush=True)
        try:
            for kind, contents in (("text", texts), ("image", images)):
                if not contents:
                    continue
                modalities = [kind] * len(contents)
                cpu: dict[str, float] = {}
                warm, best = timed(lambda m=modalities, c=contents: model.encode(m, c), args.repeats, cpu)
                results[kind] = {"items": len(contents), "items_per_s": len(contents) / best, "warmup_s": warm}
                results[kind]["cpu"] = cpu
                busy = (
                    f"; host CPUs {cpu['host_busy']:.0%} busy of {cpu['host_cpus']:.0f}" if "host_busy" in cpu else ""
                )
                print(
                    f"{kind:<6} {len(contents) / best:>12,.1f} items/s  (warm-up {warm:.1f} s{busy}; this process and "
                    f"its children {cpu['ours']:.1f} cores)",
                    flush=True,
                )
                if args.stream:  # the same call `--stream` times over, as one stream (Model.encode_stream)
                    calls = [(modalities, contents)] * args.stream
                    _, took = timed(lambda c=calls: sum(1 for _ in model.encode_stream(c)), args.repeats)
                    rate = args.stream * len(contents) / took
                    results[f"{kind}_stream"] = {"calls": args.stream, "items": len(contents), "items_per_s": rate}
                    print(f"{kind}_stream {rate:>8,.1f} items/s  ({args.stream} calls of {len(contents)}, one stream)")
                    if args.profile:
                        call = lambda c=calls: sum(1 for _ in model.encode_stream(c))  # noqa: E731
                        results[f"{kind}_stream"]["profile"] = profiled(f"{kind}_stream", call, args.out)
                if twin is not None:  # side by side: the twin, then the model again
                    warm, alone = timed(lambda m=modalities, c=contents: twin.encode(m, c), args.repeats)
                    _, again = timed(lambda m=modalities, c=contents: model.encode(m, c), args.repeats)
                    best = min(best, again)
                    results[kind]["items_per_s"] = len(contents) / best
                    name = f"{kind}_host_{twin.host_processes}"
                    results[name] = {"items": len(contents), "items_per_s": len(contents) / alone, "warmup_s": warm}
                    print(f"{name:<6} {len(contents) / alone:>12,.1f} items/s  ({twin.host_processes} host processes)")
                    print(
                        f"{kind:<6} {len(contents) / again:>12,.1f} items/s  ({model.host_processes}, again)",
                        flush=True,
                    )
                if args.profile:
                    call = lambda m=modalities, c=contents: model.encode(m, c)  # noqa: E731
                    results[kind]["profile"] = profiled(kind, call, args.out)
                if args.phases:
                    results[kind]["phases"] = phases(model, modalities, contents, kind, args.out)
                if args.timeline:
                    results[kind]["timeline"] = timeline(model, modalities, contents, kind)
                spied = [(args.spy, False, ""), (args.spy_gil, True, ""), (args.spy_host, False, "-host")]
                spied.append((args.spy_host_gil, True, "-host"))
                for seconds, gil, whose in spied:
                    if seconds:  # calls for as long as py-spy samples (bench/spy.py)
                        hosts = model.host_pids if whose else []
                        if whose and not hosts:  # texts alone, or a model without host processes
                            print(f"--spy-host: no serving host process ran the {kind} calls", flush=True)
                            continue
                        name = f"encode-{kind}{whose}{'-gil' if gil else ''}"
                        with sampling(seconds, name, args.out, gil=gil, pid=hosts[0] if hosts else None):  # the first
                            until = time.perf_counter() + seconds
                            while time.perf_counter() < until:
                                model.encode(modalities, contents)
            if args.file:
                for kind, manifest in manifests(folder, texts, images).items():
                    if not (texts if kind == "text" else images):
                        continue
                    count = len(texts if kind == "text" else images)
                    out = os.path.join(folder, f"{kind}.parquet")
                    options = {"width": args.width, "dtype": args.dtype, "batch": args.batch}
                    warm, best = timed(
                        lambda m=manifest, o=out, kw=options: u.encode_file(model, m, o, **kw), args.repeats
                    )
                    name = f"{kind}_file"
                    results[name] = {"items": count, "items_per_s": count / best, "warmup_s": warm, **options}
                    print(f"{name:<10} {count / best:>8,.1f} items/s  (uform encode -> Parquet)", flush=True)
            if args.jpeg_device and images:
                on_device = build_model(args, folder, jpeg="device")
                on_device.packing = model.packing
                try:
                    modalities = ["image"] * len(images)
                    warm, best = timed(lambda: on_device.encode(modalities, images), args.repeats)
                    if args.profile:
                        trace = profiled("image_device", lambda: on_device.encode(modalities, images), args.out)
                    if args.phases:
                        stages = phases(on_device, modalities, images, "image_device", args.out)
                finally:
                    on_device.close()
                results["image_device"] = {"items": len(images), "items_per_s": len(images) / best, "warmup_s": warm}
                if args.profile:
                    results["image_device"]["profile"] = trace
                if args.phases:
                    results["image_device"]["phases"] = stages
                print(
                    f"{'image_device':<6} {len(images) / best:>6,.1f} items/s  (JPEGs decoded on the GPU)", flush=True
                )
        finally:
            model.close()
            if twin is not None:
                twin.close()
    if images:
        results["decode"] = decode_rates(args, images)
    if args.peers:
        results["peers"] = peer_rates(args)
        if "text" in results:
            positions = results["text"]["items_per_s"] * (args.text_bytes + 1)
            results["text_positions_per_s"] = positions
            results["text_vs_bert"] = positions / results["peers"]["bert"]["tokens_per_s"]
            print(f"uform text positions/s / BertModel tokens/s: {results['text_vs_bert']:.2f}")
        if "image" in results:
            results["image_vs_vit"] = (
                results["image"]["items_per_s"] / results["peers"]["open_clip_vit"]["images_per_s"]
            )
            print(f"uform JPEG images/s / open_clip ViT images/s: {results['image_vs_vit']:.2f}")
        if "image_device" in results:
            results["image_device_vs_vit"] = (
                results["image_device"]["items_per_s"] / results["peers"]["open_clip_vit"]["images_per_s"]
            )
            print(f"uform JPEG images/s decoded on the GPU / open_clip ViT: {results['image_device_vs_vit']:.2f}")
    write_json("bench-encode.json", results, args.out)
    sys.stdout.flush()
    return results


if __name__ == "__main__":
    main()
