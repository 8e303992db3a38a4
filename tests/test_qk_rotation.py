"""The rotation of a block's queries and keys (`model.qk_rotation`): its hand-written backward against autograd's
own derivative of the plain rotation, eager and compiled; the CUDA kernel against the tensor-code reference."""

from __future__ import annotations

import pytest
import torch

from uform.model.embed import AxialRotary
from uform.model.qk_rotation import (
    launch_backward,
    launch_forward,
    rotary_qk_forward,
    rotary_qkv_backward,
    rotate_qkv,
    rotate_reference,
    unrotate_reference,
)

R, C, H, K = 3, 40, 4, 16


def code(rows: int = R, columns: int = C, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    positions = torch.randint(0, 50, (rows, columns, 3))
    cos, sin = AxialRotary(K)(positions)  # [R, C, 1, F]
    return cos.to(device, dtype), sin.to(device, dtype)


def plain(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    q, k, v = qkv.unbind(2)
    return AxialRotary.rotate(q, cos, sin), AxialRotary.rotate(k, cos, sin), v


def gradients(fn, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights) -> tuple[list, torch.Tensor]:
    x = qkv.clone().requires_grad_(True)
    outs = fn(x, cos, sin)
    sum(((o.float() * w).sum() for o, w in zip(outs, weights, strict=True)), torch.zeros(())).backward()
    return [o.detach() for o in outs], x.grad


def test_the_backward_is_the_derivative_of_the_rotation() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(R, C, 3, H, K, dtype=torch.float64)
    cos, sin = (t.double() for t in code())
    weights = [torch.randn(R, C, H, K, dtype=torch.float64) for _ in range(3)]
    outs, grad = gradients(rotate_qkv, qkv, cos, sin, weights)
    want_outs, want = gradients(plain, qkv, cos, sin, weights)
    for got, expected in zip(outs, want_outs, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)
    small = qkv[:1, :5, :, :2].clone().requires_grad_(True)  # gradcheck's Jacobian is one forward per element
    assert torch.autograd.gradcheck(lambda x: rotate_qkv(x, cos[:1, :5], sin[:1, :5]), (small,))


def test_the_opaque_forward_is_the_plain_rotation_and_has_its_gradient() -> None:
    """`rotate_qkv(..., opaque=True)` (the op scaled dot-product attention takes): in float32 and float64 the same
    values as the plain rotation, and the same gradient; v still a view of qkv."""
    torch.manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        qkv = torch.randn(R, C, 3, H, K, dtype=dtype)
        cos, sin = (t.to(dtype) for t in code())
        weights = [torch.randn(R, C, H, K, dtype=dtype) for _ in range(3)]
        outs, grad = gradients(lambda *a: rotate_qkv(*a, opaque=True), qkv, cos, sin, weights)
        want_outs, want = gradients(plain, qkv, cos, sin, weights)
        for got, expected in zip(outs, want_outs, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(grad, want, rtol=0, atol=0)
        with torch.no_grad():
            q, k, v = rotate_qkv(qkv, cos, sin, opaque=True)
        assert torch.equal(q, want_outs[0]) and torch.equal(k, want_outs[1])
        assert v.data_ptr() == qkv[:, :, 2].data_ptr()


def test_the_forward_op_is_registered_whole() -> None:
    """Schema, fake tensors and dispatch of `rotary_qk_forward`, as `torch.library.opcheck` checks them."""
    qkv = torch.randn(R, C, 3, H, K)
    cos, sin = code()
    torch.library.opcheck(rotary_qk_forward, (qkv, cos, sin))


def test_compiled_opaque_rotation_gives_the_eager_gradient() -> None:
    torch.manual_seed(5)
    qkv = torch.randn(R, C, 3, H, K)
    cos, sin = code()
    weights = [torch.randn(R, C, H, K) for _ in range(3)]
    compiled = torch.compile(lambda *a: rotate_qkv(*a, opaque=True), fullgraph=True, dynamic=False)
    outs, grad = gradients(compiled, qkv, cos, sin, weights)
    want_outs, want = gradients(plain, qkv, cos, sin, weights)
    for got, expected in zip(outs, want_outs, strict=True):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad, want)


def test_compiled_rotation_gives_the_eager_gradient() -> None:
    torch.manual_seed(1)
    qkv = torch.randn(R, C, 3, H, K)
    cos, sin = code()
    weights = [torch.randn(R, C, H, K) for _ in range(3)]
    compiled = torch.compile(rotate_qkv, fullgraph=True, dynamic=False)
    outs, grad = gradients(compiled, qkv, cos, sin, weights)
    want_outs, want = gradients(plain, qkv, cos, sin, weights)
    for got, expected in zip(outs, want_outs, strict=True):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad, want)


def test_without_a_gradient_it_is_the_plain_rotation_and_v_is_a_view() -> None:
    qkv = torch.randn(R, C, 3, H, K)
    cos, sin = code()
    with torch.no_grad():
        q, k, v = rotate_qkv(qkv, cos, sin)
    want = plain(qkv, cos, sin)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    assert v.data_ptr() == qkv[:, :, 2].data_ptr()


def test_the_reference_rounds_once_from_float32() -> None:
    torch.manual_seed(2)
    g = torch.randn(R, C, H, K).bfloat16()
    cos, sin = code(dtype=torch.bfloat16)
    got = unrotate_reference(g, cos, sin)
    half = K // 2
    g1, g2, c, s = g[..., :half].double(), g[..., half:].double(), cos.double(), sin.double()
    exact = torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), dim=-1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, columns, heads, width", [(3, 40, 4, 16), (2, 1024, 8, 64), (1, 129, 12, 64)])
def test_cuda_kernel_matches_the_reference(dtype: torch.dtype, rows: int, columns: int, heads: int, width: int) -> None:
    """The Triton kernel against the tensor code, on the strides FlexAttention's backward hands over: dq and dk
    token-major views of head-major memory, dv a view of a wider buffer; token counts not a multiple of a tile."""
    torch.manual_seed(3)
    cuda = torch.device("cuda")
    cos, sin = (t.to(cuda) for t in AxialRotary(width)(torch.randint(0, 300, (rows, columns, 3))))
    cos, sin = cos.to(dtype), sin.to(dtype)
    dq = torch.randn(rows, heads, columns, width, device=cuda, dtype=dtype).transpose(1, 2)
    dk = torch.randn(rows, heads, columns, width, device=cuda, dtype=dtype).transpose(1, 2)
    dv = torch.randn(rows, columns, 2, heads, width, device=cuda, dtype=dtype)[:, :, 1]
    got = rotary_qkv_backward(dq, dk, dv, cos, sin)
    want = torch.stack((unrotate_reference(dq, cos, sin), unrotate_reference(dk, cos, sin), dv), dim=2)
    assert got.shape == (rows, columns, 3, heads, width) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-5)
    assert torch.equal(got[:, :, 2], dv)
    for tokens, heads_each in ((32, 1), (64, 4), (128, 8)):  # other program shapes (bench/qk_rotation.py): same bits
        assert torch.equal(launch_backward(dq, dk, dv, cos, sin, tokens, heads_each), got)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, columns, heads, width", [(3, 40, 4, 16), (2, 1024, 8, 64), (1, 129, 12, 64)])
def test_cuda_forward_kernel_matches_the_reference(
    dtype: torch.dtype, rows: int, columns: int, heads: int, width: int
) -> None:
    """The forward's Triton kernel against the tensor code, from the projection's [R, C, 3, H, K] (a view of a
    wider buffer here, as a strided projection would hand it): q and k contiguous, within one rounding of the
    reference (float32 arithmetic, one rounding), and the same bits at other program shapes."""
    torch.manual_seed(6)
    cuda = torch.device("cuda")
    cos, sin = (t.to(cuda, dtype) for t in AxialRotary(width)(torch.randint(0, 300, (rows, columns, 3))))
    qkv = torch.randn(rows, columns, 4, heads, width, device=cuda, dtype=dtype)[:, :, 1:]
    q, k = rotary_qk_forward(qkv, cos, sin)
    assert q.shape == k.shape == (rows, columns, heads, width) and q.is_contiguous() and k.is_contiguous()
    want_q, want_k = rotate_reference(qkv[:, :, 0], cos, sin), rotate_reference(qkv[:, :, 1], cos, sin)
    torch.testing.assert_close(
        q, want_q, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6 if dtype == torch.float32 else 0
    )
    torch.testing.assert_close(
        k, want_k, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6 if dtype == torch.float32 else 0
    )
    for tokens, heads_each in ((32, 1), (64, 4), (128, 8)):
        other = launch_forward(qkv, cos, sin, tokens, heads_each)
        assert torch.equal(other[0], q) and torch.equal(other[1], k)
