"""cuBLASLt's matrix products with a GELU epilogue, for the training step's MLP: the up projection writes GELU's
output and its pre-activations in one pass (`CUBLASLT_EPILOGUE_GELU_AUX`), and the down projection's input
gradient is multiplied by GELU's derivative before it is written (`CUBLASLT_EPILOGUE_DGELU`), so neither GELU nor
its backward reads and writes the 4D-wide activations in a kernel of its own.

PyTorch exposes cuBLASLt's GELU only without its auxiliary output (`torch._addmm_activation`, serving's path), so
this module calls the library that torch already loaded through ctypes: the enum values and the call sequence
(descriptor, layouts, heuristic, `cublasLtMatmul` on the caller's stream) are those of NVIDIA's cuBLAS
documentation, "cuBLASLt API" (cublasLtEpilogue_t; the GELU_AUX / DGELU pair is its "useful for training" case).
Where the library, a bf16 CUDA operand, an alignment or the heuristic is missing, or where torch's separate kernels
were timed faster for the shape (`_Library.plan`), every function answers through those kernels instead: the same
values up to bf16 rounding, never an error.

Shape legend: N rows (positions), I input width, O output width. cuBLASLt is column-major, so a row-major
[N, O] = [N, I] @ [O, I]ᵀ is computed as its transpose, [O, N] = [O, I] @ [I, N].
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["available", "linear_dgelu", "linear_gelu_aux"]

_Option = TypeVar("_Option")

_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_AUX_POINTER, _DESC_AUX_LD = 3, 4, 7, 11, 12
_EPILOGUE_GELU_AUX = 32 | 128
_EPILOGUE_DGELU = 64 | 128
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE_BYTES = 32 << 20  # what PyTorch gives cuBLASLt on Hopper
_ALIGN = 16  # bytes: every pointer and leading dimension the kernels vectorise over
_CANDIDATES = 8  # the heuristic's algorithms timed for a shape
_TIMED_CALLS = 10
_ROUNDS = 3  # of timing every option once, a plan's choice the median's (`_fastest`)


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@dataclass(frozen=True)
class _Plan:
    """One product's descriptors and the algorithm the heuristic chose for them (made once per shape)."""

    desc: ctypes.c_void_p
    a: ctypes.c_void_p
    b: ctypes.c_void_p
    d: ctypes.c_void_p
    algo: _Heuristic


class _Library:
    """The loaded cuBLASLt, one handle and workspace per device, and the plans made so far."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.lock = threading.RLock()  # plans are shared, and the aux pointer is set on one right before each launch
        self.handles: dict[int, ctypes.c_void_p] = {}
        self.workspaces: dict[tuple[int, int], Tensor] = {}  # (device, stream): cuBLASLt's scratch, never shared
        self.plans: dict[tuple, _Plan | None] = {}
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64,
                                                   ctypes.c_uint64, ctypes.c_int64]  # fmt: skip
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                       ctypes.POINTER(_Heuristic), ctypes.POINTER(ctypes.c_int)]  # fmt: skip
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Heuristic),
                                       vp, sz, vp]  # fmt: skip
        for name in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                     "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                     "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulPreferenceDestroy",
                     "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"):  # fmt: skip
            getattr(lib, name).restype = ctypes.c_int

    def handle(self, device: int) -> ctypes.c_void_p:
        if device not in self.handles:
            handle = ctypes.c_void_p()
            with torch.cuda.device(device):
                _check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            self.handles[device] = handle
        return self.handles[device]

    def workspace(self, device: int, stream: int) -> Tensor:
        key = (device, stream)
        if key not in self.workspaces:
            self.workspaces[key] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
        return self.workspaces[key]

    def plan(
        self, device: int, epilogue: int, transa: int, m: int, n: int, k: int, launch: Callable[[_Plan | None], None]
    ) -> _Plan | None:
        """The plan of D [m, n] = op(A) [m, k] @ B [k, n] (column-major, every operand bf16, contiguous), or None
        where torch's separate kernels are faster. Chosen once per shape: `launch(plan)` (None: the separate
        kernels) runs the call's own product each way, and the fastest of the heuristic's candidates and the
        separate kernels (the least median over three rounds that each time every one in turn, `_fastest`) is
        kept, as cuBLASLt's documentation advises for its top results and inductor does for its GEMMs. (H200: for
        the down projection's DGELU at hidden 1024 the heuristic's one candidate took 0.79 ms where the GEMM and
        GELU's backward took 0.57 on the fifteenth day, 0.62 against 0.66 on the twenty-fifth; at hidden 512 its
        second candidate beat its first.)
        Like `torch.backends.cudnn.benchmark`, a timed choice can differ between processes in the last bits of
        what it computes (CUDA steps already do: the embedding's backward adds atomically); under
        `torch.use_deterministic_algorithms(True)` the separate kernels run instead."""
        if torch.are_deterministic_algorithms_enabled():
            return None  # a timed choice may differ between processes; torch's kernels follow the user's setting
        key = (device, epilogue, transa, m, n, k)
        with self.lock:
            if key not in self.plans:
                candidates = self._candidates(device, epilogue, transa, m, n, k)
                if not candidates or torch.cuda.is_current_stream_capturing():
                    self.plans[key] = candidates[0] if candidates else None
                else:
                    options: list[_Plan | None] = [None, *candidates]
                    self.plans[key] = _fastest(options, lambda p: _milliseconds(functools.partial(launch, p)))
            return self.plans[key]

    def _candidates(self, device: int, epilogue: int, transa: int, m: int, n: int, k: int) -> list[_Plan]:
        """The heuristic's algorithms for the product, best first by its own estimate (at most `_CANDIDATES`)."""
        lib, vp = self.lib, ctypes.c_void_p
        desc = vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attribute, value in ((_DESC_TRANSA, transa), (_DESC_TRANSB, _OP_N), (_DESC_EPILOGUE, epilogue)):
            number = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(number), 4), "DescSetAttribute")
        ld = ctypes.c_int64(m)  # the aux matrix is laid out as D
        _check(lib.cublasLtMatmulDescSetAttribute(desc, _DESC_AUX_LD, ctypes.byref(ld), 8), "DescSetAttribute")
        layouts = []
        # A as stored: [k, m] when transposed, else [m, k]; B [k, n]; D [m, n]; each column-major, packed.
        for rows, cols in ((k, m) if transa == _OP_T else (m, k), (k, n), (m, n)):
            layout = vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _CUDA_R_16BF, rows, cols, rows), "Layout")
            layouts.append(layout)
        preference = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "PreferenceCreate")
        limit = ctypes.c_uint64(_WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8),
               "PreferenceSetAttribute")  # fmt: skip
        results, found = (_Heuristic * _CANDIDATES)(), ctypes.c_int(0)
        a, b, d = layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle(device), desc, a, b, d, d, preference, _CANDIDATES, results, ctypes.byref(found)
        )
        lib.cublasLtMatmulPreferenceDestroy(preference)
        if status != 0:
            return []
        return [_Plan(desc, a, b, d, _Heuristic.from_buffer_copy(results[i])) for i in range(found.value)]

    def run(self, plan: _Plan, device: int, a: Tensor, b: Tensor, d: Tensor, aux: Tensor) -> None:
        stream = torch.cuda.current_stream(device).cuda_stream
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        pointer = ctypes.c_void_p(aux.data_ptr())
        with self.lock:
            workspace = self.workspace(device, stream)
            _check(self.lib.cublasLtMatmulDescSetAttribute(plan.desc, _DESC_AUX_POINTER, ctypes.byref(pointer), 8),
                   "DescSetAttribute")  # fmt: skip
            status = self.lib.cublasLtMatmul(
                self.handle(device), plan.desc, ctypes.byref(alpha), a.data_ptr(), plan.a, b.data_ptr(), plan.b,
                ctypes.byref(beta), d.data_ptr(), plan.d, d.data_ptr(), plan.d, ctypes.byref(plan.algo),
                workspace.data_ptr(), _WORKSPACE_BYTES, stream,
            )  # fmt: skip
        _check(status, "cublasLtMatmul")


def _fastest(options: list[_Option], time: Callable[[_Option], float], rounds: int = _ROUNDS) -> _Option:
    """The option of least median `time` over `rounds` rounds, each round timing every option once in turn (ties:
    the earlier option). Timed one after another once each, the first option took whatever the device's clocks
    were doing as the timing began: on the H200 the down projection's DGELU at hidden 1024 and its two separate
    kernels are 6% apart (616-622 against 661 µs, BENCHMARKS.md "Issue 12, twenty-fifth day"), yet a step's profile
    there had taken the separate kernels."""
    times: list[list[float]] = [[] for _ in options]
    for _ in range(rounds):
        for spent, option in zip(times, options, strict=True):
            spent.append(time(option))
    medians = [statistics.median(spent) for spent in times]
    return options[medians.index(min(medians))]


def _milliseconds(call: Callable[[], None]) -> float:
    """The device's mean time of `call` over `_TIMED_CALLS` runs after one unmeasured run (CUDA events)."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_TIMED_CALLS):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / _TIMED_CALLS


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt: {what} returned status {status}")


_loaded: _Library | None = None
_load_tried = False
_load_lock = threading.Lock()


def _library() -> _Library | None:
    """cuBLASLt as torch loaded it (found among the process's mapped libraries), or None."""
    global _loaded, _load_tried
    with _load_lock:
        if not _load_tried:
            _load_tried = True
            path = _mapped("libcublasLt.so") or ctypes.util.find_library("cublasLt")
            if path is not None:
                try:
                    _loaded = _Library(ctypes.CDLL(path))
                except (OSError, AttributeError):  # not loadable, or a build without the symbols used here
                    _loaded = None
        return _loaded


def _mapped(stem: str) -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if stem in path.rsplit("/", 1)[-1]:
                    return path
    except OSError:
        return None
    return None


def available(device: torch.device) -> bool:
    """Whether cuBLASLt's epilogues can run on `device` (a CUDA device whose process has cuBLASLt loaded)."""
    return device.type == "cuda" and torch.cuda.is_available() and _library() is not None


def _fits(*tensors: Tensor) -> bool:
    return all(
        t.is_cuda and t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % _ALIGN == 0 for t in tensors
    )


def _device_index(t: Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def linear_gelu_aux(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(GELU(x Wᵀ), x Wᵀ): x [N, I], weight [O, I] -> two [N, O] in x's dtype. GELU is the tanh form; the
    first output is rounded once from the float32 accumulator, the second is the rounded pre-activation."""
    n, i = x.shape
    o = weight.shape[0]
    lib = _library() if x.is_cuda else None
    if lib is None or not _fits(x, weight) or o % 8 or i % 8:
        return _separate_gelu(x, weight)
    device = _device_index(x)
    outputs: list[Tensor] = []  # made by the first fused launch only: a shape torch's kernels serve needs none

    def launch(plan: _Plan | None) -> None:
        if plan is None:
            _separate_gelu(x, weight)
            return
        if not outputs:
            outputs.extend(torch.empty((n, o), dtype=x.dtype, device=x.device) for _ in range(2))  # [N, O] each
        lib.run(plan, device, weight, x, outputs[0], outputs[1])

    plan = lib.plan(device, _EPILOGUE_GELU_AUX, _OP_T, o, n, i, launch)
    if plan is None:
        return _separate_gelu(x, weight)
    launch(plan)
    return outputs[0], outputs[1]


def _separate_gelu(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    pre = F.linear(x, weight)  # [N, O]
    return F.gelu(pre, approximate="tanh"), pre


def linear_dgelu(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    """(grad W) ⊙ GELU'(pre): grad [N, O], weight [O, I], pre [N, I] -> [N, I] in grad's dtype, the product
    multiplied by the tanh-GELU's derivative in float32 before its one rounding."""
    n, o = grad.shape
    i = weight.shape[1]
    lib = _library() if grad.is_cuda else None
    if lib is None or not _fits(grad, weight, pre) or o % 8 or i % 8:
        return _separate_dgelu(grad, weight, pre)
    device = _device_index(grad)
    outputs: list[Tensor] = []  # as in `linear_gelu_aux`

    def launch(plan: _Plan | None) -> None:
        if plan is None:
            _separate_dgelu(grad, weight, pre)
            return
        if not outputs:
            outputs.append(torch.empty((n, i), dtype=grad.dtype, device=grad.device))  # [N, I]
        lib.run(plan, device, weight, grad, outputs[0], pre)

    plan = lib.plan(device, _EPILOGUE_DGELU, _OP_N, i, n, o, launch)
    if plan is None:
        return _separate_dgelu(grad, weight, pre)
    launch(plan)
    return outputs[0]


def _separate_dgelu(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad @ weight, pre, approximate="tanh")
