"""MaxSim alone, forward + backward, at the reference geometry's late-interaction capacities: the previous implementation
(kept below as `ReferenceMaxSim`, verbatim) beside the current `uform.losses.late.maxsim`, timed and checked.

Geometry (default the reference geometry's, docs/design.md §1: Qt 16384 query tokens, Dt 65536 document tokens, Dd 256 columns, W 128; `--scale`
multiplies Qt, Dt and Dd): half the query capacity holds real (unit) vectors, the rest is zero padding, as the
network gives it; `Dd / 2` documents of random lengths (at most `--longest`, 1023 = a 1024-column row less its
prefix) fill about half of Dt, contiguous and in column order as the host packs them, the rest padding. The
upstream gradient is random where a real query token meets a real document, zero elsewhere (as the late
term's is: no pair scores a padding token or an empty column).

Runs (each forward + backward of `(best * upstream).sum()`, median of `--steps` after `--warmup`):

  reference   the previous MaxSim: float32 chunks, scatter_reduce amax / amin, two float32 GEMMs per chunk
              in backward
  float32     the block layout, float32 similarities (the CPU's path; CUDA's without autocast)
  float16     the block layout, float16 operands with float32 accumulation, values recomputed in float32
              (CUDA's path under the trainer's bf16 autocast)

On CUDA each run is timed eager and under torch.compile(fullgraph=True, dynamic=False) (as the trainer compiles
`Network.losses`); on the CPU eager only unless `--modes eager,compile`. Checks: float32 equals the reference
(values 1e-5, gradients 1e-5 in norm); float16's values never exceed the reference's and fall
short by at most 2e-3, and the fraction of (token, column) maxima it picks differently is printed.
Writes bench-maxsim.json under $OUT (or the current folder). Usage:
  python bench/maxsim.py --device cuda
  python bench/maxsim.py --device cpu --scale 0.0625
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # time this checkout's uform, whatever else is installed

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling `common`, found when loaded by path too
from common import write_json  # noqa: E402

from uform.losses.late import maxsim, maxsim_chunk  # noqa: E402

# --------------------------------------------------------------------------------------------------
# The previous implementation, copied verbatim from uform/losses/late.py at commit 0ba4b7a (only renamed):
# the reference the new one is timed and checked against.


class ReferenceMaxSim(torch.autograd.Function):
    """best[t, d] = max over the document tokens u of column d of <q_t, d_u> (0 for an empty column).

    Forward and backward both run in float32 with autocast off, chunk by chunk over the query tokens;
    memory beyond the inputs is O(chunk x Dt) for the similarities and O(Qt x Dd) for the saved argmax.
    """

    @staticmethod
    def forward(ctx: Any, queries: Tensor, documents: Tensor, document_of: Tensor, columns: int, chunk: int) -> Tensor:
        q_tokens, d_tokens = queries.shape[0], documents.shape[0]
        with torch.autocast(queries.device.type, enabled=False):
            q = queries.float()  # [Qt, W]
            d = documents.float()  # [Dt, W]
            token = torch.arange(d_tokens, device=q.device)  # [Dt]
            bests, argmaxes = [], []
            for start in range(0, q_tokens, chunk):
                part = q[start : start + chunk]  # [c, W]
                rows = part.shape[0]
                similarity = part @ d.T  # [c, Dt]
                column = document_of.unsqueeze(0).expand(rows, d_tokens)  # [c, Dt], Dd = padding
                best = similarity.new_full((rows, columns + 1), float("-inf"))
                best = best.scatter_reduce(1, column, similarity, "amax", include_self=True)  # [c, Dd + 1]
                hit = similarity == best.gather(1, column)  # [c, Dt]
                first = torch.where(hit, token.unsqueeze(0), d_tokens)  # [c, Dt]
                argmax = torch.full((rows, columns + 1), d_tokens, dtype=torch.long, device=q.device)
                argmax = argmax.scatter_reduce(1, column, first, "amin", include_self=True)  # [c, Dd + 1]
                best = best[:, :columns]
                bests.append(torch.where(best > float("-inf"), best, 0.0))  # an empty column scores 0
                argmaxes.append(argmax[:, :columns])  # Dt where the column is empty
            out = torch.cat(bests)  # [Qt, Dd]
            argmax = torch.cat(argmaxes)  # [Qt, Dd]
        ctx.save_for_backward(q, d, argmax)
        ctx.chunk = chunk
        ctx.dtypes = (queries.dtype, documents.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, d, argmax = ctx.saved_tensors
        chunk = ctx.chunk
        q_tokens, d_tokens = q.shape[0], d.shape[0]
        with torch.autocast(q.device.type, enabled=False):
            grad = grad.float()  # [Qt, Dd]
            grad_q = []
            grad_d = torch.zeros_like(d)  # [Dt, W]
            for start in range(0, q_tokens, chunk):
                part = q[start : start + chunk]  # [c, W]
                rows = part.shape[0]
                # The gradient of each (token, column) max, placed at its argmax; an empty column's lands
                # in the extra last column and is dropped. Argmaxes of one row are distinct tokens (each
                # belongs to one column), so the scatter sums nothing.
                spread = grad.new_zeros(rows, d_tokens + 1)
                spread = spread.scatter_add(1, argmax[start : start + chunk], grad[start : start + chunk])
                spread = spread[:, :d_tokens]  # [c, Dt]
                grad_q.append(spread @ d)  # [c, W]
                grad_d = grad_d + spread.T @ part  # [Dt, W]
            grad_queries = torch.cat(grad_q)
        return grad_queries.to(ctx.dtypes[0]), grad_d.to(ctx.dtypes[1]), None, None, None


def reference_maxsim(queries: Tensor, documents: Tensor, document_of: Tensor, columns: int) -> Tensor:
    chunk = maxsim_chunk(queries.shape[0], documents.shape[0])
    return ReferenceMaxSim.apply(queries, documents, document_of.long(), int(columns), chunk)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------------


def geometry(args: argparse.Namespace) -> dict[str, Tensor | int]:
    """Queries, documents and tags on the device, as the network hands them to the late term."""
    g = torch.Generator().manual_seed(args.seed)
    qt, dt, dd = (max(1, round(x * args.scale)) for x in (16384, 65536, 256))
    longest = min(args.longest, dt)
    width = args.width
    queries = torch.randn(qt, width, generator=g)
    queries = queries / queries.norm(dim=1, keepdim=True)
    queries[qt // 2 :] = 0  # capacity padding, zeroed as the network zeroes it
    documents = torch.randn(dt, width, generator=g)
    documents = documents / documents.norm(dim=1, keepdim=True)
    count = max(1, dd // 2)
    mean = max(1, dt // (2 * count))
    lengths = torch.randint(1, min(longest, 2 * mean) + 1, (count,), generator=g)
    document_of = torch.full((dt,), dd, dtype=torch.long)
    document_of[: int(lengths.sum())] = torch.repeat_interleave(torch.arange(count), lengths)
    documents[document_of == dd] = 0
    # The late term's gradient of best: zero for padding query tokens and empty columns (no pair scores them).
    upstream = torch.randn(qt, dd, generator=g)
    upstream[qt // 2 :] = 0
    upstream[:, count:] = 0
    device = torch.device(args.device)
    return {
        "queries": queries.to(device),
        "documents": documents.to(device),
        "document_of": document_of.to(device),
        "upstream": upstream.to(device),
        "columns": dd,
        "longest": longest,
        "used_tokens": int(lengths.sum()),
        "documents_used": count,
    }


def make_fn(run: str, mode: str, case: dict[str, Any]):
    columns, longest = int(case["columns"]), int(case["longest"])
    cuda = case["queries"].device.type == "cuda"

    def fn(q: Tensor, d: Tensor, document_of: Tensor, upstream: Tensor) -> Tensor:
        if run == "reference":
            out = reference_maxsim(q, d, document_of, columns)
        else:
            # The trainer's CUDA step runs under bf16 autocast, where maxsim picks float16 by itself; here
            # the precision is named so that both runs are measured on every device.
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and run == "float16"):
                out = maxsim(q, d, document_of, columns, longest=longest, precision=run)
        return (out * upstream).sum(), out

    if mode == "compile":
        return torch.compile(fn, fullgraph=True, dynamic=False)
    return fn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_run(run: str, mode: str, case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    fn = make_fn(run, mode, case)
    device = case["queries"].device
    times = []
    result: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for k in range(args.warmup + args.steps):
        q = case["queries"].clone().requires_grad_(True)
        d = case["documents"].clone().requires_grad_(True)
        sync(device)
        start = time.perf_counter()
        loss, out = fn(q, d, case["document_of"], case["upstream"])
        loss.backward()
        sync(device)
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
        if k == 0:
            result = {"out": out.detach(), "grad_q": q.grad.detach(), "grad_d": d.grad.detach()}
    result["ms"] = 1000 * statistics.median(times)
    if device.type == "cuda":
        result["peak_extra_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return result


def compare(ref: dict[str, Any], mine: dict[str, Any], run: str) -> dict[str, float]:
    """Differences against the reference: values the largest; gradients as ||mine - ref|| / ||ref||."""
    out = {
        "values_max_abs": float((mine["out"] - ref["out"]).abs().max()),
        "values_above_reference": float((mine["out"] - ref["out"]).max()),
        "grad_q_rel": float((mine["grad_q"] - ref["grad_q"]).norm() / ref["grad_q"].norm()),
        "grad_d_rel": float((mine["grad_d"] - ref["grad_d"]).norm() / ref["grad_d"].norm()),
        "picked_differently": float(((mine["out"] - ref["out"]).abs() > 1e-5).float().mean()),
    }
    if run == "float32":
        out["ok"] = out["values_max_abs"] <= 1e-5 and out["grad_q_rel"] <= 1e-5 and out["grad_d_rel"] <= 1e-5
    else:
        out["ok"] = out["values_above_reference"] <= 1e-5 and out["values_max_abs"] <= 2e-3
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--scale", type=float, default=None, help="multiplies Qt, Dt, Dd (default 1, CPU 1/16)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--longest", type=int, default=1023)
    parser.add_argument("--runs", default="reference,float32,float16")
    parser.add_argument("--modes", default=None, help="eager,compile (default: both on CUDA, eager on the CPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed calls (default 10, CPU 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.scale = args.scale if args.scale is not None else (1 / 16 if cpu else 1.0)
    args.steps = args.steps if args.steps is not None else (3 if cpu else 10)
    modes = (args.modes or ("eager" if cpu else "eager,compile")).split(",")
    if cpu:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    case = geometry(args)
    qt, dt = case["queries"].shape[0], case["documents"].shape[0]
    print(
        f"{args.device}: Qt {qt} (half padding), Dt {dt} ({case['used_tokens']} used by {case['documents_used']}"
        f" documents), Dd {case['columns']}, W {args.width}, longest {case['longest']}"
    )
    results: dict[str, Any] = {"args": vars(args), "runs": {}}
    for mode in modes:
        ref = None
        for run in args.runs.split(","):
            r = time_run(run, mode, case, args)
            name = f"{run}/{mode}"
            row = {"ms": r["ms"], **({"peak_extra_gib": r["peak_extra_gib"]} if "peak_extra_gib" in r else {})}
            if run == "reference":
                ref = r
            elif ref is not None:
                row["check"] = compare(ref, r, run)
            results["runs"][name] = row
            extra = f"  peak +{row['peak_extra_gib']:.2f} GiB" if "peak_extra_gib" in row else ""
            speed = f"  x{ref['ms'] / r['ms']:.1f} vs reference" if ref is not None and run != "reference" else ""
            check = ""
            if "check" in row:
                c = row["check"]
                check = (
                    f"  {'ok' if c['ok'] else 'MISMATCH'}: values {c['values_max_abs']:.1e}, grads"
                    f" {c['grad_q_rel']:.1e} / {c['grad_d_rel']:.1e}, picked differently {c['picked_differently']:.2%}"
                )
            print(f"  {name:18s} {r['ms']:9.2f} ms{speed}{extra}{check}")
    path = write_json("bench-maxsim.json", results, args.out)
    print(f"wrote {path}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
