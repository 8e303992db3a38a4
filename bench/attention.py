"""Document-masked attention alone, forward + backward, at the step's geometry (issue 12, goal 4's levers).

Shape legend: R rows, C columns, H heads, K head width (64), N segments.

Times one layer's attention of q, k, v [R, H, C, K] bf16 under a document mask, forward and backward, for:

  flex        FlexAttention with uform's own block tables (`uform.data.blocks`), compiled, default kernel configs
  flex <opts> the same with explicit `kernel_options` (tile sides, warps, stages; forward and backward)
  varlen      `torch.nn.attention.varlen.varlen_attn` (FlashAttention 2's variable-length kernels) over the
              segments laid end to end, padding its own sequence per row (where this torch has it)
  cudnn       the same call routed to cuDNN's ragged attention (the backend torch's varlen_attn has but leaves
              switched off), as a reading of what cuDNN's fused kernels would give the same layout
  dense <b>   segments of one length gathered into [N, H, L, K] and given to plain (unmasked) scaled dot-product
              attention under SDPA backend <b> (cudnn, flash, efficient), one call per length, the output
              scattered back; the gathers are timed with it ("kernels" rows: the SDPA calls alone)

With `--sdpa`, instead: plain scaled dot-product attention alone over [N, H, L, K] at the `--sdpa-shapes` (N x L),
under each SDPA backend (cudnn, flash, efficient), unmasked and with a random key-padding mask, forward and forward +
backward (the figures behind `data.blocks.UNIFORM_LEAST` and the uniform path's backend order).

and three layouts of segments: "text" (256 segments of 256 in 64 x 1024, tile-aligned: every tile is whole),
"pairs" (segments of 257 and 61 positions alternating, first-fit into rows, as an image-caption step packs:
most tiles straddle two segments) and "images" (segments of 257 alone, as serving packs 256² images: `--rows 8
--columns 8192`), where the forward of serving's gathered path (`model.attention`, kind "gathered") is timed too.
Useful FLOPs count only same-segment (query, key) pairs: forward 4 L^2 K H per segment of L, backward 2.5x forward
(FlashAttention 2's accounting).

  python bench/attention.py                      # the GPU
  python bench/attention.py --layout pairs --quick
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import write_json  # sibling scripts, not a package

from uform.data.blocks import block_tables, equal_length
from uform.model.attention import (
    DocumentMask,
    allow_backward_tiles,
    attend,
    document_mask,
    gather_rows,
    kernel_options,
    scatter_rows,
)


def _spans(name: str, rows: int, columns: int) -> list[tuple[int, int, int, int]]:
    """The segments of a layout as (row, column, length, id), ids from 0, laid end to end row by row."""
    if name == "text":
        lengths = [256] * (rows * columns // 256)
    elif name == "images":
        lengths = [257] * (rows * columns // 257)
    else:
        lengths = [257, 61] * (rows * columns // 318)
    row, column = 0, 0
    spans: list[tuple[int, int, int, int]] = []
    for length in lengths:
        if column + length > columns:
            row, column = row + 1, 0
        if row == rows:
            break
        spans.append((row, column, length, len(spans)))
        column += length
    return spans


def layout(name: str, rows: int, columns: int) -> np.ndarray:
    """Segment ids [R, C] (non-decreasing along each row; the padding after a row's last segment carries the
    largest id, as the packer lays it: `padding_id`)."""
    spans = _spans(name, rows, columns)
    segments = np.full((rows, columns), len(spans), dtype=np.int64)
    for r, c, length, s in spans:
        segments[r, c : c + length] = s
    return segments


def padding_id(name: str, rows: int, columns: int) -> int | None:
    """The id `layout` gives its padding, None where its segments fill every row (the largest id is then a
    segment's)."""
    spans = _spans(name, rows, columns)
    return None if sum(span[2] for span in spans) == rows * columns else len(spans)


def useful_flops(segments: np.ndarray, heads: int, width: int, pad: int | None) -> float:
    """A forward and backward's FLOPs over every (query, key) pair of a segment with itself, each segment within
    its row (3.5 forwards: the backward's five matmuls to the forward's two); the padding (`pad`) does no useful
    work."""
    forward = 0.0
    for row in segments:
        ids, counts = np.unique(row, return_counts=True)
        kept = counts[ids != pad].astype(np.float64)
        forward += float(np.sum(4.0 * kept**2 * width * heads))
    return 3.5 * forward


_FORWARD_KEYS = ("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_warps", "fwd_num_stages")
_BACKWARD_KEYS = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_warps", "bwd_num_stages")


def named_options(spec: str) -> tuple[str, dict[str, int]]:
    """("flex fwd 64/64 w4 s3", kernel options) from "fwd:64/64/4/3"; "bwd:M1/N1/M2/N2/warps/stages" the same for
    the backward; "fwd:...+bwd:..." both (a pass not named keeps its defaults)."""
    labels, options = [], {}
    for part in spec.split("+"):
        kind, _, numbers = part.partition(":")
        keys = {"fwd": _FORWARD_KEYS, "bwd": _BACKWARD_KEYS}.get(kind)
        values = numbers.split("/")
        if keys is None or len(values) != len(keys) or not all(v.isdigit() for v in values):
            raise ValueError(f"--configs: {part!r} is not fwd:M/N/warps/stages or bwd:M1/N1/M2/N2/warps/stages")
        *tiles, warps, stages = values
        labels.append(f"{kind} {'/'.join(tiles)} w{warps} s{stages}")
        options.update(zip(keys, map(int, values), strict=True))
    return "flex " + " ".join(labels), options


def timed(fn: Any, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def flex_runner(
    q: Any, k: Any, v: Any, segments_t: Any, tables: Any, options: dict[str, Any] | None, block: int, mode: str | None
) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    mask = document_mask(segments_t, "flex", tables, block)
    compiled = torch.compile(flex_attention, dynamic=False, mode=mode)

    def run() -> None:
        out = compiled(q, k, v, block_mask=mask.block, kernel_options=options)
        out.backward(torch.ones_like(out))

    return run, lambda: compiled(q, k, v, block_mask=mask.block, kernel_options=options)


def sequence_starts(segments: np.ndarray) -> np.ndarray:
    """Flat positions where a sequence starts in segment ids [R, C]: wherever the id changes or a row starts (each
    row's padding is its own sequence)."""
    columns = segments.shape[1]
    flat = segments.reshape(-1)
    return np.flatnonzero(np.r_[True, (flat[1:] != flat[:-1]) | (np.arange(1, flat.size) % columns == 0)])


def sdpa_backend(name: str) -> Any:
    """SDPA's backend of that name: cudnn, flash, efficient or math."""
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def varlen_runner(q: Any, k: Any, v: Any, segments: np.ndarray, cudnn: bool = False) -> Any:
    from torch.nn.attention import varlen
    from torch.nn.attention.varlen import varlen_attn

    switch = varlen._should_use_cudnn  # torch's own choice between its two backends (FlashAttention 2 as shipped)

    rows, columns = segments.shape
    cu = torch.tensor(np.r_[sequence_starts(segments), segments.size], dtype=torch.int32, device="cuda")
    longest = int(np.diff(cu.cpu().numpy()).max())

    def packed(t: Any) -> Any:  # [R, H, C, K] -> [R*C, H, K]
        return t.transpose(1, 2).reshape(rows * columns, t.shape[1], t.shape[3])

    def chosen(fn: Any) -> Any:
        def call() -> Any:
            varlen._should_use_cudnn = lambda index: cudnn
            try:
                return fn()
            finally:
                varlen._should_use_cudnn = switch

        return call

    def forward() -> Any:
        return varlen_attn(packed(q), packed(k), packed(v), cu, cu, longest, longest)

    def run() -> None:
        out = forward()
        out.backward(torch.ones_like(out))

    return chosen(run), chosen(forward)


class _Gather(torch.autograd.Function):
    """rows = x[index]; the backward gathers too (`inverse`: where each of x's rows went, len(index) where none did),
    so neither direction scatters with atomics."""

    @staticmethod
    def forward(ctx: Any, x: Any, index: Any, inverse: Any) -> Any:
        ctx.save_for_backward(inverse)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        (inverse,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        out = padded.index_select(0, inverse)
        if out.shape[0] < ctx.rows:  # x's own trailing rows that went nowhere (the zero row below)
            out = torch.cat([out, out.new_zeros((ctx.rows - out.shape[0], *out.shape[1:]))])
        return out, None, None


def length_buckets(segments: np.ndarray, pad: int) -> list[np.ndarray]:
    """Flat positions [N, L] of the segments of each length L (padding, id `pad`, left out), longest first."""
    flat = segments.reshape(-1)
    starts = sequence_starts(segments)
    ends = np.r_[starts[1:], flat.size]
    by_length: dict[int, list[int]] = {}
    for start, end in zip(starts, ends, strict=True):
        if flat[start] != pad:
            by_length.setdefault(int(end - start), []).append(int(start))
    return [
        np.asarray(by_length[length])[:, None] + np.arange(length)[None, :]
        for length in sorted(by_length, reverse=True)
    ]


def dense_runner(
    q: Any, k: Any, v: Any, segments: np.ndarray, pad: int, backend: str, kernels_only: bool = False
) -> Any:
    """Forward and forward + backward of document-masked attention as dense SDPA over length buckets."""
    from torch.nn.attention import sdpa_kernel

    chosen = sdpa_backend(backend)
    rows, heads, columns, width = q.shape
    buckets = length_buckets(segments, pad)
    device = q.device
    index = torch.from_numpy(np.concatenate([b.reshape(-1) for b in buckets])).to(device)  # [P]
    kept = index.numel()
    inverse = torch.full((rows * columns,), kept, dtype=torch.int64, device=device)
    inverse[index] = torch.arange(kept, device=device)
    shapes = [b.shape for b in buckets]
    if kernels_only:  # the SDPA calls alone, on tensors already bucketed
        parts = [
            [torch.randn((n, length, heads, width), device=device, dtype=q.dtype).requires_grad_() for _ in range(3)]
            for n, length in shapes
        ]

    def forward() -> Any:
        with sdpa_kernel(chosen):
            if kernels_only:
                outs = [
                    F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2))
                    for a, b, c in parts
                ]
                return outs
            flat = [t.transpose(1, 2).reshape(rows * columns, heads, width) for t in (q, k, v)]
            gathered = [_Gather.apply(t, index, inverse) for t in flat]  # [P, H, K] each
            outs, at = [], 0
            for n, length in shapes:
                q_b, k_b, v_b = (
                    t[at : at + n * length].view(n, length, heads, width).transpose(1, 2) for t in gathered
                )
                outs.append(
                    F.scaled_dot_product_attention(q_b, k_b, v_b).transpose(1, 2).reshape(n * length, heads, width)
                )
                at += n * length
            out = _Gather.apply(torch.cat([*outs, outs[0].new_zeros((1, heads, width))]), inverse, index)
            return out.view(rows, columns, heads, width).transpose(1, 2)  # [R, H, C, K]

    def run() -> None:
        out = forward()
        if kernels_only:
            torch.autograd.backward(out, [torch.ones_like(o) for o in out])
        else:
            out.backward(torch.ones_like(out))

    return run, forward


def gathered_runner(q: Any, k: Any, v: Any, segments_t: Any, segments: np.ndarray) -> Any:
    """Serving's attention of the gathered kind (`uform.model.attention`), forward only, no gradients: the mask (its
    index found on the device) built and q, k, v gathered once, as the tower does for all its blocks
    (`gather_rows`); `run`, which the bench times, is one block's attention over those rows, each one segment;
    `forward` answers it scattered back (`scatter_rows`) for the comparison. `segments` pad with the largest id
    (`layout`), which is no segment's: the slots are the ids below it."""
    shape = equal_length(np.bincount(segments.reshape(-1))[: int(segments.max())])  # positions per slot
    if not shape[0]:
        raise ValueError("gathered_runner: the layout's segments do not share one length (data.blocks.equal_length)")
    mask = document_mask(segments_t, "flex", gathered=shape)
    rows, _, columns, _ = q.shape
    gathered = [gather_rows(t.transpose(1, 2), mask.index).transpose(1, 2) for t in (q, k, v)]  # [N, H, L, K]
    each = DocumentMask("gathered", length=mask.length)

    def run() -> Any:
        with torch.no_grad():
            return attend(*gathered, each)

    def forward() -> Any:
        return scatter_rows(run().transpose(1, 2), mask.index, rows, columns).transpose(1, 2)  # [R, H, C, K]

    run.forward_only = True  # type: ignore[attr-defined]
    return run, forward


def sdpa_table(shapes: str, heads: int, width: int, steps: int, warmup: int) -> dict[str, Any]:
    """`--sdpa`: each backend alone at each N x L, unmasked and with a key-padding mask (keys past a random length in
    [L / 2, L] hidden), forward and forward + backward; useful FLOPs count every (query, key) pair."""
    from torch.nn.attention import sdpa_kernel

    backends = {name: sdpa_backend(name) for name in ("cudnn", "flash", "efficient")}
    rows: dict[str, Any] = {}
    for shape in shapes.split(","):
        n, length = (int(x) for x in shape.split("x"))
        leaves = [
            torch.randn((n, length, heads, width), device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)
        ]
        q, k, v = (t.transpose(1, 2) for t in leaves)  # [N, H, L, K] views of token-major leaves, as the tower's
        flops = 4.0 * length * length * width * heads * n
        keep = (
            torch.arange(length, device="cuda")[None, :]
            < torch.randint(length // 2, length + 1, (n,), device="cuda")[:, None]
        )
        for name, backend in backends.items():
            for mask in (None, keep[:, None, None, :].expand(n, 1, length, length)):
                label = f"{n}x{length} {name}{' masked' if mask is not None else ''}"

                def forward(backend: Any = backend, mask: Any = mask, qkv: tuple = (q, k, v)) -> Any:
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)

                def run(forward: Any = forward) -> None:
                    out = forward()
                    out.backward(torch.ones_like(out))

                try:
                    forward_ms = timed(forward, steps, warmup)
                    ms = timed(run, steps, warmup)
                except RuntimeError as failure:  # a backend that refuses the shape or the mask
                    print(f"{label:32s} refused: {str(failure).splitlines()[0][:100]}", flush=True)
                    continue
                finally:
                    for t in leaves:
                        t.grad = None
                rows[label] = {"forward_ms": forward_ms, "ms": ms, "tflops": 3.5 * flops / (ms / 1e3) / 1e12}
                print(
                    f"{label:32s} fwd {forward_ms:7.3f} ms ({flops / forward_ms / 1e9:5.0f} TFLOP/s)  fwd+bwd {ms:7.3f} ms"
                    f" ({rows[label]['tflops']:5.0f} TFLOP/s)",
                    flush=True,
                )
    return rows


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--columns", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layout", choices=("text", "pairs", "images", "both"), default="both")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="default configs only")
    parser.add_argument("--blocks", default="128,64", help="FlexAttention tile sides of the block mask")
    parser.add_argument("--autotune", action="store_true", help="also inductor's max-autotune over flex's configs")
    parser.add_argument("--varlen", action="store_true", help="also FlashAttention 2's varlen kernels")
    parser.add_argument("--cudnn", action="store_true", help="also cuDNN's ragged kernels through varlen_attn")
    parser.add_argument("--sdpa", action="store_true", help="only SDPA's backends alone at --sdpa-shapes")
    parser.add_argument("--sdpa-shapes", default="256x256,192x257,192x61,192x64,64x1024", help="N x L, comma-separated")
    parser.add_argument("--dense", default="", help="also dense SDPA over length buckets: backends, e.g. cudnn,flash")
    parser.add_argument("--backward-tiles", type=int, default=0, help="let the backward compile tiles of this side")
    parser.add_argument(
        "--configs",
        default="",
        help="more kernel options to time, comma-separated: fwd:M/N/warps/stages, bwd:M1/N1/M2/N2/warps/stages, or both "
        "joined by +",
    )
    args = parser.parse_args()
    if args.backward_tiles and not allow_backward_tiles(args.backward_tiles):
        print(f"--backward-tiles {args.backward_tiles}: this torch keeps inductor's heuristics elsewhere; not added")
    width = 64
    torch._dynamo.config.recompile_limit = 1024  # one compile per (config, layout): not a recompile storm
    torch._dynamo.config.cache_size_limit = 1024
    configs: list[tuple[str, dict[str, Any] | None]] = [("flex default", None)]
    trainer_tiles = kernel_options(torch.device("cuda"))
    if trainer_tiles is not None:  # the tiles the trainer runs with on this GPU (forward and backward together)
        configs.append(("flex trainer tiles", trainer_tiles))
    if not args.quick:
        for bm, bn, warps, stages in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2)):
            configs.append(
                (
                    f"flex fwd {bm}x{bn} w{warps} s{stages}",
                    {"fwd_BLOCK_M": bm, "fwd_BLOCK_N": bn, "fwd_num_warps": warps, "fwd_num_stages": stages},
                )
            )
        for m1, n1, m2, n2, warps, stages in (
            (64, 64, 64, 64, 4, 3),
            (32, 64, 64, 32, 4, 3),
            (64, 128, 128, 64, 8, 3),
            (32, 128, 128, 32, 4, 3),
            (64, 64, 64, 64, 8, 2),
        ):
            configs.append(
                (
                    f"flex bwd {m1}/{n1}/{m2}/{n2} w{warps} s{stages}",
                    {
                        "bwd_BLOCK_M1": m1,
                        "bwd_BLOCK_N1": n1,
                        "bwd_BLOCK_M2": m2,
                        "bwd_BLOCK_N2": n2,
                        "bwd_num_warps": warps,
                        "bwd_num_stages": stages,
                    },
                )
            )
    configs += [named_options(spec) for spec in args.configs.split(",") if spec]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": {}}
    if args.sdpa:
        results["rows"] = sdpa_table(args.sdpa_shapes, args.heads, width, args.steps, args.warmup)
        print(write_json("bench-attention.json", results))
        return results
    if args.autotune:
        configs.append(("flex max-autotune", None))
    for name in ("text", "pairs") if args.layout == "both" else (args.layout,):
        segments = layout(name, args.rows, args.columns)
        segments_t = torch.from_numpy(segments).cuda()
        pad = padding_id(name, args.rows, args.columns)
        flops = useful_flops(segments, args.heads, width, pad)
        generator = torch.Generator(device="cuda").manual_seed(0)
        # Leaves [R, C, H, K] handed over as [R, H, C, K] views, the layout the tower's blocks give attention.
        shape = (args.rows, args.columns, args.heads, width)
        leaves = [
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
            for _ in range(3)
        ]
        q, k, v = (t.transpose(1, 2) for t in leaves)
        runners: list[tuple[str, Any]] = []
        for block in (int(b) for b in args.blocks.split(",")):
            tables = {key: torch.from_numpy(value).cuda() for key, value in block_tables(segments, block).items()}
            for label, options in configs:
                mode = "max-autotune-no-cudagraphs" if "autotune" in label else None
                if block < 128 and options is None and mode is None:  # the defaults' tiles are 128 wide
                    options = {
                        "BLOCK_M": block,
                        "BLOCK_N": block,
                        "bwd_BLOCK_M1": block // 2,
                        "bwd_BLOCK_N1": block,
                        "bwd_BLOCK_M2": block,
                        "bwd_BLOCK_N2": block // 2,
                    }
                sides = [v for key, v in (options or {}).items() if "BLOCK" in key]
                if any(block % side for side in sides):
                    continue
                runners.append((f"b{block} {label}", flex_runner(q, k, v, segments_t, tables, options, block, mode)))
        if args.varlen:
            try:
                runners.append(("varlen (FA2)", varlen_runner(q, k, v, segments)))
            except (ImportError, RuntimeError) as error:
                print(f"varlen: not available here ({error})")
        if args.cudnn:
            try:
                runners.append(("varlen (cuDNN)", varlen_runner(q, k, v, segments, cudnn=True)))
            except (ImportError, RuntimeError) as error:
                print(f"cudnn: not available here ({error})")
        held = -1 if pad is None else pad  # the padding's id, or one no position carries: nothing left out
        for backend in (b for b in args.dense.split(",") if b):
            runners.append((f"dense {backend}", dense_runner(q, k, v, segments, held, backend)))
            runners.append((f"dense {backend} kernels", dense_runner(q, k, v, segments, held, backend, True)))
        if name == "images":  # serving's forward: segments of one length gathered into dense SDPA, no gradients
            runners.append(("gathered (serving, forward)", gathered_runner(q, k, v, segments_t, segments)))
        real = torch.from_numpy(segments != held).cuda()[:, :, None, None]  # padding's outputs are not compared
        reference = None
        for label, (run, forward) in runners:
            try:
                with torch.no_grad():
                    out = forward()
                if isinstance(out, list):  # "kernels" rows: nothing to compare
                    error = float("nan")
                else:
                    out = out.float()
                    out = (
                        out.reshape(args.rows, args.columns, args.heads, width)
                        if out.dim() == 3
                        else out.transpose(1, 2)
                    ) * real
                    if reference is None:
                        reference = out
                    error = float((out - reference).abs().max())
                forward_only = getattr(run, "forward_only", False)  # serving's row: no backward to time
                ms = float("nan") if forward_only else timed(run, args.steps, args.warmup)
                forward_ms = timed(run if forward_only else lambda f=forward: f(), args.steps, args.warmup)
            except Exception as failure:  # a config the kernel refuses is reported, not fatal
                print(f"{name:5s} {label:40s} failed: {str(failure).splitlines()[0][:120]}", flush=True)
                continue
            # Useful FLOPs over the time they took: a forward's share (1 of 3.5) where the row runs no backward.
            tflops = flops / 3.5 / (forward_ms / 1e3) / 1e12 if forward_only else flops / (ms / 1e3) / 1e12
            results["rows"][f"{name} {label}"] = {
                "ms": None if forward_only else ms,
                "forward_ms": forward_ms,
                "tflops": tflops,
                "max_error": error,
            }
            print(
                f"{name:5s} {label:40s} fwd+bwd {ms:7.3f} ms  fwd {forward_ms:7.3f} ms  {tflops:6.1f} TFLOP/s useful"
                f"  |diff| {error:.2e}",
                flush=True,
            )
            for t in leaves:
                t.grad = None
    print(write_json("bench-attention.json", results))
    return results


if __name__ == "__main__":
    main()
