"""Where a trainer step's time goes on one GPU: torch.profiler over a few steps of the bench geometry.

Prints the kernels by total CUDA time, the wall time per step and where the profiled steps' device time goes
(bench/kernel_trace.py: kernels, busy, span, the gaps and the host calls in the longest); writes a Chrome trace to
$OUT/step-trace.json. `--fed` profiles the device stage alone (every step handed one prepared step, as
bench/step.py --fed times it). `--sync-debug` first runs a few steps under `torch.cuda.set_sync_debug_mode("warn")`
and prints each distinct Python stack that made the host wait for the device (a synchronizing copy, an `.item()`,
a blocking allocation): any such wait inside a step empties the device's queue. Usage:
python bench/profile_step.py [--steps 4] [--fed] [--sync-debug] (same geometry flags as step.py).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
import warnings

import torch
from common import Fed, add_geometry, pair_relations, topic_slices  # type: ignore[import-not-found]
from kernel_trace import load_events, report, summarize  # type: ignore[import-not-found]
from torch.profiler import ProfilerActivity, profile

import uform as u


def sync_stacks(run: object) -> None:
    """Runs `run()` under the CUDA sync debug mode and prints each distinct stack that synchronized (any thread)."""
    seen: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
        if "synchroniz" not in str(message):
            shown(message, category, filename, lineno, file, line)
            return
        stack = "".join(traceback.format_stack()[:-2][-12:])
        seen[stack] = seen.get(stack, 0) + 1

    with warnings.catch_warnings():  # restores the filters and `showwarning` on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()  # type: ignore[operator]
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"synchronizing calls over 4 steps: {sum(seen.values())} from {len(seen)} stacks", flush=True)
    for stack, count in sorted(seen.items(), key=lambda kv: -kv[1]):
        print(f"--- {count} times:\n{stack}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_geometry(parser)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--objective", default="joint")
    parser.add_argument("--fed", action="store_true", help="the device stage alone: one prepared step for every step")
    parser.add_argument("--sync-debug", action="store_true", help="print the stacks that synchronize with the device")
    args = parser.parse_args()
    executor = u.Executor.for_vram([0])
    trainer = u.Trainer.init_vram(
        executor,
        u.TrainerInitVramConfig(
            depth=args.depth,
            hidden=args.hidden,
            objective=u.Objective.parse(args.objective),
            batch=u.BatchShape(
                max_rows_per_device=args.rows, max_segments_per_device=args.segments, max_columns_per_row=args.columns
            ),
            schedule=u.Schedule(steps=1000),
            seed=1,
        ),
    )
    n = args.segments
    items = topic_slices(n, args.rows * args.columns // n - 1)
    relations = pair_relations(n)
    verbs = trainer.deferred(executor)

    def step(stats: bool) -> object:
        config = u.TrainerStepConfig(relations=relations, stats=u.TrainerStepStats() if stats else None)
        return verbs.step([u.Modality.Text] * n, items, config)

    if args.fed:
        Fed.install(trainer, [u.Modality.Text] * n, items, u.TrainerStepConfig(relations=relations))
    for _ in range(6):
        step(True).result()
    torch.cuda.synchronize()
    if args.sync_debug:
        sync_stacks(lambda: [f.result() for f in [step(True) for _ in range(4)]])
    for stats in (False, True):
        t0 = time.perf_counter()
        futures = [step(stats) for _ in range(10)]
        for f in futures:
            f.result()
        torch.cuda.synchronize()
        print(f"wall ms/step, stats={stats}: {(time.perf_counter() - t0) / 10 * 1e3:.2f}", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        futures = [step(True) for _ in range(args.steps)]
        for f in futures:
            f.result()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    folder = os.environ.get("OUT", ".")
    os.makedirs(folder, exist_ok=True)  # the profiler does not make it, and would lose the steps' summary
    trace = os.path.join(folder, "step-trace.json")
    prof.export_chrome_trace(trace)
    print(report(summarize(load_events(trace), args.steps), "fed steps" if args.fed else "steps"))


if __name__ == "__main__":
    main()
