"""Weak scaling of the world step: tokens/s on N GPUs against one, at the same per-device batch.

Per device, the reference geometry (docs/design.md §1): depth 12, hidden 512, 64 rows x 1024 columns, 256 segments, Objective.Joint
(span corruption + sigmoid contrastive); 256 text items of 255 bytes (with the prefix they fill the 64 rows
exactly), 128 attract pairs, each pair one bag, so every anchor is scored against every item of the world.
Steps go through `Trainer.deferred` with two in flight, stats read back every step.

    python bench/scaling.py [--devices 2] [--launcher torchrun|executor] [--steps 30] [--warmup 8]

--launcher torchrun (the default) runs this script under `torch.distributed.run` twice, with one process
and with --devices processes (one GPU each, `Mesh.from_env()`); --launcher executor runs
`Executor.for_vram([0])` and then `Executor.for_vram([0, ..., N-1])` (a worker process per device) in this
process. Prints tokens/s of both and the efficiency, tokens/s(N) / (N x tokens/s(1)); the bar is 0.90. Under torchrun each
figure holds process zero's peak GPU memory of its steps too (`peak_gib`).
NCCL_NVLS_ENABLE stays 0 unless set (the library's default); --world-compile blocks (or UFORM_WORLD_COMPILE=blocks
in the environment) compiles the world's step block by block (the gradient reduction overlaps backward) instead
of as one graph (the default; `Trainer.init_vram(..., world_compile=...)`).
--term (issue 16, item 2) runs every world a second time with the objective `Masked` (the same items, no
contrastive term) and reports the term's cost: the Joint step's time less the masked one's (`term_ms`, the pooled
all-gather and the loss over every item of the world, forward and backward) and its share of the Joint step
(`term_share`; the bar is 5% at 8 GPUs), and under torchrun the peak memory it adds (`term_peak_gib`).
Writes bench-scaling-<launcher>[-blocks].json under $OUT (or the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import (  # sibling modules, not a package
    add_geometry,
    bench_config,
    in_flight,
    pair_relations,
    topic_slices,
    write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BAR = 0.90


def step_inputs(args: argparse.Namespace, devices: int, offset: int) -> tuple[list[bytes], Any]:
    """The items of `devices` devices' worth of batch, pairs (2k, 2k + 1) attracting, each pair a bag."""
    n = args.segments * devices
    per_item = args.rows * args.columns // args.segments - 1  # prefix + content fill the rows exactly
    return topic_slices(n, per_item, offset), (pair_relations(n), [i // 2 for i in range(n)])


def measure(args: argparse.Namespace, trainer: Any, executor: Any, devices: int, offset: int) -> dict[str, Any]:
    """Times `args.steps` steps after `args.warmup` (compilation); answers per-step figures."""
    import uform as u

    contents, (relations, bags) = step_inputs(args, devices, offset)
    modalities = [u.Modality.Text] * len(contents)
    verbs = trainer.deferred(executor)
    stats = [u.TrainerStepStats() for _ in range(args.steps + args.warmup)]

    def run(k: int) -> Any:
        config = u.TrainerStepConfig(relations=relations, bags=bags, stats=stats[k])
        return verbs.step(modalities, contents, config)

    sync = torch.cuda.synchronize if not args.cpu and not executor.has_workers() else (lambda: None)
    t0 = time.perf_counter()
    in_flight(run, range(args.warmup), 0)
    warmup_s = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    in_flight(run, range(args.warmup, args.warmup + args.steps), 2)
    sync()
    seconds = (time.perf_counter() - t0) / args.steps
    return {
        "ms": seconds * 1e3,
        "tokens_per_device_step": args.rows * args.columns,
        "tokens_per_s": devices * args.rows * args.columns / seconds,
        "warmup_and_compile_s": warmup_s,
        "loss": stats[-1].loss,
        "first_loss": stats[0].loss,
        "dropped": stats[-1].dropped,
    }


def objectives(args: argparse.Namespace) -> list[Any]:
    """The objectives each world runs: Joint, then (with --term) Masked, the same step less the contrastive term."""
    import uform as u

    return [u.Objective.Joint, u.Objective.Masked] if args.term else [u.Objective.Joint]


def joined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One world's figures from its runs of `objectives`: the Joint run's, and with a masked run beside it the
    contrastive term's cost: the masked run's time, the difference and its share of the Joint step (and the peak
    memory the term adds, where both runs measured it)."""
    if len(runs) == 1:
        return runs[0]
    joint, masked = runs
    term = {"masked_ms": masked["ms"], "term_ms": joint["ms"] - masked["ms"]}
    term["term_share"] = term["term_ms"] / joint["ms"]
    if "peak_gib" in joint and "peak_gib" in masked:
        term["term_peak_gib"] = joint["peak_gib"] - masked["peak_gib"]
    return {**joint, **term}


# --------------------------------------------------------------------------------------------------
# torchrun: one process per GPU


def child(args: argparse.Namespace) -> None:
    """One process of a torchrun world: its share of the world's batch; process zero writes the figures."""
    import uform as u

    mesh = u.Mesh.from_env()
    d = mesh.describe()
    offset = d.ranks[0] * args.segments

    def run(objective: Any) -> dict[str, Any]:
        config = bench_config(args, mesh=mesh, objective=objective)
        trainer = u.Trainer.init_vram(mesh.executor, config, world_compile=args.world_compile)
        if not args.cpu:
            torch.cuda.reset_peak_memory_stats(trainer.device)
        found = measure(args, trainer, mesh.executor, 1, offset=offset)
        if not args.cpu:  # issue 16, item 2: a world's step must not grow with the world's items squared
            found["peak_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        if args.profile and objective == u.Objective.Joint:
            profile(args, trainer, mesh.executor, d.ranks[0], offset=offset)
        trainer.close()
        return found

    result = joined([run(objective) for objective in objectives(args)])
    result["tokens_per_s"] *= d.world_size
    result["world_size"] = d.world_size
    result["gpu_class"] = str(d.gpu_class)
    result["multimem_tier"] = str(d.multimem_tier)
    if d.ranks[0] == 0:
        Path(args.child).write_text(json.dumps(result))
    mesh.close()


def profile(args: argparse.Namespace, trainer: Any, executor: Any, rank: int, offset: int) -> None:
    """`args.profile` more steps under torch.profiler; the top operators by device and by host time go to
    $OUT/profile-world<W>-rank<r>.txt (where a world's step spends what one process's does not)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    saved = args.steps, args.warmup
    args.steps, args.warmup = args.profile, 0
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
        measure(args, trainer, executor, 1, offset)
    args.steps, args.warmup = saved
    world = int(os.environ.get("WORLD_SIZE", "1"))
    averages = recorded.key_averages()
    text = averages.table(sort_by="self_cuda_time_total", row_limit=30)
    text += "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30)
    out = Path(os.environ.get("OUT", ".")) / f"profile-world{world}-rank{rank}.txt"
    out.write_text(text)


def with_torchrun(args: argparse.Namespace, processes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command += [__file__, "--child", str(out), *sys.argv[1:]]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------------
# The executor: one process, a worker per GPU


def with_executor(args: argparse.Namespace, devices: int) -> dict[str, Any]:
    import uform as u

    if args.cpu:
        executor = u.Executor.cpu(workers=devices) if devices > 1 else u.Executor.cpu()
    else:
        executor = u.Executor.for_vram(list(range(devices)))

    def run(objective: Any) -> dict[str, Any]:
        config = bench_config(args, objective=objective)
        trainer = u.Trainer.init_vram(executor, config, world_compile=args.world_compile)
        found = measure(args, trainer, executor, devices, offset=0)
        trainer.close()
        return found

    result = joined([run(objective) for objective in objectives(args)])
    result["world_size"] = devices
    executor.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--launcher", choices=("torchrun", "executor"), default="torchrun")
    add_geometry(parser)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--profile", type=int, default=0, help="profile this many more steps per process")
    parser.add_argument(
        "--world-compile",
        choices=("whole", "blocks"),
        default=os.environ.get("UFORM_WORLD_COMPILE", "whole"),
        help="how the world's step compiles (Trainer.init_vram's world_compile)",
    )
    parser.add_argument(
        "--term", action="store_true", help="also run each world without the contrastive term; report the term's cost"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # a smoke test of the script
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if not args.cpu and torch.cuda.device_count() < args.devices:
        sys.exit(f"scaling: needs {args.devices} CUDA devices, this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    print(torch.__version__, device, f"launcher={args.launcher}", flush=True)
    launch = with_torchrun if args.launcher == "torchrun" else with_executor
    one = launch(args, 1)
    print("1 GPU ", one, flush=True)
    many = launch(args, args.devices)
    print(f"{args.devices} GPUs", many, flush=True)
    efficiency = many["tokens_per_s"] / (args.devices * one["tokens_per_s"])
    results = {
        "geometry": {k: v for k, v in vars(args).items() if k != "child"},
        "device": device,
        "torch": torch.__version__,
        "world_compile": args.world_compile,
        "one": one,
        "many": many,
        "efficiency": efficiency,
        "bar": BAR,
    }
    mode = "-blocks" if results["world_compile"] == "blocks" else ""
    write_json(f"bench-scaling-{args.launcher}{mode}.json", results)
    term = f" {'term ms':>9} {'term share':>11}" if args.term else ""
    print(f"\n{'GPUs':>5} {'ms/step':>9} {'tokens/s':>14}{term}")
    for count, r in ((1, one), (args.devices, many)):
        term = f" {r['term_ms']:>9.2f} {r['term_share']:>11.1%}" if args.term else ""
        print(f"{count:>5} {r['ms']:>9.2f} {r['tokens_per_s']:>14,.0f}{term}")
    verdict = "meets" if efficiency >= BAR else "misses"
    print(f"weak-scaling efficiency: {efficiency:.1%} ({verdict} the {BAR:.0%} bar)")


if __name__ == "__main__":
    main()
