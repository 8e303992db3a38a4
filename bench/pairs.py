"""Image-text contrastive training, side by side in one run: uform from JPEG bytes against open_clip's SigLIP on
ready tensors (issue 12, goal 1).

uform  one tower of `--depth` x `--hidden` (default 12 x 512) over `--pairs` 256 x 256 JPEGs (patch 16: 256
       patches and a prefix each) and as many ~60-byte captions a step, objective contrastive (sigmoid), every
       image attracting its caption; `--rows` x `--columns` with `--segments` (default: rows of 2048 columns, as
       many as the step's 318 positions a pair fill, 30 for 192 pairs; 2 x pairs segments). Rows of 1024 hold only
       three 257-position images each, so 64 x 1024 rows left 7% of a 192-pair step's positions padding.
       The JPEGs are decoded by the trainer's own decoders every step (distinct crops, cycled), packed and
       corrupted on the host, steps submitted through `Trainer.deferred` as many in flight as `uform.fit` keeps.
open_clip  `open_clip.model.CLIP` with two towers of the same depth and width (vision 256 px / patch 16, text
       context 64, 8 heads, no causal mask), `open_clip.loss.SigLipLoss` (Zhai et al. 2023), bf16 autocast,
       fused AdamW, `torch.compile`d, fed random preprocessed tensors of `--pairs` pairs (decoding excluded,
       which favours it). The same construction as ../shared/bench/anchor_openclip.py, written here again.

Both time the step period over `--steps` steps after `--warmup` (uform: between two completions; open_clip: CUDA
events around each step) and report the median pairs/s, then uform's ratio to open_clip. uform's rate counts pairs
trained: the items its steps dropped for lack of room (read from the stats of the last warm-up step and the last step)
are taken off as a pair each. With `--fed`, uform's steps run again with the prepare stage taken away (one prepared
step answered for every step, as bench/data_wait.py's fed run): the image-text step's data wait is 1 - fed / pipeline
step time, printed with the prepare stage's own period (`--steps` steps as many at a time as `uform.fit` keeps in
flight, all of them in the prepare stage when it holds the run up: bench/data_wait.py's `host` row), one step's
latency through it, and the step's media decoded alone in this process's own decoder pool (issue 12, goal 2).
open_clip is imported only for its side (`--skip-open-clip` leaves it out; it is not a dependency of uform's: on the
GPU machine carry open_clip_torch, ftfy and wcwidth as wheels). Writes bench-pairs.json under $OUT (or the current
folder).

`--channels 3` runs uform's images as RGB, as open_clip's are (the seed derives 4 channels, RGBA, so a quarter of
every image's bytes is a JPEG's always-opaque alpha).

With `--devices N` (N > 1) uform runs alone, on one device and then on N (`Executor.for_vram`, a worker process
a GPU; `--cpu`: CPU workers), `--pairs` pairs a device, each image and its caption one bag (routed whole to one
device; a device's step carries `--pairs` bags), and prints both rates and the weak scaling, pairs/s(N) / (N x
pairs/s(1)): the image-text step at 8 GPUs, whose decoding shares one host's cores (issue 16, item 4).

  python bench/pairs.py                      # the GPU, both sides
  python bench/pairs.py --skip-open-clip --fed   # uform's data wait on the image-text step
  python bench/pairs.py --skip-open-clip --in-flight 4  # a step more in flight than fit keeps
  python bench/pairs.py --prepare-only --steps 12  # its prepare stage alone, no steps (no compile)
  python bench/pairs.py --skip-open-clip --steps 400 --spy 8  # then its threads under py-spy (bench/spy.py)
  python bench/pairs.py --devices 8 --steps 20 --warmup 8  # uform on 1 and on 8 GPUs, --pairs each (issue 16)
  python bench/pairs.py --cpu --skip-open-clip --depth 1 --hidden 128 --pairs 4 --rows 4 --columns 640 --segments 8 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import (  # sibling scripts, not a package
    Fed,
    add_channels,
    add_geometry,
    bench_config,
    topic_slices,
    write_json,
)
from kernel_trace import load_events, report, summarize
from spy import sampling
from train_shards import jpeg

PAIR_POSITIONS = 257 + 61
"""A pair's positions in uform's rows: a 256 x 256 image at patch 16 (256 patches and a prefix) and a ~60-byte
caption with its prefix."""


def uform_rates(args: argparse.Namespace, devices: int = 1) -> dict[str, Any]:
    """pairs/s of each uform step (the period between two completions), the JPEGs decoded every step; with
    `--fed`, the same of the device stage alone, and the prepare stage's own time. Under `--devices` (the scaling
    mode) the step holds `--pairs` pairs a device over `devices` devices, each pair a bag (routed whole to one
    device), at one device as at several."""
    import uform as u
    from uform.fitting import steps_in_flight

    scaling = args.devices > 1
    batch: dict[str, Any] = {"image": u.ImageShape(patch_side=16, channels=args.channels)}
    if scaling:  # a device's step carries its `--pairs` bags, not the default 128
        batch["max_bags_per_device"] = args.pairs
    config = bench_config(args, objective=u.Objective.Contrastive, batch=batch)
    p = args.pairs * devices
    images = [jpeg(i) for i in range(4 * p)]  # four steps' worth of distinct crops, cycled
    captions = topic_slices(4 * p, 60)
    modalities = [u.Modality.Image] * p + [u.Modality.Text] * p
    relations = u.Relations(attract=u.Edges(offsets=list(range(2 * p + 1)), ids=[*range(p, 2 * p), *range(p)]))
    bags: list[int] = [*range(p), *range(p)] if scaling else []  # image i and caption i: bag i; []: each its own

    def contents(k: int) -> list[bytes]:  # step k's items: the k-th of the four steps' worth, cycled
        at = (k % 4) * p
        return [*images[at : at + p], *captions[at : at + p]]

    if args.cpu:
        executor = u.Executor.cpu(workers=devices) if devices > 1 else u.Executor.cpu()
    else:
        executor = u.Executor.for_vram(list(range(devices)))
    trainer = u.Trainer.init_vram(executor, config)
    answer: dict[str, Any] = {}
    try:
        deferred = trainer.deferred(executor)
        depth = args.in_flight or steps_in_flight(trainer)

        def drive(counted: Any) -> list[float]:
            """pairs/s of each of `--warmup` + `--steps` steps, `depth` in flight; the stats of the last warm-up
            step and the last step read into `counted` (each read waits for its step's losses): the count of
            items dropped for lack of room between the two."""
            in_flight: deque = deque()
            rates: list[float] = []
            finished = time.perf_counter()
            total = args.warmup + args.steps
            for k in range(total + depth):
                if k < total:
                    read = counted if k == total - 1 else u.TrainerStepStats() if k == args.warmup - 1 else None
                    step_config = u.TrainerStepConfig(relations=relations, bags=bags, stats=read)
                    in_flight.append(deferred.step(modalities, contents(k), step_config))
                    if len(in_flight) < depth:
                        continue
                if not in_flight:
                    break
                in_flight.popleft().result()
                now = time.perf_counter()
                rates.append(p / (now - finished))
                finished = now
            return rates[args.warmup :]

        if args.prepare_only or args.fed:  # one device, in this process (checked by main)
            replica = trainer.replica
            checked = replica.check_step(modalities, contents(0), u.TrainerStepConfig(relations=relations), False)
        if args.prepare_only:
            answer.update(prepare_stage(replica, checked, depth, args.steps))
            return answer
        counted = u.TrainerStepStats()
        answer["rates"] = drive(counted)
        answer["dropped"] = counted.dropped
        answer["pairs"] = p
        if args.fed:
            answer.update(prepare_stage(replica, checked, depth, args.steps))
            # The device stage alone: every step answered at once with one prepared step (its items' pairs).
            real = Fed.install(trainer, modalities, contents(0), u.TrainerStepConfig(relations=relations))
            answer["fed_rates"] = drive(u.TrainerStepStats())
            replica.stage = real
        if args.profile:
            profile_steps(deferred, args.profile, contents, modalities, relations)
        if args.spy:  # the same steps again, compiled already, this process's threads sampled (bench/spy.py)
            with sampling(args.spy, "pairs"):
                drive(u.TrainerStepStats())
    finally:
        trainer.close()
        executor.close()
    return answer


def prepare_stage(replica: Any, checked: Any, depth: int, steps: int) -> dict[str, Any]:
    """The image-text step's prepare stage with nothing else running: one step's latency through it, its media
    decoded alone in this process's own pool (on every core), and its period with `depth` steps at a time (as many
    as fit keeps in flight, all of them in the prepare stage when it holds the run up; bench/data_wait.py's `host`
    row), which goal 2 holds to half the device step. Every answer is dropped at once, as the trainer drops a step's
    host tensors after its copy, so page-locked blocks come back to the allocator's cache."""

    def prepare(step: int) -> None:
        replica.prepare(checked, step)

    alone = []
    for k in range(4):  # one step at a time, after one untimed
        started = time.perf_counter()
        prepare(10_000 + k)
        alone.append(time.perf_counter() - started)
    replica.decode(checked)  # starts this process's own decoder pool (the preparer processes' stay idle)
    decoded = []
    for _ in range(3):
        started = time.perf_counter()
        replica.decode(checked)
        decoded.append(time.perf_counter() - started)
    with ThreadPoolExecutor(depth, thread_name_prefix="bench-host") as pool:
        list(pool.map(prepare, range(10_100, 10_100 + 2 * depth)))
        started = time.perf_counter()
        list(pool.map(prepare, range(10_200, 10_200 + steps)))
        period = (time.perf_counter() - started) / steps
    return {
        "prepare_one_ms": statistics.median(alone[1:]) * 1e3,
        "decode_one_ms": statistics.median(decoded) * 1e3,
        "prepare_at_once": depth,
        "prepare_ms": period * 1e3,
    }


def profile_steps(deferred: Any, steps: int, contents: Any, modalities: list, relations: Any) -> None:
    """The device's kernels over `steps` more steps, by total device time (torch.profiler), where the steps' device
    time goes (bench/kernel_trace.py), and a Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import uform as u

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        futures = [
            deferred.step(modalities, contents(k), u.TrainerStepConfig(relations=relations)) for k in range(steps)
        ]
        for future in futures:
            future.result()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    folder = os.environ.get("OUT", ".")
    os.makedirs(folder, exist_ok=True)  # the profiler does not make it, and would lose the steps' summary
    trace = os.path.join(folder, "pairs-trace.json")
    prof.export_chrome_trace(trace)
    print(report(summarize(load_events(trace), steps), "profiled uform steps"))


def open_clip_rates(args: argparse.Namespace) -> list[float]:
    """pairs/s of each compiled open_clip SigLIP step on random preprocessed tensors (CUDA events)."""
    import open_clip.model
    import torch
    from open_clip.loss import SigLipLoss

    vision = {"image_size": 256, "layers": args.depth, "width": args.hidden, "patch_size": 16, "head_width": 64}
    text = {
        "context_length": 64,
        "vocab_size": 32000,
        "width": args.hidden,
        "heads": args.hidden // 64,
        "layers": args.depth,
        "no_causal_mask": True,
        "pool_type": "last",
    }
    model = open_clip.model.CLIP(embed_dim=args.hidden, vision_cfg=vision, text_cfg=text, init_logit_bias=-10)
    model = model.cuda().train()
    loss = SigLipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(model)
    pixels = torch.randn(args.pairs, 3, 256, 256, device="cuda")
    tokens = torch.randint(1, 30000, (args.pairs, 64), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(pixels, tokens)
            if isinstance(out, dict):
                out = (out["image_features"], out["text_features"], out["logit_scale"], out["logit_bias"])
            value = loss(out[0], out[1], out[2], out[3])
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    rates = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        rates.append(args.pairs / (start.elapsed_time(end) / 1e3))
    return rates


def trained_rate(uform: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The median pairs/s of a run's steps, pairs trained only: an item dropped for lack of room (counted from the
    stats of the last warm-up step to the last step's) leaves its pair untrained, so it is taken off as a pair."""
    steps = args.steps if args.warmup > 0 else args.steps + args.warmup
    trained = max(0.0, 1.0 - uform["dropped"] / (uform["pairs"] * steps))
    return {
        "pairs_per_second": statistics.median(uform["rates"]) * trained,
        "dropped": uform["dropped"],
        "steps": steps,
    }


def stage_result(uform: dict[str, Any], fed_ms: float | None) -> dict[str, Any]:
    """The prepare stage's figures (`prepare_stage`) as bench-pairs.json holds them, printed."""
    share = f" ({uform['prepare_ms'] / fed_ms:.0%} of the fed step)" if fed_ms else ""
    print(
        f"uform prepare stage alone: {uform['prepare_ms']:.1f} ms/step {uform['prepare_at_once']} at a time{share}; "
        f"{uform['prepare_one_ms']:.1f} ms for one step, its media decoded alone on a pool of every core "
        f"{uform['decode_one_ms']:.1f} ms",
        flush=True,
    )
    return {f"uform_{key}": uform[key] for key in ("prepare_ms", "prepare_one_ms", "prepare_at_once", "decode_one_ms")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_geometry(parser, rows=0, columns=2048, segments=0)  # --rows 0: sized to the step; --segments 0: two per pair
    parser.add_argument("--pairs", type=int, default=192)
    add_channels(parser)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="uform on the CPU (a smoke run; open_clip needs CUDA)")
    parser.add_argument("--skip-open-clip", action="store_true")
    parser.add_argument(
        "--in-flight", type=int, default=0, help="uform steps submitted and unfinished at once (0: as uform.fit keeps)"
    )
    parser.add_argument("--profile", type=int, default=0, help="then profile this many more uform steps")
    parser.add_argument(
        "--spy", type=float, default=0, help="then run the steps again under py-spy for this many seconds"
    )
    parser.add_argument(
        "--fed", action="store_true", help="then uform's device stage alone (the prepare stage fed): its data wait"
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="uform's prepare stage alone (as --fed measures it), no steps"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="N > 1: uform alone on 1 and on N devices (--pairs a device, each pair a bag), and the efficiency",
    )
    args = parser.parse_args(argv)
    args.segments = args.segments or 2 * args.pairs
    args.rows = args.rows or -(-args.pairs * PAIR_POSITIONS // args.columns)
    if args.devices < 1:
        parser.error(f"--devices: must be at least 1, got {args.devices}")
    if args.devices > 1 and (args.fed or args.prepare_only or args.profile or args.spy):
        parser.error(
            "--devices: --fed, --prepare-only, --profile and --spy look into one device's pipeline; run them alone"
        )

    import torch

    result: dict[str, Any] = {
        "geometry": {
            k: getattr(args, k) for k in ("depth", "hidden", "pairs", "rows", "columns", "segments", "channels")
        },
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    if args.devices > 1:  # the image-text step's weak scaling (issue 16, item 4); open_clip is not run
        one, many = trained_rate(uform_rates(args, 1), args), trained_rate(uform_rates(args, args.devices), args)
        result["devices"] = args.devices
        result["one"], result["many"] = one, many
        result["efficiency"] = many["pairs_per_second"] / (args.devices * one["pairs_per_second"])
        for label, figure in (("1 device ", one), (f"{args.devices} devices", many)):
            print(f"uform, {label}: {figure['pairs_per_second']:,.0f} pairs/s ({figure['dropped']} items dropped)")
        print(f"weak scaling: {result['efficiency']:.1%}", flush=True)
        print(write_json("bench-pairs.json", result))
        return result
    uform = uform_rates(args)
    if args.prepare_only:
        result.update(stage_result(uform, None))
        print(write_json("bench-pairs.json", result))
        return result
    figure = trained_rate(uform, args)
    dropped = figure["dropped"]
    result["uform_items_dropped"] = dropped
    result["uform_pairs_per_second"] = figure["pairs_per_second"]
    print(
        f"uform, from JPEG bytes:            {result['uform_pairs_per_second']:,.0f} pairs/s "
        f"(pairs trained: {dropped} of {2 * uform['pairs'] * figure['steps']} items dropped for room)",
        flush=True,
    )
    if args.fed:
        step_ms = args.pairs / statistics.median(uform["rates"]) * 1e3
        fed_ms = args.pairs / statistics.median(uform["fed_rates"]) * 1e3
        result["uform_step_ms"], result["uform_fed_ms"] = step_ms, fed_ms
        result["uform_data_wait"] = 1 - fed_ms / step_ms
        print(
            f"uform step {step_ms:.2f} ms, fed (device stage alone) {fed_ms:.2f} ms: data wait "
            f"{result['uform_data_wait']:.1%}",
            flush=True,
        )
        result.update(stage_result(uform, fed_ms))
    if not args.skip_open_clip:
        result["open_clip_pairs_per_second"] = statistics.median(open_clip_rates(args))
        result["ratio"] = result["uform_pairs_per_second"] / result["open_clip_pairs_per_second"]
        print(f"open_clip SigLIP, ready tensors:   {result['open_clip_pairs_per_second']:,.0f} pairs/s")
        print(f"ratio (uform / open_clip): {result['ratio']:.3f}")
    print(write_json("bench-pairs.json", result))
    return result


if __name__ == "__main__":
    main()
