"""The rotary kernels alone (`model.qk_rotation`), over their programs' shapes (issue 12, goals 1 and 4).

Shape legend: R rows, C columns, H heads, K head width (64), F = K / 2.

A block's backward hands the kernel dq and dk as token-major views of FlexAttention's head-major gradients and dv
as a view of a wider buffer; it writes the projection's gradient [R, C, 3, H, K]. Here the same strides at three
step geometries (the image-text step's 30 x 2048 rows at hidden 512, the reference text step's 64 x 1024 at 512,
the 24 x 1024 step's 32 x 1024 at 1024), each program shape of `--tokens` x `--heads-each` (tokens x heads a
program handles; the rotary code read once for its heads) timed by CUDA events around `--repeats` calls back to
back (the median of seven rounds), with the bytes moved per second (reads of dq, dk, dv and the rotary code once,
writes of the gradient) and whether it answered every bit as the first shape did. The forward kernel (the op the
scaled dot-product attention paths take) the same way, from the projection's contiguous [R, C, 3, H, K] to rotated
q and k (`--passes forward`). Writes bench-qk-rotation.json under $OUT (or the current folder). CUDA only. Usage:
  python bench/qk_rotation.py [--tokens 32,64,128 --heads-each 1,2,4,8 --repeats 20 --passes backward,forward]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # sibling scripts

from uform.model.embed import AxialRotary
from uform.model.qk_rotation import launch_backward, launch_forward

GEOMETRIES = {"image-text": (30, 2048, 8), "reference text": (64, 1024, 8), "24 x 1024": (32, 1024, 16)}
"""name: (R, C, H), head width 64."""


def rotary_code(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [R, C, 1, F] bf16 on the device, for random positions."""
    cos, sin = AxialRotary(64)(torch.randint(0, 300, (rows, columns, 3)))
    return cos.to("cuda", torch.bfloat16), sin.to("cuda", torch.bfloat16)


def backward_inputs(rows: int, columns: int, heads: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """dq, dk, dv and (cos, sin) bf16 on the strides a block's backward hands over, and the bytes the kernel moves
    (dq, dk, dv read; the gradient written; the code read)."""
    cuda = torch.device("cuda")
    dq = torch.randn(rows, heads, columns, 64, device=cuda, dtype=torch.bfloat16).transpose(1, 2)
    dk = torch.randn(rows, heads, columns, 64, device=cuda, dtype=torch.bfloat16).transpose(1, 2)
    dv = torch.randn(rows, columns, 3, heads, 64, device=cuda, dtype=torch.bfloat16)[:, :, 2]
    cos, sin = rotary_code(rows, columns)
    moved = 2 * 3 * dq.numel() * dq.element_size() + 2 * cos.numel() * cos.element_size()
    return (dq, dk, dv, cos, sin), moved


def forward_inputs(rows: int, columns: int, heads: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """The projection's qkv [R, C, 3, H, K] and (cos, sin), bf16, as a block's forward hands them over, and the
    bytes the kernel moves (q and k read out of qkv; rotated q and k written; the code read)."""
    qkv = torch.randn(rows, columns, 3, heads, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = rotary_code(rows, columns)
    moved = 4 * (qkv.numel() // 3) * qkv.element_size() + 2 * cos.numel() * cos.element_size()
    return (qkv, cos, sin), moved


PASSES = {"backward": (launch_backward, backward_inputs), "forward": (launch_forward, forward_inputs)}
"""pass: (the kernel's launch, its inputs at a geometry)."""


def timed(run: Any, repeats: int) -> float:
    """µs a call: the median over seven rounds of `repeats` calls back to back between two CUDA events (the device
    kept busy, so its clocks stay up), after one untimed round."""
    for _ in range(repeats):
        run()
    rounds = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="32,64,128", help="comma-separated tokens a program")
    parser.add_argument("--heads-each", default="1,2,4,8", help="comma-separated heads a program")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--passes", default="backward,forward", help="comma-separated: backward, forward")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    shapes = [(int(t), int(h)) for t in args.tokens.split(",") for h in args.heads_each.split(",")]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    for kernel_pass in args.passes.split(","):
        launch, make = PASSES[kernel_pass]
        for name, (rows, columns, heads) in GEOMETRIES.items():
            given, moved = make(rows, columns, heads)
            first: Any = None
            for tokens, each in shapes:
                out = launch(*given, tokens, each)
                out = torch.cat([o.reshape(-1) for o in out]) if isinstance(out, tuple) else out
                same = first is None or torch.equal(out, first)
                first = out if first is None else first
                us = timed(lambda g=given, t=tokens, e=each, f=launch: f(*g, t, e), args.repeats)
                row = {"pass": kernel_pass, "geometry": name, "tokens": tokens, "heads_each": each, "us": us}
                row.update({"tb_s": moved / us / 1e6, "same_bits": same})
                result["rows"].append(row)
                print(
                    f"{kernel_pass:8s} {name:15s} tokens {tokens:4d} heads {each}: {us:7.1f} µs "
                    f"{row['tb_s']:5.2f} TB/s same {same}"
                )
    print(write_json("bench-qk-rotation.json", result))
    return result


if __name__ == "__main__":
    main()
