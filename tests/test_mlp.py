"""The MLP's paths (`uform.model.mlp`) on the CPU: `FusedMLP`'s hand-written backward against autograd's (gradcheck
in float64, through the ops' torch fallbacks that stand where cuBLASLt is missing), the gates that keep every other
step on the separate kernels, the cuBLASLt binding's answer without a GPU, and how a plan is chosen by timing. tests/test_cuda.py holds the
epilogues themselves to the separate kernels on a GPU."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from uform.model import cublaslt
from uform.model.mlp import FusedMLP, linear_dgelu, linear_gelu_aux, mlp
from uform.model.tower import Tower


def test_fused_mlp_backward_is_the_gradient_of_its_forward() -> None:
    """The three gradients `FusedMLP.backward` writes by hand (dh, dW_up, dW_down) against numerical ones."""
    torch.manual_seed(0)
    h = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w_up = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    w_down = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(FusedMLP.apply, (h, w_up, w_down))


def test_fused_mlp_equals_the_separate_mlp_and_its_gradients() -> None:
    torch.manual_seed(1)
    h = torch.randn(10, 16, requires_grad=True)
    w_up = torch.randn(64, 16, requires_grad=True)
    w_down = torch.randn(16, 64, requires_grad=True)
    grad = torch.randn(10, 16)
    fused = FusedMLP.apply(h, w_up, w_down)
    fused.backward(grad)
    got = [fused.detach()] + [t.grad.clone() for t in (h, w_up, w_down)]  # type: ignore[union-attr]
    for t in (h, w_up, w_down):
        t.grad = None
    plain = F.linear(F.gelu(F.linear(h, w_up), approximate="tanh"), w_down)
    plain.backward(grad)
    want = [plain.detach()] + [t.grad for t in (h, w_up, w_down)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_ops_answer_through_torch_without_cublaslt() -> None:
    """On the CPU the binding is never asked: both ops give torch's own values, bitwise."""
    assert not cublaslt.available(torch.device("cpu"))
    torch.manual_seed(2)
    x, w = torch.randn(5, 8), torch.randn(24, 8)
    g, pre = linear_gelu_aux(x, w)
    assert torch.equal(pre, F.linear(x, w)) and torch.equal(g, F.gelu(F.linear(x, w), approximate="tanh"))
    grad, w_down = torch.randn(5, 8), torch.randn(8, 24)
    want = torch.ops.aten.gelu_backward(grad @ w_down, pre, approximate="tanh")
    assert torch.equal(linear_dgelu(grad, w_down, pre), want)


def test_the_cpu_step_keeps_the_separate_kernels_even_when_fused_is_asked() -> None:
    """`fused` is honoured on CUDA under bf16 autocast only: a CPU tower asked for it computes bitwise what it
    computed before, in training and with gradients, so every CPU guarantee (resume, host processes, world-size
    invariance) holds as it was."""
    torch.manual_seed(3)
    tower = Tower(depth=2, hidden=128)
    block = tower.blocks[0]
    h = torch.randn(2, 16, 128, requires_grad=True)
    want = block.down(F.gelu(block.up(h), approximate="tanh"))  # type: ignore[operator]
    tower.fuse_mlp(True)
    assert all(b.fused_mlp for b in tower.blocks)  # type: ignore[union-attr]
    assert torch.equal(mlp(block.up, block.down, h, True), want)  # type: ignore[arg-type]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with_autocast = block.down(F.gelu(block.up(h), approximate="tanh"))  # type: ignore[operator]
        assert torch.equal(mlp(block.up, block.down, h, True), with_autocast)  # type: ignore[arg-type]


def test_a_plan_is_chosen_by_median_over_interleaved_rounds() -> None:
    """`cublaslt._fastest`: every option timed once a round, in turn, the least median kept. With the device's
    clocks still rising as timing begins (a fake timer: the first calls slow, then steady), timing each option once
    in a row crowns the slower one; the rounds find the faster, and ties keep the first."""
    true = {"separate": 1.00, "fused": 1.05}

    def cold_timer() -> tuple[Any, list[str]]:
        calls: list[str] = []

        def timer(option: str) -> float:
            calls.append(option)
            return true[option] + max(0.0, 0.5 - 0.25 * (len(calls) - 1))  # +0.5, +0.25, then steady

        return timer, calls

    timer, _ = cold_timer()
    single = {option: timer(option) for option in true}  # each once, in a row: how a plan was chosen before
    assert min(single, key=single.__getitem__) == "fused"
    timer, calls = cold_timer()
    assert cublaslt._fastest(["separate", "fused"], timer) == "separate"
    assert calls == ["separate", "fused"] * 3
    assert cublaslt._fastest(["a", "b"], lambda option: 1.0) == "a"
