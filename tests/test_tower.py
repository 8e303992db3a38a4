"""The tower's residual stream: float32 as its weights, but the autocast dtype in training mode under autocast."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from uform.model.attention import document_mask
from uform.model.embed import AxialRotary
from uform.model.mlp import up_gelu
from uform.model.tower import Tower


def inputs(rows: int = 2, columns: int = 48, hidden: int = 128):
    torch.manual_seed(0)
    x = torch.randn(rows, columns, hidden)
    cos, sin = AxialRotary(64)(torch.randint(0, 40, (rows, columns, 3)))
    segments = (torch.arange(columns) // 16).expand(rows, columns)
    return x, cos, sin, document_mask(segments, "dense")


def test_a_training_step_under_autocast_carries_a_bf16_stream_close_to_float32() -> None:
    tower = Tower(2, 128)
    x, cos, sin, mask = inputs()
    exact = tower(x, cos, sin, mask)
    assert exact.dtype == torch.float32
    x = x.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a float32 norm weight beside a bf16 input would warn (the unfused path)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            states = tower(x, cos.bfloat16(), sin.bfloat16(), mask)
    assert states.dtype == torch.bfloat16  # the final norm keeps its input's dtype: the stream was bf16
    torch.testing.assert_close(states.float(), exact, rtol=0.05, atol=0.05)
    states.float().square().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    for name, p in tower.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0, name


def test_in_eval_mode_autocast_keeps_the_stream_float32() -> None:
    tower = Tower(2, 128).eval()
    x, cos, sin, mask = inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        states = tower(x, cos.bfloat16(), sin.bfloat16(), mask)
    assert states.dtype == torch.float32


def test_norms_keep_float32_exactly_as_torch_does() -> None:
    tower = Tower(1, 128)
    x = torch.randn(4, 128)
    with torch.no_grad():
        tower.norm.weight.uniform_(0.5, 1.5)
    reference = torch.nn.RMSNorm(128, eps=1e-6)
    reference.load_state_dict(tower.norm.state_dict())
    assert torch.equal(tower.norm(x), reference(x))


def test_serving_on_the_cpu_keeps_the_separate_tanh_gelu() -> None:
    """`up_gelu` takes cuBLASLt's GELU epilogue only on CUDA (tests/test_cuda.py): on the CPU,
    `torch._addmm_activation` applies the exact (erf) GELU, not the tanh form the tower trains with, so serving
    there must stay on the separate kernel, bitwise, with and without autocast."""
    torch.manual_seed(0)
    up = torch.nn.Linear(128, 512, bias=False)
    h = torch.randn(2, 24, 128)
    with torch.no_grad():
        assert torch.equal(up_gelu(up, h), F.gelu(up(h), approximate="tanh"))
        assert not torch.equal(up_gelu(up, h), F.gelu(up(h)))  # the two forms differ on these values
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(up_gelu(up, h), F.gelu(up(h), approximate="tanh"))
