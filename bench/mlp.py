"""One block's MLP in a training step, GELU in separate kernels against GELU in cuBLASLt's epilogues (issue 12,
goals 1 and 4).

A `model.tower.Block`'s MLP, down(GELU(up(norm output))), forward and backward under bf16 autocast at a step's
shape (default: the reference step's 64 x 1024 positions, hidden 512), compiled as the trainer compiles it, two
ways in one run:

  separate   `Block.fused_mlp` off: autograd's MLP, GELU and its backward each a kernel of inductor's
  fused      `Block.fused_mlp` on: `model.mlp.FusedMLP`, GELU_AUX in the up projection's epilogue and DGELU in
             the down projection's input-gradient GEMM (`model.cublaslt`)

For each: the median of `--repeats` timed forward + backward passes (CUDA events), the same x the depth (a step's
share), the kernels of one pass (torch.profiler, CUDA only), and the output's and gradients' error against a
float64 reference of the same weights (mean and largest absolute error, relative to the reference's mean
magnitude). On the CPU both rows run the separate kernels (`model.mlp.mlp` fuses on CUDA only), so there the
run is a smoke test. Writes bench-mlp.json under $OUT (or the current folder). Usage:
  python bench/mlp.py [--positions 65536 --hidden 512 --depth 12 --repeats 50]
  python bench/mlp.py --device cpu --positions 256 --hidden 64 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # sibling scripts


def reference(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """The MLP's output and the gradients of (h, w_up, w_down) in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (h, w_up, w_down)]
    out = F.linear(F.gelu(F.linear(leaves[0], leaves[1]), approximate="tanh"), leaves[2])
    out.backward(grad.double())
    return [out.detach()] + [t.grad for t in leaves]  # type: ignore[misc]


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, list[float]]:
    """Per tensor (output, dh, dw_up, dw_down): mean and largest absolute error over the reference's mean |value|."""
    mean, largest = [], []
    for g, w in zip(got, want, strict=True):
        scale = w.abs().mean().item()
        diff = (g.double() - w).abs()
        mean.append(diff.mean().item() / scale)
        largest.append(diff.max().item() / scale)
    return {"mean": mean, "largest": largest}


def run(args: argparse.Namespace, fused: bool) -> dict[str, Any]:
    from uform.model import cublaslt
    from uform.model.tower import Block

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    block = Block(args.hidden).to(device)
    block.fused_mlp = fused
    h = torch.randn(args.positions, args.hidden, device=device)
    grad = torch.randn(args.positions, args.hidden, device=device).to(torch.bfloat16)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        from uform.model.mlp import mlp as block_mlp

        return block_mlp(block.up, block.down, x, block.fused_mlp)

    step = torch.compile(mlp, dynamic=False) if cuda else mlp
    dtype = torch.bfloat16

    def once() -> list[torch.Tensor]:
        x = h.to(dtype).requires_grad_()
        with torch.autocast(device.type, dtype=dtype):
            out = step(x)
        out.backward(grad.to(out.dtype))
        got = [out.detach(), x.grad, block.up.weight.grad, block.down.weight.grad]
        block.zero_grad(set_to_none=True)
        return got  # type: ignore[return-value]

    got = once()
    want = reference(h.to(dtype), block.up.weight.to(dtype), block.down.weight.to(dtype), grad)
    report: dict[str, Any] = {"errors": errors(got, want), "cublaslt": fused and cublaslt.available(device)}
    times = []
    for _ in range(args.repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time

            began = time.perf_counter()
            once()
            times.append((time.perf_counter() - began) * 1e3)
    times.sort()
    report["ms"] = times[len(times) // 2]
    report["ms_per_step"] = report["ms"] * args.depth
    if cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            once()
            torch.cuda.synchronize()
        kernels = {
            e.key: e.device_time_total / 1e3
            for e in profile.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA
        }
        report["kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--positions", type=int, default=64 * 1024, help="N: rows x columns of the step")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=12, help="blocks a step: ms_per_step is ms x depth")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = {"args": vars(args), "separate": run(args, False), "fused": run(args, True)}
    names = ("output", "dh", "dw_up", "dw_down")
    print(f"{'path':<9} {'ms a block':>10} {'ms a step':>10}  error mean / largest ({', '.join(names)})")
    for path in ("separate", "fused"):
        row = report[path]
        spread = zip(row["errors"]["mean"], row["errors"]["largest"], strict=True)
        pairs = ", ".join(f"{m:.1e}/{x:.1e}" for m, x in spread)
        print(f"{path:<9} {row['ms']:>10.4f} {row['ms_per_step']:>10.3f}  {pairs}")
        for name, ms in list(row.get("kernels_ms", {}).items())[:8]:
            print(f"    {ms:8.4f} ms  {name[:100]}")
    print(f"cuBLASLt's epilogues ran: {report['fused']['cublaslt']}")
    write_json("bench-mlp.json", report, args.out)
    return report


if __name__ == "__main__":
    main()
