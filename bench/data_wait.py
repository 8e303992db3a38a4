"""The share of a training step spent waiting for data, with 256 x 256 JPEGs beside text.

A trainer at the seed's geometry (default depth 12 x hidden 512, 64 rows x 1024 columns, 256 segments,
image patch 16, RGBA) takes `--steps` Joint steps of `--images` JPEGs (cut from scikit-image's photographs,
each a different crop so no two items are the same bytes) beside `--texts` captions, submitted through
`Trainer.deferred` with two steps in flight, the way a data loader drives it. Two runs:

  pipeline   the real thing: every step decodes its JPEGs in the worker pool, packs, corrupts and pins on
             the host thread while the device runs the step before.
  fed        the same steps with the host stage's answer computed once ahead and handed over at once, so
             the device never waits: the step time of a data loader that is infinitely fast.

The data wait is the difference: wait share = 1 - fed / pipeline (per step, medians over the timed
steps). The host stage's time alone (`Trainer._prepare`, decode included) is printed beside it.

Prints a table and writes bench-data-wait.json under $OUT (or the current folder). Usage:
  python bench/data_wait.py [--executor cuda] [--images 128 --texts 128 --steps 20 --warmup 5 --workers 0]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import sys
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import joint_config, topic_text  # sibling scripts, not a package
from decode import PHOTOS, photo


def crops(count: int, side: int = 256) -> list[bytes]:
    """`count` distinct side x side JPEGs: sliding square crops of the sample photographs."""
    from PIL import Image

    out = []
    for i in range(count):
        image = photo(PHOTOS[i % len(PHOTOS)])
        short = min(image.size)
        window = short * 3 // 4
        offset = (i // len(PHOTOS)) * 7 % max(1, short - window)
        box = (offset, offset, offset + window, offset + window)
        buffer = io.BytesIO()
        image.crop(box).resize((side, side), Image.Resampling.BILINEAR).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def step_items(args: argparse.Namespace) -> tuple[list[Any], list[bytes], Any]:
    import uform as u

    text = topic_text()
    modalities = [u.Modality.Image] * args.images + [u.Modality.Text] * args.texts
    contents = crops(args.images) + [text[i * args.text_bytes : (i + 1) * args.text_bytes] for i in range(args.texts)]
    pairs = min(args.images, args.texts)
    ids = [[args.images + i] if i < pairs else [] for i in range(args.images)]
    ids += [[i] if i < pairs else [] for i in range(args.texts)]
    offsets = np.cumsum([0] + [len(x) for x in ids]).tolist()
    relations = u.Relations(attract=u.Edges(offsets=offsets, ids=[j for x in ids for j in x]))
    return modalities, contents, relations


def timed_steps(trainer: Any, modalities: list[Any], contents: list[bytes], relations: Any, args: argparse.Namespace):
    """Seconds per step over the timed steps (two in flight), after `args.warmup` untimed ones."""
    import uform as u

    verbs = trainer.deferred(trainer.executor)
    stats = u.TrainerStepStats()

    def run(count: int) -> float:
        started = time.perf_counter()
        pending: list[Future] = []
        for _ in range(count):
            pending.append(verbs.step(modalities, contents, u.TrainerStepConfig(relations=relations, stats=stats)))
            if len(pending) == 2:
                pending.pop(0).result()
        for future in pending:
            future.result()
        return (time.perf_counter() - started) / count

    run(args.warmup)
    return run(args.steps), stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executor", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--workers", type=int, default=0, help="decoder processes; 0: one per core")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--columns", type=int, default=1024)
    parser.add_argument("--segments", type=int, default=256)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--text-bytes", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--switch-interval", type=float, default=0.0, help="sys.setswitchinterval seconds (0: Python's 5 ms)"
    )
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    import torch

    import uform as u
    from uform.media.decode import MediaPolicy

    executor = u.Executor.for_vram([0]) if args.executor == "cuda" else u.Executor.cpu()
    config = joint_config(args, batch={"image": u.ImageShape(patch_side=16, channels=4)})
    modalities, contents, relations = step_items(args)
    trainer = u.Trainer.init_vram(executor, config, media=MediaPolicy(workers=args.workers))
    try:
        pipeline, stats = timed_steps(trainer, modalities, contents, relations, args)
        checked = trainer._check_step(modalities, contents, u.TrainerStepConfig(relations=relations), False)
        prepare = []
        for step in range(3):
            started = time.perf_counter()
            prepared = trainer._prepare(checked, 10_000 + step)
            prepare.append(time.perf_counter() - started)
        real_prepare = trainer._prepare
        trainer._prepare = lambda checked, step: prepared  # type: ignore[method-assign]
        fed, _ = timed_steps(trainer, modalities, contents, relations, args)
        trainer._prepare = real_prepare  # type: ignore[method-assign]
        workers = trainer._decoders.workers if trainer._decoders is not None else 0
    finally:
        trainer.close()
    batch = prepared[0]
    tokens = int((batch.segments < args.segments).sum())
    result = {
        "device": torch.cuda.get_device_name(0) if args.executor == "cuda" else "cpu",
        "cores": len(os.sched_getaffinity(0)),
        "decode_workers": workers,
        "geometry": {"depth": args.depth, "hidden": args.hidden, "rows": args.rows, "columns": args.columns},
        "items": {"images": args.images, "texts": args.texts, "text_bytes": args.text_bytes},
        "placed": int(batch.layout.placed.sum()),
        "dropped": batch.dropped,
        "tokens_per_step": tokens,
        "pipeline_ms": pipeline * 1e3,
        "fed_ms": fed * 1e3,
        "wait_share": max(0.0, 1 - fed / pipeline),
        "prepare_ms": float(np.median(prepare) * 1e3),
        "switch_interval_s": sys.getswitchinterval(),
        "loss": stats.loss,
        "masked_image_loss": stats.masked_image_loss,
    }
    print(
        f"{args.images} JPEGs 256x256 + {args.texts} texts of {args.text_bytes} B, {result['placed']} placed, "
        f"{result['dropped']} dropped, {tokens} tokens/step, {workers} decoders on {result['cores']} cores, "
        f"{result['device']}:\n"
        f"  pipeline {result['pipeline_ms']:.1f} ms/step, fed {result['fed_ms']:.1f} ms/step -> data wait "
        f"{100 * result['wait_share']:.1f}% of the step; host stage alone {result['prepare_ms']:.1f} ms/step; "
        f"loss {stats.loss:.3f} (image {stats.masked_image_loss:.3f})"
    )
    path = os.path.join(os.environ.get("OUT") or ".", "bench-data-wait.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":  # the decoder processes start through forkserver: keep the work behind this guard
    main()
