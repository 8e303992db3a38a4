"""Training-step throughput of uform's trainer beside Hugging Face's BertForMaskedLM, in one run.

Both at the same geometry (default: the reference geometry of docs/design.md §1, depth 12 x hidden 512, 64 rows x 1024 columns, 256
segments per device), bf16 autocast, fused AdamW, full steps (forward, loss, backward, update):

  uform_joint   Trainer.deferred(...).step of an Objective.Joint text step (span corruption + sigmoid
                contrastive over 128 attract pairs, ambient negatives), stats read back every step,
                two steps in flight; items are 255-byte slices of CPython's pydoc topics, so the 256
                segments fill the 64 rows exactly.
  --fed         then the same steps with the prepare stage taken away (one prepared step answered for every
                step, bench/data_wait.py's fed run): the device stage alone, against which the step's wall
                shows the host's share.
  --spy S       then the timed steps again with this process's threads sampled by py-spy for S seconds
                (bench/spy.py): which thread launches late, and what it does instead.
  hf_bert       transformers' BertForMaskedLM (SDPA attention) on random ids and labels over every
                position, as ../shared/bench/anchor_gpu.py measures it.

Model FLOPs utilisation (`mfu`) counts useful FLOPs only: 6 x the tower's parameters (12 D² a block) x the step's
positions, plus same-segment attention (4 L² K H per segment of L positions per block forward, 3.5x that for
forward + backward); embeddings, heads, the optimizer and padding are not counted. It is taken against
`--peak-tflops` (776: the bf16 matrix-multiply rate measured on the H200, ../shared/bench/anchor-h200.json).

Prints a table and writes bench-step.json under $OUT (or the current folder). Usage:
  python bench/step.py [--depth 12 --hidden 512 --rows 64 --columns 1024 --segments 256 --steps 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # sibling modules, not a package
    Fed,
    add_geometry,
    bench_config,
    bert_config,
    in_flight,
    pair_relations,
    thread_cpu_per_step,
    thread_cpu_seconds,
    topic_slices,
    write_json,
)
from spy import sampling


def useful_flops(depth: int, hidden: int, rows: int, columns: int, segments: int) -> float:
    """The useful FLOPs of one training step over `segments` equal segments filling `rows` x `columns`."""
    positions = rows * columns
    length = positions / segments
    matrices = 6.0 * depth * 12 * hidden * hidden * positions
    attention = 3.5 * depth * segments * 4.0 * length * length * hidden  # K x H = D
    return matrices + attention


def bench_uform(args: argparse.Namespace) -> dict:
    import uform as u

    executor = u.Executor.for_vram([0])
    config = bench_config(args)
    trainer = u.Trainer.init_vram(executor, config, host_processes=args.host_processes)
    n = args.segments
    per_item = args.rows * args.columns // n - 1  # prefix + content fill the rows exactly
    items = topic_slices(n, per_item)
    relations = pair_relations(n)
    modalities = [u.Modality.Text] * n
    verbs = trainer.deferred(executor)
    stats = [u.TrainerStepStats() for _ in range(args.steps + args.warmup)]

    def run(k: int):
        return verbs.step(modalities, items, u.TrainerStepConfig(relations=relations, stats=stats[k]))

    t0 = time.perf_counter()
    # The warm-up goes in flight as the timed steps do, so every preparer process has taken steps before the clock.
    in_flight(run, range(args.warmup), args.in_flight)
    compile_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    in_flight(run, range(args.warmup, args.warmup + args.steps), args.in_flight)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    last_loss, last_dropped, first_loss = (
        stats[-1].loss,
        stats[-1].dropped,
        stats[0].loss,
    )  # read before a fed run writes the same stats again
    if args.spy:  # the same steps again, compiled already, this process's threads sampled (bench/spy.py)
        with sampling(args.spy, "step"):
            in_flight(run, range(args.warmup, args.warmup + args.steps), args.in_flight)
        torch.cuda.synchronize()
    positions = args.rows * args.columns
    fed = {}
    if args.fed:  # the same steps with the prepare stage taken away: the device stage alone
        real = Fed.install(trainer, modalities, items, u.TrainerStepConfig(relations=relations))
        in_flight(run, range(args.warmup), args.in_flight)
        torch.cuda.synchronize()
        cpu = thread_cpu_seconds()
        t0 = time.perf_counter()
        in_flight(run, range(args.warmup, args.warmup + args.steps), args.in_flight)
        torch.cuda.synchronize()
        fed = {
            "fed_ms": (time.perf_counter() - t0) / args.steps * 1e3,
            # Whose CPU a fed step takes: the device thread's launches, autograd's thread's (the backward's).
            "fed_thread_cpu_ms": thread_cpu_per_step(cpu, thread_cpu_seconds(), args.steps),
        }
        trainer.replica.stage = real
    trainer.close()
    return {
        **fed,
        "ms": seconds * 1e3,
        "tokens_per_s": positions / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "warmup_and_compile_s": compile_s,
        "loss": last_loss,
        "dropped": last_dropped,
        "first_loss": first_loss,
        "mfu": useful_flops(args.depth, args.hidden, args.rows, args.columns, args.segments)
        / seconds
        / (args.peak_tflops * 1e12),
    }


def bench_bert(args: argparse.Namespace) -> dict:
    from transformers import BertForMaskedLM

    config = bert_config(args.depth, args.hidden, 260, args.columns)
    model = BertForMaskedLM(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 256, (args.rows, args.columns), device="cuda")
    labels = torch.randint(0, 256, (args.rows, args.columns), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    out = {
        "ms": seconds * 1e3,
        "tokens_per_s": args.rows * args.columns / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry(parser)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--skip-bert", action="store_true")
    parser.add_argument(
        "--host-processes", type=int, default=None, help="Trainer.init_vram(host_processes=); default: the trainer's"
    )
    parser.add_argument("--peak-tflops", type=float, default=776.0, help="the GPU's measured bf16 matmul rate")
    parser.add_argument("--in-flight", type=int, default=2, help="answers left pending while the next is submitted")
    parser.add_argument("--fed", action="store_true", help="then time the device stage alone (the prepare stage fed)")
    parser.add_argument(
        "--spy", type=float, default=0, help="then run the steps again under py-spy for this many seconds"
    )
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results = {"geometry": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["uform_joint"] = bench_uform(args)
    print("uform_joint", results["uform_joint"], flush=True)
    if not args.skip_bert:
        results["hf_bert"] = bench_bert(args)
        print("hf_bert", results["hf_bert"], flush=True)
        results["speedup_vs_bert"] = results["uform_joint"]["tokens_per_s"] / results["hf_bert"]["tokens_per_s"]
    write_json("bench-step.json", results)
    print(f"\n{'variant':<14} {'ms/step':>9} {'tokens/s':>12} {'peak GiB':>9}")
    for name in ("uform_joint", "hf_bert"):
        if name in results:
            r = results[name]
            print(f"{name:<14} {r['ms']:>9.2f} {r['tokens_per_s']:>12,.0f} {r['peak_gib']:>9.2f}")
    if "fed_ms" in results["uform_joint"]:
        fed = results["uform_joint"]["fed_ms"]
        print(
            f"uform_joint fed (device stage alone): {fed:.2f} ms/step; data wait {1 - fed / results['uform_joint']['ms']:.1%}"
        )
        busiest = list(results["uform_joint"]["fed_thread_cpu_ms"].items())[:6]
        print("  CPU ms a fed step, by thread: " + ", ".join(f"{name} {ms:.1f}" for name, ms in busiest))
    print(
        f"uform model FLOPs utilisation: {100 * results['uform_joint']['mfu']:.1f}% of {args.peak_tflops:.0f} TFLOP/s"
    )
    if "speedup_vs_bert" in results:
        print(f"uform / BERT tokens/s: {results['speedup_vs_bert']:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
