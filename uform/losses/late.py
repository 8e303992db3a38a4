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
a max flows to its argmax alone; a tie goes to the lowest token index).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..enums import PairLossForm
from .contrastive import pair_loss

CHUNK_ELEMENTS = 1 << 25
"""The most (query token, document token) similarities one chunk of MaxSim holds (128 MiB in float32)."""


def maxsim_chunk(query_tokens: int, document_tokens: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Query tokens per chunk: as many as keep a chunk's [chunk, Dt] similarities within `elements`."""
    return max(1, min(query_tokens, elements // max(1, document_tokens)))


class MaxSim(torch.autograd.Function):
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


def maxsim(queries: Tensor, documents: Tensor, document_of: Tensor, columns: int, chunk: int | None = None) -> Tensor:
    """best [Qt, Dd]: each query token's best similarity among each document column's tokens.

    queries [Qt, W]; documents [Dt, W]; document_of [Dt] int64, each document token's column in
    [0, columns), `columns` (= Dd) marking padding. An empty column scores 0 and takes no gradient.
    `chunk` query tokens are scored at a time (default: `maxsim_chunk`).
    """
    if queries.dim() != 2 or documents.dim() != 2 or queries.shape[1] != documents.shape[1]:
        raise ValueError(
            f"maxsim: queries [Qt, W] and documents [Dt, W] must share W, got {tuple(queries.shape)}, "
            f"{tuple(documents.shape)}"
        )
    if tuple(document_of.shape) != (documents.shape[0],):
        raise ValueError(f"maxsim: document_of must be [{documents.shape[0]}], got {tuple(document_of.shape)}")
    chunk = maxsim_chunk(queries.shape[0], documents.shape[0]) if chunk is None else max(1, int(chunk))
    return MaxSim.apply(queries, documents, document_of.long(), int(columns), chunk)  # type: ignore[no-any-return]


def late_scores(
    queries: Tensor,
    query_slot: Tensor,
    documents: Tensor,
    document_of: Tensor,
    slots: int,
    columns: int,
    chunk: int | None = None,
) -> Tensor:
    """scores [S, Dd]: score(q, d) = sum over the query tokens of slot q of their MaxSim against column d.

    query_slot [Qt] int64 each query token's slot in [0, slots), `slots` marking padding; the rest as in
    `maxsim`. Rows of slots without query tokens are zero.
    """
    best = maxsim(queries, documents, document_of, columns, chunk)  # [Qt, Dd]
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
) -> tuple[Tensor, Tensor]:
    """The late-interaction pair loss as (sum of the anchor terms, anchors), before its weight.

    queries, query_slot, documents, document_of as in `late_scores`; groups [S] each row's temperature
    group; log_inverse_temperature, bias [G]; z, w [S, Dd] the pair targets of every (query slot,
    document column), zero where a row holds no query or a column no document (the host resolved them
    through the step's relations, as for the pooled term). The logit is t_g * score + b_g; under Ranked
    the bias cancels and is left out (its gradient an exact zero). `positives` bounds the positives of
    any row for Ranked (see `contrastive.pair_loss`).
    """
    if PairLossForm(form) == PairLossForm.Derived:
        raise ValueError("late_interaction_term: PairLossForm.Derived must be resolved by the caller (ranked)")
    slots, columns = z.shape
    scores = late_scores(queries, query_slot, documents, document_of, slots, columns, chunk)  # [S, Dd]
    groups = groups.long()
    inverse_temperature = log_inverse_temperature.float().exp()[groups]  # [S]
    row_bias = bias.float()[groups]  # [S]
    if PairLossForm(form) == PairLossForm.Ranked:
        row_bias = row_bias * 0.0
    logits = inverse_temperature[:, None] * scores + row_bias[:, None]  # [S, Dd]
    return pair_loss(logits, z, w, PairLossForm(form), positives)
