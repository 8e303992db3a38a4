"""The loss of a short real run, window by window: for A/B runs of a numerics change (two trees, same seed and data).

A text `Objective.Joint` run over pydoc topics (`common.topic_slices`, fresh items every step, every row filled),
pairs 2k and 2k + 1 attracting, a schedule as long as the run; one blocking `Trainer.step` at a time on the first
GPU (or the CPU with `--cpu`). Prints the mean loss of each `--window` steps and whether every loss was finite;
writes bench-loss-curve.json under $OUT (or the current folder). Usage:
  python bench/loss_curve.py [--steps 600 --seed 7 --rows 16 --segments 64]
and from an archived tree of the parent, `cd old && PYTHONPATH=$PWD python bench/loss_curve.py ...` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_geometry, bench_config, pair_relations, topic_slices, write_json


def main(argv: Sequence[str] | None = None) -> dict:
    import uform as u

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry(parser, rows=16, segments=64)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--window", type=int, default=50, help="steps averaged into one point of the curve")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke run)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.window < 1:
        raise ValueError("--steps and --window: at least 1")
    executor = u.Executor.cpu() if args.cpu else u.Executor.for_vram([0])
    config = bench_config(args, schedule=u.Schedule(steps=args.steps), seed=args.seed)
    trainer = u.Trainer.init_vram(executor, config)
    n = args.segments
    per_item = args.rows * args.columns // n - 1  # prefix + content fill the rows exactly
    relations = pair_relations(n)
    modalities = [u.Modality.Text] * n
    losses: list[float] = []
    t0 = time.perf_counter()
    for k in range(args.steps):
        stats = u.TrainerStepStats()
        items = topic_slices(n, per_item, offset=k * n)
        trainer.step(modalities, items, u.TrainerStepConfig(relations=relations, stats=stats))
        losses.append(float(stats.loss))
    seconds = time.perf_counter() - t0
    trainer.close()
    w = args.window
    curve = [sum(losses[i : i + w]) / len(losses[i : i + w]) for i in range(0, len(losses), w)]
    results = {
        "geometry": vars(args),
        "seconds": seconds,
        "window": w,
        "curve": curve,
        "finite": all(math.isfinite(x) for x in losses),
        "last": losses[-1],
    }
    print(f"{args.steps} steps in {seconds:.1f} s; mean loss of each {w} steps:")
    print(" ".join(f"{x:.4f}" for x in curve))
    print("every loss finite" if results["finite"] else "NOT every loss finite")
    write_json("bench-loss-curve.json", results)
    return results


if __name__ == "__main__":
    main()
