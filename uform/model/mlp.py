"""A block's MLP, down(GELU(up(h))) with the tanh GELU, and the three ways it runs.

Shape legend: N positions (R x C flattened), D hidden, 4D the MLP's width.

- Training on CUDA under bf16 autocast, where the replica found cuBLASLt (`Block.fused_mlp`): `FusedMLP`, whose
  up projection writes GELU's output and its pre-activations from one GEMM (`cublaslt.linear_gelu_aux`) and whose
  backward multiplies the down projection's input gradient by GELU's derivative inside that GEMM
  (`cublaslt.linear_dgelu`). The separate GELU kernels each read and wrote the [N, 4D] activations once more: 2.1
  and 2.6 ms of a 42 ms reference step on the H200 (BENCHMARKS.md, "Issue 12, fifth day").
- Serving and held-out evaluation on CUDA (no gradients, autocast): `up_gelu`'s `torch._addmm_activation`.
- Everything else: the separate kernels, as autograd derives them.

Every path computes the same function; they differ in where the bf16 roundings fall.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cublaslt

__all__ = ["FusedMLP", "linear_dgelu", "linear_gelu_aux", "mlp", "up_gelu"]


def up_gelu(up: nn.Linear, h: Tensor) -> Tensor:
    """GELU (tanh form) of `up`(h): [..., D] -> [..., 4D].

    Without gradients on CUDA under autocast (serving, held-out evaluation) the GELU runs in the matrix product's
    epilogue: `torch._addmm_activation` is cuBLASLt's GEMM + bias + GELU, whose GELU is the tanh form (PyTorch's
    own decomposition of that op on CUDA says so), applied to the float32 accumulator before the one rounding to
    the autocast dtype. Inductor calls it as an extern kernel, so the 4D-wide activations are written once instead
    of written, read and written again by a separate kernel (H200 text serving: 2.1 of 15.4 ms a batch).
    Training takes `FusedMLP` where it can, else the separate kernel. On the CPU the op's GELU is the exact (erf)
    form, so the CPU keeps the separate kernel too.
    """
    device = h.device.type
    epilogue = getattr(torch, "_addmm_activation", None)  # a private op: should a release drop it, serving goes on
    if epilogue is None or device != "cuda" or torch.is_grad_enabled() or not torch.is_autocast_enabled(device):
        return F.gelu(up(h), approximate="tanh")
    dtype = torch.get_autocast_dtype(device)
    flat = h.reshape(-1, h.shape[-1]).to(dtype)  # [N, D]
    weight = up.weight.to(dtype)  # [4D, D]
    # The epilogue's bias; the blocks' projections have none, and adding zero leaves every value as it was.
    bias = up.bias.to(dtype) if up.bias is not None else weight.new_zeros(weight.shape[0])  # [4D]
    out = epilogue(bias, flat, weight.t(), use_gelu=True)  # [N, 4D]
    return out.view(*h.shape[:-1], weight.shape[0])


@torch.library.custom_op("uform::linear_gelu_aux", mutates_args=())
def linear_gelu_aux(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(GELU(x Wᵀ), x Wᵀ), each [N, 4D], from x [N, D] and weight [4D, D] (`cublaslt.linear_gelu_aux`). An op of
    its own so that inductor calls it as an extern kernel and never traces into the ctypes call."""
    return cublaslt.linear_gelu_aux(x, weight)


@linear_gelu_aux.register_fake
def _(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("uform::linear_dgelu", mutates_args=())
def linear_dgelu(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    """(grad W) ⊙ GELU'(pre), [N, 4D], from grad [N, D], weight [D, 4D] and pre [N, 4D] (`cublaslt.linear_dgelu`)."""
    return cublaslt.linear_dgelu(grad, weight, pre)


@linear_dgelu.register_fake
def _(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    return grad.new_empty((grad.shape[0], weight.shape[1]))


class FusedMLP(torch.autograd.Function):
    """down(GELU(up(h))) on flat bf16 operands: h [N, D], w_up [4D, D], w_down [D, 4D] -> [N, D], with GELU in
    the GEMMs' epilogues both ways. Saves h, GELU's output (the down projection's weight gradient reads it) and
    its pre-activations (the derivative reads them): as many [N, 4D] tensors as autograd's own MLP keeps."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:  # type: ignore[override]
        g, pre = linear_gelu_aux(h, w_up)  # [N, 4D] each
        ctx.save_for_backward(h, w_up, w_down, g, pre)
        return g @ w_down.t()  # [N, D]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        h, w_up, w_down, g, pre = ctx.saved_tensors
        grad = grad.contiguous()  # [N, D]
        d_down = grad.t() @ g  # [D, 4D]
        d_pre = linear_dgelu(grad, w_down, pre)  # [N, 4D]
        d_up = d_pre.t() @ h  # [4D, D]
        return d_pre @ w_up, d_up, d_down  # [N, D], [4D, D], [D, 4D]


def mlp(up: nn.Linear, down: nn.Linear, h: Tensor, fused: bool) -> Tensor:
    """down(GELU(up(h))): [..., D] -> [..., D]. `fused` (a replica's choice, fixed before compiling) takes
    `FusedMLP` where gradients flow on CUDA under bf16 autocast and neither projection has a bias."""
    device = h.device.type
    if (
        fused
        and device == "cuda"
        and torch.is_grad_enabled()
        and torch.is_autocast_enabled(device)
        and torch.get_autocast_dtype(device) == torch.bfloat16
        and up.bias is None
        and down.bias is None
    ):
        dtype = torch.bfloat16
        flat = h.reshape(-1, h.shape[-1]).to(dtype)  # [N, D]
        out = FusedMLP.apply(flat, up.weight.to(dtype), down.weight.to(dtype))  # [N, D]
        return out.view(h.shape)  # type: ignore[no-any-return]
    return down(up_gelu(up, h))
