"""Late interaction (ColBERT's MaxSim, Khattab and Zaharia 2020) as pure functions over tensors.

Shape legend (annotated inline):
    Qt  query token capacity of one device's step (`max_query_tokens_per_device`)
    Dt  document token capacity (`max_document_tokens_per_device`)
    Dd  document capacity (`max_documents_per_device`): the columns of the score matrix
    S   segment slots: the rows of the score matrix (a row scores only where its slot holds a query)
    W   the token vectors' width
    G   temperature groups

A query item's tokens are rows of `queries` [Qt, W] tagged by `query_slot` [Qt] (its slot, S for capacity
padding); a document's tokens are rows of `documents` [Dt, W] tagged by `document_of` [Dt] (its column,
Dd for padding). Every index array has a shape fixed by the run's capacities, never by the step, so the
compiled step sees one shape.

    score(q, d) = sum_{t in q} max_{u in d} <q_t, d_u>

The inner max is `MaxSim`: a custom autograd function that visits the query tokens in chunks, so the
[Qt, Dt] similarity never exists whole, and keeps only the argmax [Qt, Dd] for backward (the gradient of
a max flows to its argmax alone; a tie goes to the lowest token index). It reduces each column's tokens
without scatters: `block_layout` places every column's tokens in whole blocks of `BLOCK` slots, so a
column's max is a dense max within blocks followed by a dense max over its (at most K) blocks; backward
is a gather and a scatter over the argmax, O(Qt x Dd x W) instead of two [Qt, Dt] products.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..enums import PairLossForm
from .contrastive import pair_loss
from .term import Term

CHUNK_ELEMENTS = 1 << 25
"""The most elements one chunk of MaxSim holds in any [chunk, ...] intermediate (128 MiB in float32): the
similarities [chunk, Nb x B], the block grid [chunk, Dd, K], the gathered vectors [chunk, Dd, W]."""

CUDA_CHUNK_ELEMENTS = 1 << 27
"""The same on CUDA (512 MiB): a GPU of the H100 / H200 class holds it easily, and a quarter of the chunks
means a quarter of the kernels to launch and to compile (the chunk loop is unrolled into the graph)."""


def chunk_elements(device: torch.device) -> int:
    """`CUDA_CHUNK_ELEMENTS` on CUDA, else `CHUNK_ELEMENTS`."""
    return CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS


SORTED_SCATTER: bool | None = None
"""How MaxSim's backward sums the document gradient (`scatter_rows`'s `by_sorting`; None: by device)."""

BLOCK = 16
"""Document tokens per block: the first level of MaxSim's two-level max (see `block_layout`)."""

PRECISIONS = ("float32", "float16", "bfloat16")
"""What MaxSim selects its maxima over: similarities of float32 operands, or of operands rounded to float16 /
bfloat16 (float32 accumulation and result); see `maxsim`."""


def maxsim_chunk(query_tokens: int, row_elements: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Query tokens per chunk: as many as keep `chunk x row_elements` within `elements`."""
    return max(1, min(query_tokens, elements // max(1, row_elements)))


def maxsim_geometry(
    document_tokens: int, columns: int, block: int = BLOCK, longest: int | None = None
) -> tuple[int, int]:
    """(Nb, K): the block capacity and the block grid's width of `block_layout` (static, from capacities).

    Nb = floor((Dt + min(Dd, Dt) (block - 1)) / block) blocks hold any layout: a column of L tokens takes
    ceil(L / block) <= (L + block - 1) / block of them. K = ceil(min(longest, Dt) / block) blocks cover the
    longest column (`longest` defaults to Dt, which is always safe and costly for a large Dt).
    """
    block = max(1, int(block))
    longest = document_tokens if longest is None else min(int(longest), document_tokens)
    blocks = max(1, (document_tokens + min(columns, document_tokens) * (block - 1)) // block)
    return blocks, max(1, -(-longest // block))


def maxsim_row(document_tokens: int, columns: int, width: int, block: int = BLOCK, longest: int | None = None) -> int:
    """Elements per query token of MaxSim's largest per-chunk intermediate (what `maxsim_chunk` divides)."""
    blocks, grid = maxsim_geometry(document_tokens, columns, block, longest)
    return max(blocks * max(1, int(block)), columns * grid, columns * width)


class BlockLayout(NamedTuple):
    """Where MaxSim puts each document token (see `block_layout`): static shapes from the capacities."""

    slot_token: Tensor
    """[Nb * B] int64: the document token each slot holds (Dt for a slot no column uses)."""
    grid: Tensor
    """[Dd, K] int64: column d's k-th block, repeating its last block past its end (0 for an empty column)."""
    empty: Tensor
    """[Dd] bool: the column holds no token."""


def block_layout(document_of: Tensor, columns: int, block: int = BLOCK, longest: int | None = None) -> BlockLayout:
    """Lays the document tokens out in blocks of `block` slots so that no block holds two columns.

    Column d's tokens (those tagged d in `document_of` [Dt], in token order) fill the slots of ceil(L_d / B)
    consecutive blocks, columns in order; a column's last block is filled up with copies of its last token,
    so every slot of a block scores a real token of its column and a copy never beats the original (it
    comes later, and ties go to the first). Then max over a column = max over its blocks' per-block maxima,
    and the first maximum in slot order is the lowest token index among the maxima: a dense max over
    [.., Nb, B], then a gather of [Dd, K] block maxima and a dense max over K, without a scatter.

    Every shape is static (Dt, Dd, `block`, `longest`); nothing reads a value back to the host. `longest` is
    a bound on any column's token count (the caller's capacities: a document is at most one row); it is
    checked in eager CPU calls and trusted elsewhere. Cost: a stable sort of Dt tags and a few passes over
    Dt and Nb (microseconds on a GPU at the reference geometry's capacities).
    """
    of = document_of.long()
    d_tokens = of.shape[0]
    blocks, width = maxsim_geometry(d_tokens, columns, block, longest)
    device = of.device
    order = torch.argsort(of, stable=True)  # [Dt] tokens grouped by column in token order, padding last
    bounds = torch.searchsorted(of[order], torch.arange(columns + 1, device=device))  # [Dd + 1]
    start, length = bounds[:-1], bounds[1:] - bounds[:-1]  # [Dd] each
    if not torch.compiler.is_compiling() and device.type == "cpu" and longest is not None and d_tokens:
        most = int(length.max())
        if most > longest:
            raise ValueError(f"block_layout: a column holds {most} tokens, more than longest={longest}")
    count = (length + block - 1) // block  # [Dd] blocks of each column
    end = torch.cumsum(count, 0)  # [Dd]
    first = end - count  # [Dd]
    slot = torch.arange(blocks * block, device=device)  # [Nb * B]
    column = torch.searchsorted(end, slot // block, right=True)  # [Nb * B] the column whose blocks hold it
    used = column < columns
    column = column.clamp(max=max(0, columns - 1))
    offset = torch.minimum(slot - first[column] * block, length[column] - 1).clamp(min=0)
    slot_token = torch.where(used, order[(start[column] + offset).clamp(max=max(0, d_tokens - 1))], d_tokens)
    k = torch.arange(width, device=device)  # [K]
    grid = first.unsqueeze(1) + torch.minimum(k.unsqueeze(0), (count - 1).clamp(min=0).unsqueeze(1))  # [Dd, K]
    return BlockLayout(slot_token, grid.clamp(max=blocks - 1), length == 0)


def _similarity(queries: Tensor, slots: Tensor) -> Tensor:
    """queries [c, W] @ slots [N, W]^T in float32: an fp32 GEMM for float32 operands; for half operands on
    CUDA one half GEMM with a float32 result; elsewhere the half values widened (their products are exact in
    float32, so this is the same sum)."""
    if queries.dtype == torch.float32:
        return queries @ slots.T
    if queries.device.type == "cuda":
        return torch.mm(queries, slots.T, out_dtype=torch.float32)
    return queries.float() @ slots.float().T


class MaxSim(torch.autograd.Function):
    """best[t, d] = max over the document tokens u of column d of <q_t, d_u> (0 for an empty column).

    Forward: per chunk of query tokens the similarities against every slot of the block layout, a dense
    max over each block (value and first index), a gather of each column's blocks [Dd, K] and a dense max
    over them; the winning slot's token is the argmax [Qt, Dd] (Dt for an empty column), the only thing
    kept for backward besides the inputs. Backward: the gradient of a max flows to its argmax alone, so
    grad q_t = sum_d g[t, d] d_{a(t, d)} (one embedding bag per query token) and grad d_u = sum over (t, d)
    with a(t, d) = u of g[t, d] q_t (`scatter_rows`): O(Qt x Dd x W), no [Qt, Dt] product. All in float32
    with autocast off, except the forward's similarities under a reduced `precision` (see `maxsim`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        queries: Tensor,
        documents: Tensor,
        slot_token: Tensor,
        grid: Tensor,
        empty: Tensor,
        block: int,
        chunk: int,
        precision: str,
    ) -> Tensor:
        q_tokens, d_tokens = queries.shape[0], documents.shape[0]
        blocks = slot_token.shape[0] // block
        with torch.autocast(queries.device.type, enabled=False):
            q = queries.float()  # [Qt, W]
            d = documents.float()  # [Dt, W]
            extended = torch.cat([d, d.new_zeros(1, d.shape[1])])  # [Dt + 1, W], Dt the zero row
            slots = extended[slot_token]  # [Nb * B, W]
            operands = q
            if precision != "float32":
                half = getattr(torch, precision)
                operands, slots = q.to(half), slots.to(half)
            bests, argmaxes = [], []
            for begin in range(0, q_tokens, chunk):
                rows = min(chunk, q_tokens - begin)
                similarity = _similarity(operands[begin : begin + rows], slots)  # [c, Nb * B]
                block_best, within = similarity.view(rows, blocks, block).max(dim=2)  # [c, Nb] each
                best, k = block_best[:, grid].max(dim=2)  # [c, Dd, K] -> [c, Dd] each
                chosen = grid.gather(1, k.T).T  # [c, Dd] the winning block
                token = slot_token[chosen * block + within.gather(1, chosen)]  # [c, Dd]
                token = torch.where(empty, d_tokens, token)
                if precision != "float32":  # the chosen token's similarity, recomputed in float32
                    best = (q[begin : begin + rows].unsqueeze(1) * extended[token]).sum(dim=2)  # [c, Dd]
                bests.append(torch.where(empty, 0.0, best))  # an empty column scores 0
                argmaxes.append(token)
            out = torch.cat(bests)  # [Qt, Dd]
            argmax = torch.cat(argmaxes)  # [Qt, Dd]
        ctx.save_for_backward(q, d, argmax)
        ctx.dtypes = (queries.dtype, documents.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, d, argmax = ctx.saved_tensors
        d_tokens, width = d.shape[0], q.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            grad = grad.float()  # [Qt, Dd]
            extended = torch.cat([d, d.new_zeros(1, width)])  # [Dt + 1, W], an empty column's argmax reads 0
            # grad q_t = sum_d g[t, d] d_{a(t, d)}: one bag of Dd weighted rows per query token.
            grad_queries = F.embedding_bag(argmax, extended, per_sample_weights=grad, mode="sum")  # [Qt, W]
            grad_d = scatter_rows(argmax, grad, q, d_tokens, SORTED_SCATTER)  # [Dt, W]
        return grad_queries.to(ctx.dtypes[0]), grad_d.to(ctx.dtypes[1]), None, None, None, None, None, None


def scatter_rows(index: Tensor, weight: Tensor, rows: Tensor, size: int, by_sorting: bool | None = None) -> Tensor:
    """out [size, W]: out[u] = sum over (t, j) with index[t, j] = u of weight[t, j] rows[t]; index [T, J] in
    [0, size], `size` dropping its entry. float32 sums either way, in different orders.

    Entries that add nothing (dropped, or of weight 0: in the late term every pair the host did not name,
    every empty column and every padding query token) are first moved to a spare row of their own, size + t,
    so that they make no hot spot: every padding query token picks the first token of every column (its
    similarities all tie at 0), and every empty column's entry would otherwise share one row.

    `by_sorting` (None: on the CPU): sort the entries by destination and sum each destination's run as one
    bag, the spare rows left out (deterministic; on the CPU over ten times faster than the scatter).
    Otherwise an accumulating index_add (float atomics on a GPU, fused with the products under
    torch.compile), which stays fast when many entries share a destination, where a bag's sum is one serial
    loop (slow for a long run on a GPU).
    """
    t_count, j_count = index.shape
    width = rows.shape[1]
    spare = size + torch.arange(t_count, device=index.device).unsqueeze(1)  # [T, 1]
    index = torch.where((index < size) & (weight != 0), index, spare)  # [T, J]
    if by_sorting is None:
        by_sorting = index.device.type == "cpu"
    if by_sorting:
        key, entry = torch.sort(index.reshape(-1), stable=True)  # [T * J] each
        offsets = torch.searchsorted(key, torch.arange(size + 1, device=index.device))  # [size + 1]
        # include_last_offset: bag u spans offsets[u]:offsets[u + 1]; the spare rows' entries come after.
        return F.embedding_bag(
            entry // j_count,
            rows,
            offsets,
            mode="sum",
            per_sample_weights=weight.reshape(-1)[entry],
            include_last_offset=True,
        )
    out = rows.new_zeros(size + t_count, width)
    chunk = maxsim_chunk(t_count, j_count * width, chunk_elements(index.device))
    for begin in range(0, t_count, chunk):  # the [c * J, W] products, chunked in eager mode
        spread = weight[begin : begin + chunk].unsqueeze(2) * rows[begin : begin + chunk].unsqueeze(1)
        out = out.index_add(0, index[begin : begin + chunk].reshape(-1), spread.reshape(-1, width))
    return out[:size]


def maxsim(
    queries: Tensor,
    documents: Tensor,
    document_of: Tensor,
    columns: int,
    chunk: int | None = None,
    *,
    longest: int | None = None,
    block: int = BLOCK,
    precision: str | None = None,
) -> Tensor:
    """best [Qt, Dd]: each query token's best similarity among each document column's tokens.

    queries [Qt, W]; documents [Dt, W]; document_of [Dt] int64, each document token's column in
    [0, columns), `columns` (= Dd) marking padding (any order: the layout sorts them). An empty column
    scores 0 and takes no gradient; of equal maxima the lowest token index takes the gradient.

    `longest` bounds any column's token count (default Dt): it sets the block grid's width K =
    ceil(longest / block), so a tight bound keeps the [chunk, Dd, K] grid small. `chunk` query tokens
    are scored at a time (default: as many as keep each intermediate within `chunk_elements`).

    `precision` says what the maxima are selected over. "float32" (None's choice on the CPU and wherever
    autocast is off): float32 similarities, so `best` is exactly the brute force's. "float16" (None's
    choice on CUDA under autocast, as the trainer's step): the operands rounded to float16 (11
    significant bits; the token vectors are unit-norm, so every component lies in [-1, 1]), multiplied
    with float32 accumulation into a float32 result; the argmax is the first maximum of those
    similarities, and `best` is the chosen token's similarity recomputed in float32 from the unrounded
    vectors, so the value and the gradient describe the same token and `best` can fall short of the true
    maximum only by the rounding (about 2^-11 x |q| |d|). "bfloat16" likewise with 8 bits. Backward is
    float32 in every case. (Off CUDA the half GEMM is emulated by widening the rounded operands; the CPU
    inductor may fuse the rounding away, which only makes the selection exact.)
    """
    if queries.dim() != 2 or documents.dim() != 2 or queries.shape[1] != documents.shape[1]:
        raise ValueError(
            f"maxsim: queries [Qt, W] and documents [Dt, W] must share W, got {tuple(queries.shape)}, "
            f"{tuple(documents.shape)}"
        )
    if tuple(document_of.shape) != (documents.shape[0],):
        raise ValueError(f"maxsim: document_of must be [{documents.shape[0]}], got {tuple(document_of.shape)}")
    if precision is None:
        device = queries.device.type
        precision = "float16" if device == "cuda" and torch.is_autocast_enabled(device) else "float32"
    if precision not in PRECISIONS:
        raise ValueError(f"maxsim: precision must be one of {PRECISIONS}, got {precision!r}")
    columns, block = int(columns), max(1, int(block))
    layout = block_layout(document_of, columns, block, longest)
    row = maxsim_row(documents.shape[0], columns, queries.shape[1], block, longest)
    if chunk is None:
        chunk = maxsim_chunk(queries.shape[0], row, chunk_elements(queries.device))
    chunk = max(1, int(chunk))
    return MaxSim.apply(queries, documents, *layout, block, chunk, precision)  # type: ignore[no-any-return]


def late_scores(
    queries: Tensor,
    query_slot: Tensor,
    documents: Tensor,
    document_of: Tensor,
    slots: int,
    columns: int,
    chunk: int | None = None,
    longest: int | None = None,
) -> Tensor:
    """scores [S, Dd]: score(q, d) = sum over the query tokens of slot q of their MaxSim against column d.

    query_slot [Qt] int64 each query token's slot in [0, slots), `slots` marking padding; the rest as in
    `maxsim`. Rows of slots without query tokens are zero.
    """
    best = maxsim(queries, documents, document_of, columns, chunk, longest=longest)  # [Qt, Dd]
    scores = best.new_zeros(slots + 1, columns).index_add(0, query_slot.long(), best)  # [S + 1, Dd]
    return scores[:slots]


def late_interaction_term(
    queries: Tensor,
    query_slot: Tensor,
    documents: Tensor,
    document_of: Tensor,
    groups: Tensor,
    log_inverse_temperature: Tensor,
    bias: Tensor,
    z: Tensor,
    w: Tensor,
    form: PairLossForm,
    positives: int | None = None,
    chunk: int | None = None,
    longest: int | None = None,
) -> Term:
    """The late-interaction pair loss as (sum of the anchor terms, anchors), before its weight.

    queries, query_slot, documents, document_of as in `late_scores`; groups [S] each row's temperature
    group; log_inverse_temperature, bias [G]; z, w [S, Dd] the pair targets of every (query slot,
    document column), zero where a row holds no query or a column no document (the host resolved them
    through the step's relations, as for the pooled term). The logit is t_g * score + b_g; under Ranked
    the bias cancels and is left out (its gradient an exact zero). `positives` bounds the positives of
    any row for Ranked (see `contrastive.pair_loss`); `longest` bounds any document's token count (see
    `maxsim`).
    """
    if PairLossForm(form) == PairLossForm.Derived:
        raise ValueError("late_interaction_term: PairLossForm.Derived must be resolved by the caller (ranked)")
    slots, columns = z.shape
    scores = late_scores(queries, query_slot, documents, document_of, slots, columns, chunk, longest)  # [S, Dd]
    groups = groups.long()
    inverse_temperature = log_inverse_temperature.float().exp()[groups]  # [S]
    row_bias = bias.float()[groups]  # [S]
    if PairLossForm(form) == PairLossForm.Ranked:
        row_bias = row_bias * 0.0
    logits = inverse_temperature[:, None] * scores + row_bias[:, None]  # [S, Dd]
    return pair_loss(logits, z, w, PairLossForm(form), positives)
