"""Document-masked bidirectional attention: a position attends only within its own segment.

Shape legend: R rows, C columns, H heads, K head width.

Two paths compute the same function (tests/test_attention.py holds them to each other, outputs and
gradients):

- `flex`: FlexAttention (Dong et al. 2024, `torch.nn.attention.flex_attention`) with a block mask built
  from the segment ids, so the kernel skips every (query block, key block) tile whose segments cannot
  meet. This is the CUDA path, under `torch.compile`.
- `dense`: scaled dot-product attention with an explicit [R, 1, C, C] boolean mask; the CPU reference.
- `uniform`: where every row is whole segments of one length L and no padding (`data.blocks.uniform_length`:
  fixed-length chunks packed edge to edge), the mask is that of R C / L separate sequences, and plain unmasked
  scaled dot-product attention runs over [R C / L, H, L, K] views of q, k, v; on CUDA cuDNN's fused kernels first.
  The flex path takes it on such a step (`document_mask(..., uniform=L)`).
- `gathered`: where the N segments all hold L positions but do not tile the rows (images of one size: 257 =
  256 + 1 positions straddle FlexAttention's tiles, which then compute 1.6 times the pairs the mask keeps), the
  tower gathers every segment's positions once into [N, L] (`gather_rows`, padding left out), runs its blocks over
  them as N sequences whose attention is dense with no mask (FlashAttention 2 first on CUDA), and scatters the
  states back (`scatter_rows`; padding's are zero). Forward only (serving: `document_mask(..., gathered=(N, L))`).

Padding positions carry the segment id NO_SEGMENT and attend to the padding of their own row, so no
query row is ever fully masked (no NaN) and padding never reaches a segment.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..data.blocks import BLOCK, UNIFORM_LEAST, block_tables

try:  # FlexAttention ships with torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = Any  # type: ignore[misc,assignment]
    flex_attention = None  # type: ignore[assignment]


@dataclass
class DocumentMask:
    """Which keys each query may see, in the form its attention path reads."""

    kind: str
    """"flex", "dense" or "uniform"."""
    block: Any = None
    """The FlexAttention BlockMask (flex)."""
    dense: Tensor | None = None
    """[R, 1, C, C] bool (dense)."""
    options: dict[str, Any] | None = None
    """FlexAttention's kernel options (flex; `kernel_options`), chosen eagerly, outside the compiled step."""
    length: int = 0
    """The one segment length L of every row (uniform)."""
    index: Tensor | None = None
    """[N, L] int64: the flat positions (row * C + column) of each segment's L positions, in order (gathered: the
    tower's to apply; the mask its blocks' attention reads has none, its rows being the segments)."""


def document_mask(
    segments: Tensor,
    kind: str,
    tables: dict[str, Tensor] | None = None,
    block: int = BLOCK,
    uniform: int = 0,
    gathered: tuple[int, int] = (0, 0),
) -> DocumentMask:
    """The mask of segment ids [R, C] for the `kind` attention path.

    `uniform` > 0 says the caller found every row to be whole segments of that length (`data.blocks.uniform_length`,
    on the host): the flex path then answers the "uniform" kind instead, which needs no tables. The claim is not
    re-checked here (that would read the device); a length that does not divide C is refused (ValueError).
    `gathered` = (N, L), N > 0, says the caller found N segments of L positions each and nothing else but padding
    (`data.blocks.equal_length`, on the host): the flex path then answers the "gathered" kind, for a forward
    without gradients; its index is found on the device (a stable sort of the ids, padding last), so nothing waits
    for the device here.

    For "flex", `tables` are `block_tables` of tile side `block` already on the device (made on the host,
    off the critical path); without them they are computed here. Tables whose tile count is not that of `block`
    are refused (ValueError): a mask read at another side than its tables were built for skips the wrong tiles.
    """
    if kind == "dense":
        same = segments[:, None, :, None] == segments[:, None, None, :]  # [R, 1, C, C]
        return DocumentMask(kind, dense=same)
    if kind != "flex":
        raise ValueError(f"attention: unknown path {kind!r}; expected 'flex' or 'dense'")
    if gathered[0]:
        count, length = gathered
        if length < UNIFORM_LEAST or count * length > segments.numel():
            raise ValueError(
                f"document_mask: gathered={gathered}: L must be at least {UNIFORM_LEAST} and N L at most the "
                f"{segments.numel()} positions (data.blocks.equal_length)"
            )
        flat = segments.reshape(-1)  # [R C]
        # Padding after every segment: its id is the largest (host tensors) or NO_SEGMENT (-1, the packer's).
        key = torch.where(flat >= 0, flat, torch.iinfo(flat.dtype).max)
        index = torch.argsort(key, stable=True)[: count * length].view(count, length)  # [N, L]
        return DocumentMask("gathered", length=length, index=index)
    if uniform:
        if uniform < UNIFORM_LEAST or segments.shape[1] % uniform:
            raise ValueError(
                f"document_mask: uniform={uniform} must be at least {UNIFORM_LEAST} and divide the {segments.shape[1]} "
                "columns (data.blocks.uniform_length)"
            )
        return DocumentMask("uniform", length=uniform)
    if tables is None:
        tables = {
            k: torch.from_numpy(v).to(segments.device) for k, v in block_tables(segments.cpu().numpy(), block).items()
        }
    tiles = -(-segments.shape[1] // block)
    if tuple(tables["kv_indices"].shape[-2:]) != (tiles, tiles):  # tables of another side would read wrong tiles
        raise ValueError(
            f"document_mask: block tables of {tuple(tables['kv_indices'].shape[-2:])} tiles, but {segments.shape[1]} "
            f"columns in tiles of {block} make {tiles}: the tables were built for another tile side"
        )

    def same_segment(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return segments[b, q] == segments[b, k]

    # The document mask is symmetric (a key tile meets a query tile exactly when that query tile meets it), so the
    # tables by query tile that backward reads are the tables by key tile: given as they are instead of letting
    # `BlockMask.from_kv_blocks` transpose them on the device thread every step (a vmap over the rows; ~4 ms of
    # that thread's time a reference step, py-spy on the H200).
    full_blocks, full_indices = tables["full_kv_num_blocks"], tables["full_kv_indices"]
    mask = BlockMask(
        seq_lengths=(segments.shape[1], segments.shape[1]),
        kv_num_blocks=tables["kv_num_blocks"],
        kv_indices=tables["kv_indices"],
        full_kv_num_blocks=full_blocks,
        full_kv_indices=full_indices,
        q_num_blocks=tables["kv_num_blocks"],
        q_indices=tables["kv_indices"],
        full_q_num_blocks=full_blocks,
        full_q_indices=full_indices,
        BLOCK_SIZE=(block, block),
        mask_mod=same_segment,
    )
    return DocumentMask(kind, block=mask, options=kernel_options(segments.device))


# FlexAttention's tiles on Hopper (sm90) for head width 64, from `bench/attention.py` on an H200 (BENCHMARKS.md):
# forward 64 x 64 tiles, 4 warps, 2 stages; backward 64-wide tiles throughout, 4 warps, 3 stages. Against the
# kernel's defaults (128-wide tiles) they take a layer's forward + backward from 1.88 to ~1.45 ms where segments
# straddle tiles (image-caption steps) and leave tile-aligned text about as it was. Other GPUs keep the defaults.
_HOPPER_TILES = {
    "fwd_BLOCK_M": 64,
    "fwd_BLOCK_N": 64,
    "fwd_num_warps": 4,
    "fwd_num_stages": 2,
    "bwd_BLOCK_M1": 64,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 64,
    "bwd_num_warps": 4,
    "bwd_num_stages": 3,
}


def kernel_options(device: torch.device) -> dict[str, Any] | None:
    """FlexAttention's kernel options on `device` (head width 64): the measured tiles on Hopper, else the defaults."""
    if _hopper(device):
        return dict(_HOPPER_TILES)
    return None


def flex_block(device: torch.device) -> int:
    """The side of the block mask's sparse tiles on `device`: 64 on Hopper, where the kernels' own tiles are 64 wide
    (`kernel_options`) and inductor can be given a backward for them (`allow_backward_tiles`), else `BLOCK` (128).

    Finer sparse tiles skip more of what a document mask leaves empty where segments straddle tiles: a 257-position
    image spans three 128-wide tiles each way, five or six 64-wide ones (the image-text step's tiles hold 2.19 times
    the same-segment pairs at 128, 1.60 times at 64). H200, `python bench/pairs.py --skip-open-clip` side by side
    (BENCHMARKS.md, "Issue 12, seventh day"): 4,145 against 3,892 pairs/s; text whose segments fill whole tiles is
    unchanged (`bench/attention.py`: 1.076 against 1.074 ms a layer)."""
    if _hopper(device) and allow_backward_tiles(_HOPPER_TILES["bwd_BLOCK_M1"]):
        return _HOPPER_TILES["bwd_BLOCK_M1"]
    return BLOCK


def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


_BACKWARD_TILES: set[int] = set()
_BACKWARD_LOCK = threading.Lock()


def allow_backward_tiles(side: int) -> bool:
    """Lets inductor compile FlexAttention's backward for sparse tiles of `side` on CUDA; answers whether it can.

    Inductor's lowering keeps only the backward configs whose own tiles divide the block mask's sparse tile, before
    the caller's `kernel_options` replace those tiles, and its one Hopper default for head width 64 is 64 / 128 /
    128 / 64 wide: a mask of 64-wide tiles then compiles no backward at all ("NoValidChoicesError"). This appends
    one config of `side`-wide tiles (4 warps, 3 stages) to its CUDA candidates, once per process. The candidates
    are process-wide: another FlexAttention backward compiled in this process may find the extra one beside its
    default, and inductor then times both at compile time and keeps the faster. Where this torch keeps those
    heuristics elsewhere (they are not public API), nothing is changed and the answer is False."""
    with _BACKWARD_LOCK:
        if side in _BACKWARD_TILES:
            return True
        try:
            from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic, FlexBwDConfig
        except ImportError:
            return False
        shipped = getattr(CUDAConfigHeuristic, "get_flex_attn_bwd_configs", None)
        if shipped is None:
            return False
        extra = FlexBwDConfig(side, side, side, side, 3, 4)

        def configs(self: Any, head_dim: int, dtype: torch.dtype) -> list[Any]:
            found = list(shipped(self, head_dim, dtype))
            return found if extra in found else [*found, extra]

        CUDAConfigHeuristic.get_flex_attn_bwd_configs = configs  # type: ignore[method-assign]
        _BACKWARD_TILES.add(side)
        return True


# cuDNN's fused attention first where the uniform path runs on CUDA. H200, the reference text step (256 segments of
# 256, 8 heads of 64, bf16; `bench/profile_step.py --fed`, BENCHMARKS.md "Issue 12, eleventh day"): its kernels took
# 6.97 ms a step against FlexAttention's 8.22, the step's kernels 42.14 against 42.58 ms; alone, over 256 sequences
# of 256, its forward + backward 0.83 ms against FlashAttention 2's 0.96 and the memory-efficient kernel's 1.46
# (`bench/attention.py --sdpa`). The others stay behind it for shapes or GPUs cuDNN refuses.
_UNIFORM_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


# The gathered path's order: FlashAttention 2 first, cuDNN left out. On the H200 (BENCHMARKS.md, "Issue 12,
# twenty-second day") both answer within bf16's tolerance of the CPU's f32, but with cuDNN first a host process's
# answers differed in their bits from the same call's in this process (tests/test_cuda.py,
# `..._gathers_images_of_one_size`), which serving guarantees; with FlashAttention 2 first they agree bit for bit.
# Serving's image rows, 8 x 8,192 of 257-position images, a forward (`bench/attention.py --layout images`): the dense
# kernels alone (gather and scatter apart) cuDNN 0.287 ms, FlashAttention 2 0.351; FlexAttention's 0.480.
_GATHERED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    """q, k, v [R, H, C, K] -> [R, H, C, K]."""
    if mask.kind == "flex":
        return flex_attention(q, k, v, block_mask=mask.block, kernel_options=mask.options)  # type: ignore[misc, return-value, arg-type]
    if mask.kind == "uniform":
        rows, heads, columns, width = q.shape
        length = mask.length

        def split(t: Tensor) -> Tensor:  # [R, H, C, K] -> [R C / L, H, L, K]; a view of the tower's token-major q/k/v
            return t.transpose(1, 2).reshape(rows * (columns // length), length, heads, width).transpose(1, 2)

        with sdpa_kernel(_UNIFORM_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(split(q), split(k), split(v))  # [R C / L, H, L, K]
        return out.transpose(1, 2).reshape(rows, columns, heads, width).transpose(1, 2)
    if mask.kind == "gathered":
        if mask.index is not None:  # rows that still hold several segments would attend across them
            raise ValueError(
                "attend: a 'gathered' mask with its index is the tower's to apply (gather_rows, then a mask without "
                "it): attention reads rows that are each one segment"
            )
        with sdpa_kernel(_GATHERED_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v)  # [N, H, L, K]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)


def gather_rows(t: Tensor, index: Tensor) -> Tensor:
    """[R, C, ...] -> [N, L, ...]: the positions `index` [N, L] names (`DocumentMask.index`, flat row * C + column),
    each segment's L in order; what a tower of the "gathered" kind runs its blocks over."""
    count, length = index.shape
    flat = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])  # [R C, ...]
    return flat.index_select(0, index.reshape(-1)).view(count, length, *t.shape[2:])


def scatter_rows(t: Tensor, index: Tensor, rows: int, columns: int) -> Tensor:
    """`gather_rows` undone: [N, L, ...] -> [R, C, ...], zeros at the positions `index` does not name (padding)."""
    flat = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])  # [N L, ...]
    placed = t.new_zeros((rows * columns, *t.shape[2:])).index_copy(0, index.reshape(-1), flat)
    return placed.view(rows, columns, *t.shape[2:])


def compiled_flex_available(device: torch.device) -> bool:
    return flex_attention is not None and device.type == "cuda"
