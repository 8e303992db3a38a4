"""Would CUDA graphs shorten uform's device step? (issue 12, goal 4)

The reference text step's kernels take ~42 ms of a ~45 ms fed step on the H200 (BENCHMARKS.md, "Issue 12,
seventh day": ~700 kernels a step, 1.46 ms of gaps between them). A CUDA graph replays a step's kernels without a
launch each. This times the network of a `Trainer` (its weights, attention path, tile side and fused AdamW) on
one prepared batch, outside the trainer's verbs, four ways, each over `--steps` steps after `--warmup` (wall
clock, the device synchronised at both ends, with the host's time to submit the steps beside it):

  compiled   `torch.compile(network.losses, dynamic=False)`, as the trainer compiles it: forward under bf16
             autocast, `Network.total`, backward, the trainer's optimizer step, gradients cleared
  cpp        the same with inductor's C++ wrapper (`cpp_wrapper`): the compiled code launches its kernels
             from C++, not Python; CUDA only
  graphs     the same compiled with mode="reduce-overhead": forward and backward replayed as CUDA graphs
             (`torch.compiler.cudagraph_mark_step_begin()` before each step); CUDA only
  tuned      the same with inductor's coordinate-descent tuning of its own Triton kernels' launch parameters (the
             norms, GELU, casts: the step's memory-bound tail); CUDA only

`--variants` names which of the last three run (all by default).

A variant that fails (a mode this torch does not support here) is reported with its error, and the others still
run. The inputs are the same device tensors every step (`model.inputs.to_device` once), so no variant pays a
copy. The trainer's own step also computes the non-finite flag and reads its stats back; every variant here
leaves both out. Writes bench-graphs.json under $OUT (or the current folder). Usage:
  python bench/graphs.py [--steps 30 --warmup 10]      (geometry flags as bench/step.py)
  python bench/graphs.py --variants tuned
  python bench/graphs.py --cpu --depth 1 --hidden 128 --rows 2 --columns 256 --segments 4 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_geometry, bench_config, pair_relations, topic_slices, write_json  # sibling scripts

VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {  # inductor's config, CUDA graphs
    "cpp": ({"cpp_wrapper": True}, False),
    "graphs": ({}, True),
    "tuned": ({"coordinate_descent_tuning": True}, False),
}
"""The variants timed against `compiled` (CUDA only)."""


def timed(step: Callable[[], None], steps: int, warmup: int, cuda: bool) -> dict[str, float]:
    """ms per step of `steps` calls after `warmup` (the device synchronised before and after), and the host's ms
    per step to submit them."""
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    submitted = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    finished = time.perf_counter()
    return {"ms": (finished - started) / steps * 1e3, "host_ms": (submitted - started) / steps * 1e3}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_geometry(parser)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU: eager, no graphs")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")

    import uform as u
    from uform.data.batch import prepare
    from uform.data.blocks import block_tables
    from uform.model.inputs import to_device

    executor = u.Executor.cpu() if args.cpu else u.Executor.for_vram([0])
    trainer = u.Trainer.init_vram(executor, bench_config(args))
    result: dict[str, Any] = {
        "geometry": {k: getattr(args, k) for k in ("depth", "hidden", "rows", "columns", "segments")},
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    try:
        network, optimizer, device = trainer.network, trainer.optimizer, trainer.device
        cuda = device.type == "cuda"
        n = args.segments
        contents = topic_slices(n, args.rows * args.columns // n - 1)  # prefix + content fill the rows
        batch = prepare(
            trainer.config,
            [u.Modality.Text] * n,
            contents,
            bags=None,
            groups=None,
            sides=None,
            relations=pair_relations(n),
            step=1,
        )
        flex = trainer.attention == "flex"
        block = trainer.replica.block
        host = batch.host_tensors(cuda, tables=block_tables(batch.segments, block) if flex else None)
        inputs = to_device(
            host,
            device,
            network.rotary,
            attention=trainer.attention,
            dtype=torch.bfloat16 if cuda else torch.float32,
            dynamic=False,
            block=block,
        )
        for group in optimizer.param_groups:
            group["lr"] = 1e-5

        def stepper(losses: Callable[..., Any], graphs: bool) -> Callable[[], None]:
            def step() -> None:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    terms, _ = losses(inputs, None, batch.positives, batch.late_positives)
                network.total(terms)["loss"].backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            return step

        network.train()
        plain = torch.compile(network.losses, dynamic=False) if cuda else network.losses
        result["compiled"] = timed(stepper(plain, False), args.steps, args.warmup, cuda)
        label = "compiled" if cuda else "eager (CPU)"
        print(f"{label}: {result['compiled']['ms']:.2f} ms/step (host {result['compiled']['host_ms']:.2f})")
        if cuda:
            for name in args.variants.split(","):
                inductor, graphs = VARIANTS[name]
                torch._dynamo.reset()  # each variant compiles the same function afresh
                try:
                    with torch._inductor.config.patch(inductor):
                        mode = "reduce-overhead" if graphs else None
                        losses = torch.compile(network.losses, dynamic=False, mode=mode)
                        result[name] = timed(stepper(losses, graphs), args.steps, args.warmup, cuda)
                except Exception as error:  # reported: whether a mode works on this torch is what is asked
                    result[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
                    print(f"{name}: failed: {result[name]['error'][:300]}")
                    continue
                saved = result["compiled"]["ms"] - result[name]["ms"]
                print(f"{name}: {result[name]['ms']:.2f} ms/step (host {result[name]['host_ms']:.2f}); {saved:+.2f} ms")
            result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        trainer.close()
        executor.close()
    print(write_json("bench-graphs.json", result))
    return result


if __name__ == "__main__":
    main()
