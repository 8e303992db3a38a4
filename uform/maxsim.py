"""Late-interaction scores of query tapes against document tapes (ColBERT's MaxSim, Khattab and Zaharia 2020),
as `Model.maxsim` and the held-out evaluation through the fleet score them.

Shape legend: Q queries, N documents, Tq / Td their token vectors in all, W a vector's width.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["maxsim_scores"]

BLOCK = 1 << 24
"""Similarity entries one block of `maxsim_scores` holds at most (64 MiB of f32)."""


def maxsim_scores(
    queries: Tensor, query_offsets: np.ndarray, documents: Tensor, document_offsets: np.ndarray, device: torch.device
) -> Tensor:
    """[Q, N] f32 on the host: for each query and document, the sum over the query's vectors ([Tq, W], item q's
    `queries[query_offsets[q]:query_offsets[q + 1]]`) of the best dot product with any of the document's ([Td, W],
    likewise). A query without vectors scores 0; so does every query vector against a document without vectors.
    Blocks of whole documents keep each similarity block under `BLOCK` entries."""
    q_count, d_count = len(query_offsets) - 1, len(document_offsets) - 1
    scores = torch.zeros(q_count, d_count, dtype=torch.float32)
    if q_count == 0 or d_count == 0 or queries.shape[0] == 0:
        return scores
    q = queries.to(device, torch.float32)  # [Tq, W]
    d = documents.to(device, torch.float32)  # [Td, W]
    query_of = torch.repeat_interleave(  # [Tq] each vector's query
        torch.arange(q_count, device=device), torch.from_numpy(np.diff(query_offsets)).to(device)
    )
    document_of = torch.repeat_interleave(  # [Td] each vector's document
        torch.arange(d_count, device=device), torch.from_numpy(np.diff(document_offsets)).to(device)
    )
    budget = max(1, BLOCK // max(1, q.shape[0]))
    first = 0
    while first < d_count:
        last = first + 1
        while last < d_count and document_offsets[last + 1] - document_offsets[first] <= budget:
            last += 1
        a, b = int(document_offsets[first]), int(document_offsets[last])
        best = torch.full((q.shape[0], last - first), -math.inf, device=device)  # [Tq, documents of the block]
        if b > a:
            similarity = q @ d[a:b].T  # [Tq, tokens of the block]
            column = (document_of[a:b] - first).expand(q.shape[0], -1)
            best = best.scatter_reduce(1, column, similarity, "amax", include_self=True)
        best = torch.where(torch.isinf(best), 0.0, best)  # a document without vectors adds nothing
        block = torch.zeros(q_count, last - first, device=device).index_add(0, query_of, best)
        scores[:, first:last] = block.cpu()
        first = last
    return scores
