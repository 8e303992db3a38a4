"""The rotary code applied to a block's queries and keys, with a backward (and, for scaled dot-product attention,
a forward) written by hand for CUDA.

Shape legend: R rows, C columns, H heads, K head width, F = K / 2 rotary frequencies.

`rotate_qkv` splits the projection's [R, C, 3, H, K] into rotated q, rotated k and v. Its backward has to write the
projection's gradient [R, C, 3, H, K] from three gradients: the un-rotated dq and dk, and dv. What autograd derives
for that (each half scattered into zeros, then concatenated) compiles on the H200 into one pointwise kernel of
masked two-byte loads, 0.25 ms a reference block: about 1.6 TB/s, a third of the memory's rate (BENCHMARKS.md,
"Issue 12, sixth day"). `rotary_qkv_backward` writes it instead: a Triton kernel on CUDA that moves whole [tokens,
F] tiles, and the same arithmetic in tensor code elsewhere (the CPU reference, which tests/test_qk_rotation.py holds
the kernel to).

The forward is plain tensor code for FlexAttention, which inductor fuses into one kernel writing rotated q and k.
Before scaled dot-product attention (the "uniform" and "gathered" paths: cuDNN, FlashAttention) inductor then copied
each of them once more, unchanged, because the lowering of those kernels takes only inputs already laid out in
memory (H200, reference text step: two copies of 32 µs a block, 0.78 ms of a 40 ms step; BENCHMARKS.md, "Issue 12,
twenty-fifth day"). There `rotate_qkv(..., opaque=True)` computes them with `rotary_qk_forward` instead, an op whose
outputs inductor hands over as they are: a Triton kernel on CUDA, tensor code elsewhere.

The rotation of (x1, x2), the two halves of a head: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin. Its transpose,
the backward: dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin (RoFormer, Su et al. 2021, eq. 34's rotation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .embed import AxialRotary

try:  # Triton ships with CUDA builds of PyTorch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised by the CPU build
    triton = None

__all__ = [
    "launch_backward",
    "launch_forward",
    "rotary_qk_forward",
    "rotary_qkv_backward",
    "rotate_qkv",
    "rotate_reference",
    "unrotate_reference",
]

_TOKENS = 32
"""Tokens a program of the kernel handles: [32, F] tiles."""
_HEADS = 4
"""Heads a program of the kernel handles, one after another, the tokens' rotary code read once for all of them.
32 x 4 against the first kernel's 64 x 1 on the H200 (`bench/qk_rotation.py`): 122 against 130 µs a block at the
image-text step's shape, 129 against 138 at the reference text step's, 133 both at 24 x 1024."""


def rotate_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotation of x [R, C, H, K] (cos, sin broadcast over heads), in at least float32, rounded once to x's
    dtype (as inductor's fused kernel computes the plain rotation)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(wide), x[..., half:].to(wide)
    c, s = cos.to(wide), sin.to(wide)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def unrotate_reference(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The transposed rotation of g [R, C, H, K]: the rotation by the opposite angle, the same bits as writing it
    out (a product with -sin is the negated product, and subtracting it adds)."""
    return rotate_reference(g, cos, -sin)


def _usable_kernel(heads: tuple[Tensor, ...], cos: Tensor, sin: Tensor) -> bool:
    """Whether the kernels take these per-head tensors [R, C, H, K] (q and k, or dq, dk and dv) and code."""
    first = heads[0]
    return (
        triton is not None
        and all(t.is_cuda for t in (*heads, cos, sin))
        and all(t.dtype == first.dtype and t.stride(-1) == 1 for t in heads)
        and cos.dtype == sin.dtype
        and cos.stride() == sin.stride()
        and first.shape[-1] % 2 == 0
        and (first.shape[-1] // 2) & (first.shape[-1] // 2 - 1) == 0  # a power of two: a tile's width
    )


@torch.library.custom_op("uform::rotary_qkv_backward", mutates_args=())
def rotary_qkv_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The projection's gradient [R, C, 3, H, K] (contiguous) from dq, dk, dv [R, C, H, K] and (cos, sin)
    [R, C, 1, F]: dq and dk rotated back, dv as it is."""
    if not _usable_kernel((dq, dk, dv), cos, sin):
        return torch.stack((unrotate_reference(dq, cos, sin), unrotate_reference(dk, cos, sin), dv), dim=2)
    return launch_backward(dq, dk, dv, cos, sin, _TOKENS, _HEADS)


def launch_backward(
    dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, tokens_each: int, heads_each: int
) -> Tensor:
    """`rotary_qkv_backward`'s Triton kernel (CUDA tensors it takes) over programs of `tokens_each` tokens x
    `heads_each` heads; the answer is the same for every program shape (bench/qk_rotation.py times them)."""
    rows, columns, heads, width = dq.shape
    out = dq.new_empty((rows, columns, 3, heads, width))
    tokens = rows * columns
    grid = (triton.cdiv(tokens, tokens_each), triton.cdiv(heads, heads_each))
    with torch.cuda.device(dq.device):
        _kernel[grid](
            dq,
            dk,
            dv,
            cos,
            sin,
            out,
            tokens,
            columns,
            *dq.stride()[:3],
            *dk.stride()[:3],
            *dv.stride()[:3],
            *cos.stride()[:2],
            cos.stride(3),
            heads,
            HALF=width // 2,
            TOKENS=tokens_each,
            HEADS=heads_each,
        )
    return out


@rotary_qkv_backward.register_fake
def _(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rows, columns, heads, width = dq.shape
    return dq.new_empty((rows, columns, 3, heads, width))


@torch.library.custom_op("uform::rotary_qk_forward", mutates_args=())
def rotary_qk_forward(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotated q and k, each [R, C, H, K] contiguous, from the projection's qkv [R, C, 3, H, K] and (cos, sin)
    [R, C, 1, F] in qkv's dtype; float32 arithmetic, one rounding."""
    q, k, _ = qkv.unbind(2)
    if not _usable_kernel((q, k), cos, sin):
        return rotate_reference(q, cos, sin), rotate_reference(k, cos, sin)
    return launch_forward(qkv, cos, sin, _TOKENS, _HEADS)


@rotary_qk_forward.register_fake
def _(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    rows, columns, _, heads, width = qkv.shape
    return qkv.new_empty((rows, columns, heads, width)), qkv.new_empty((rows, columns, heads, width))


def launch_forward(qkv: Tensor, cos: Tensor, sin: Tensor, tokens_each: int, heads_each: int) -> tuple[Tensor, Tensor]:
    """`rotary_qk_forward`'s Triton kernel (CUDA tensors) over programs of `tokens_each` tokens x `heads_each`
    heads; the answer is the same for every program shape."""
    rows, columns, _, heads, width = qkv.shape
    q = qkv.new_empty((rows, columns, heads, width))
    k = qkv.new_empty((rows, columns, heads, width))
    tokens = rows * columns
    grid = (triton.cdiv(tokens, tokens_each), triton.cdiv(heads, heads_each))
    with torch.cuda.device(qkv.device):
        _forward_kernel[grid](
            qkv,
            cos,
            sin,
            q,
            k,
            tokens,
            columns,
            *qkv.stride()[:4],
            *cos.stride()[:2],
            cos.stride(3),
            heads,
            HALF=width // 2,
            TOKENS=tokens_each,
            HEADS=heads_each,
        )
    return q, k


def _rotated(qkv: Tensor, cos: Tensor, sin: Tensor, opaque: bool) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = qkv.unbind(2)  # each [R, C, H, K]
    if opaque:
        q, k = rotary_qk_forward(qkv, cos.to(qkv.dtype), sin.to(qkv.dtype))
        return q, k, v
    return AxialRotary.rotate(q, cos, sin), AxialRotary.rotate(k, cos, sin), v


class _RotateQKV(torch.autograd.Function):
    @staticmethod
    def forward(qkv: Tensor, cos: Tensor, sin: Tensor, opaque: bool) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        return _rotated(qkv, cos, sin, opaque)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor, bool], output: Any) -> None:
        _, cos, sin, _ = inputs
        ctx.save_for_backward(cos, sin)

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return rotary_qkv_backward(dq, dk, dv, cos.to(dq.dtype), sin.to(dq.dtype)), None, None, None


def rotate_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, opaque: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [R, C, 3, H, K] -> rotated q, rotated k, v, each [R, C, H, K] (v a view of qkv).

    Without a gradient to take (serving, export) the forward alone; with one, the backward above. `opaque` (for
    scaled dot-product attention, see the module's notes) computes the rotation with `rotary_qk_forward`; both
    ways are the same arithmetic, the opaque one rounding once where the plain one rounds eagerly after each
    operation (compiled, both round once)."""
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _RotateQKV.apply(qkv, cos, sin, opaque)  # type: ignore[no-any-return]
    return _rotated(qkv, cos, sin, opaque)


if triton is not None:

    @triton.jit
    def _program_tokens(
        cos, sin, tokens, columns, c_row, c_column, c_frequency, HALF: tl.constexpr, TOKENS: tl.constexpr
    ):  # pragma: no cover - runs on CUDA only
        """A program's tokens, the same for both kernels: flat ids t [T], whether each is inside [T, 1], their row
        r and column c [T], the frequencies' offsets f [1, F] and the tokens' rotary code (cos, sin) [T, F] in
        float32, read once for all the heads the program takes."""
        t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [T] flat token ids
        inside = (t < tokens)[:, None]  # [T, 1]
        r, c = t // columns, t % columns
        f = tl.arange(0, HALF)[None, :]  # [1, F]
        code = (r * c_row + c * c_column)[:, None] + f * c_frequency  # [T, F]
        co = tl.load(cos + code, mask=inside, other=0.0).to(tl.float32)
        si = tl.load(sin + code, mask=inside, other=0.0).to(tl.float32)
        return t, inside, r, c, f, co, si

    @triton.jit
    def _kernel(
        dq,
        dk,
        dv,
        cos,
        sin,
        out,
        tokens,
        columns,
        q_row,
        q_column,
        q_head,
        k_row,
        k_column,
        k_head,
        v_row,
        v_column,
        v_head,
        c_row,
        c_column,
        c_frequency,
        heads,
        HALF: tl.constexpr,
        TOKENS: tl.constexpr,
        HEADS: tl.constexpr,
    ):  # pragma: no cover - runs on CUDA only
        t, inside, r, c, f, co, si = _program_tokens(
            cos, sin, tokens, columns, c_row, c_column, c_frequency, HALF, TOKENS
        )
        width = 2 * HALF
        slot = heads * width
        for j in tl.static_range(HEADS):
            head = tl.program_id(1) * HEADS + j
            live = inside & (head < heads)
            o = (t * 3 * heads * width + head * width)[:, None] + f  # [T, F] the first half, slot q
            q = (r * q_row + c * q_column + head * q_head)[:, None] + f
            a = tl.load(dq + q, mask=live, other=0.0).to(tl.float32)
            b = tl.load(dq + q + HALF, mask=live, other=0.0).to(tl.float32)
            tl.store(out + o, (a * co + b * si).to(out.dtype.element_ty), mask=live)
            tl.store(out + o + HALF, (b * co - a * si).to(out.dtype.element_ty), mask=live)
            k = (r * k_row + c * k_column + head * k_head)[:, None] + f
            a = tl.load(dk + k, mask=live, other=0.0).to(tl.float32)
            b = tl.load(dk + k + HALF, mask=live, other=0.0).to(tl.float32)
            tl.store(out + o + slot, (a * co + b * si).to(out.dtype.element_ty), mask=live)
            tl.store(out + o + slot + HALF, (b * co - a * si).to(out.dtype.element_ty), mask=live)
            v = (r * v_row + c * v_column + head * v_head)[:, None] + f
            tl.store(out + o + 2 * slot, tl.load(dv + v, mask=live, other=0.0), mask=live)
            tl.store(out + o + 2 * slot + HALF, tl.load(dv + v + HALF, mask=live, other=0.0), mask=live)

    @triton.jit
    def _forward_kernel(
        qkv,
        cos,
        sin,
        q,
        k,
        tokens,
        columns,
        x_row,
        x_column,
        x_slot,
        x_head,
        c_row,
        c_column,
        c_frequency,
        heads,
        HALF: tl.constexpr,
        TOKENS: tl.constexpr,
        HEADS: tl.constexpr,
    ):  # pragma: no cover - runs on CUDA only
        t, inside, r, c, f, co, si = _program_tokens(
            cos, sin, tokens, columns, c_row, c_column, c_frequency, HALF, TOKENS
        )
        width = 2 * HALF
        for j in tl.static_range(HEADS):
            head = tl.program_id(1) * HEADS + j
            live = inside & (head < heads)
            o = (t * heads * width + head * width)[:, None] + f  # [T, F] the first half in q's and k's layout
            x = (r * x_row + c * x_column + head * x_head)[:, None] + f  # slot q
            a = tl.load(qkv + x, mask=live, other=0.0).to(tl.float32)
            b = tl.load(qkv + x + HALF, mask=live, other=0.0).to(tl.float32)
            tl.store(q + o, (a * co - b * si).to(q.dtype.element_ty), mask=live)
            tl.store(q + o + HALF, (b * co + a * si).to(q.dtype.element_ty), mask=live)
            a = tl.load(qkv + x + x_slot, mask=live, other=0.0).to(tl.float32)
            b = tl.load(qkv + x + x_slot + HALF, mask=live, other=0.0).to(tl.float32)
            tl.store(k + o, (a * co - b * si).to(k.dtype.element_ty), mask=live)
            tl.store(k + o + HALF, (b * co + a * si).to(k.dtype.element_ty), mask=live)
