"""The cost of the late-interaction and choices terms: full training steps with each term off and on.

Four runs at one geometry (default: a small CPU one, depth 2 x hidden 128, 8 rows x 256 columns, 32
segments; `--device cuda --reference-geometry` gives docs/design.md §1's 12 x 512, 64 x 1024, 256 segments):

  base      Objective.Joint (span corruption + sigmoid contrastive over attract pairs i <-> i ^ 1)
  late      + late interaction (weight 1, width 128, span 64): even items queries, odd items documents
  choices   + choices (weight 1) on every fourth item, 4 legal bytes each
  both      + both terms

Blocking steps, stats read back every step; prints the median step time (and on CUDA the peak memory)
per run and writes bench-objectives.json under $OUT (or the current folder). Usage:
  python bench/objectives.py [--device cpu|cuda] [--reference-geometry] [--steps 10]
(`--seed-geometry` is its earlier name, kept for the commands in BENCHMARKS.md.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import (  # sibling modules, not a package
    add_geometry,
    bench_config,
    pair_relations,
    topic_slices,
    write_json,
)


def run(args: argparse.Namespace, name: str) -> dict:
    import uform as u

    late = name in ("late", "both")
    choices = name in ("choices", "both")
    executor = u.Executor.cpu() if args.device == "cpu" else u.Executor.for_vram([0])
    config = bench_config(
        args,
        batch={"max_choices_per_item": 4 if choices else 0},
        late_interaction=u.LateInteraction(weight=1.0 if late else 0.0),
        choices=u.Choices(weight=1.0 if choices else 0.0),
    )
    trainer = u.Trainer.init_vram(executor, config)
    n = args.segments
    per_item = args.rows * args.columns // n - 3  # prefix, side marker and an appended MASK fit
    items = topic_slices(n, per_item)
    relations = pair_relations(n)
    step = u.TrainerStepConfig(relations=relations)
    if late:
        step.sides = ["query" if i % 2 == 0 else "document" for i in range(n)]
    if choices:
        step.choices = [b"abcd" if i % 4 == 0 else b"" for i in range(n)]
        step.choice_targets = [[0.1, 0.2, 0.3, 0.4] if i % 4 == 0 else [] for i in range(n)]
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for k in range(args.warmup + args.steps):
        stats = u.TrainerStepStats()
        step.stats = stats
        start = time.perf_counter()
        trainer.on(executor).step([u.Modality.Text] * n, items, step)
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
    trainer.close()
    out = {
        "run": name,
        "median_step_s": statistics.median(times),
        "late_interaction_loss": stats.late_interaction_loss,
        "choices_loss": stats.choices_loss,
        "dropped": stats.dropped,
    }
    if args.device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--reference-geometry", "--seed-geometry", dest="reference_geometry", action="store_true")
    add_geometry(parser, depth=2, hidden=128, rows=8, columns=256, segments=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", default="base,late,choices,both")
    args = parser.parse_args()
    if args.reference_geometry:
        args.depth, args.hidden, args.rows, args.columns, args.segments = 12, 512, 64, 1024, 256
    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    results = [run(args, name) for name in args.runs.split(",")]
    base = results[0]["median_step_s"]
    print(
        f"{args.device}: depth {args.depth} x hidden {args.hidden}, {args.rows} x {args.columns}, {args.segments} segments"
    )
    for r in results:
        extra = f"  peak {r['peak_gib']:.2f} GiB" if "peak_gib" in r else ""
        print(f"  {r['run']:8s} {1000 * r['median_step_s']:9.1f} ms  x{r['median_step_s'] / base:.2f}{extra}")
    path = write_json("bench-objectives.json", {"args": vars(args), "results": results})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
