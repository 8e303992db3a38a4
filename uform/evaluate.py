"""Retrieval evaluation: recall@k and MRR of any queries against any documents, scored by pooled
embeddings or by late interaction, and the helper that embeds texts with a trainer's live network.

Shape legend: Q queries, N documents, D embedding width.

`ranking_metrics` takes a score matrix [Q, N], ranks each query's documents by descending score with ties
broken by the lower document index, and answers

- `recall@k`: the mean over queries of |relevant documents in the top k| / |relevant documents|;
- `mrr`: the mean over queries of 1 / (rank of the best-ranked relevant document), ranks counted from 1;
- `ndcg@k` (where asked): the mean over queries of DCG@k / IDCG@k with binary gains, DCG@k the sum over the
  relevant documents ranked r <= k of 1 / log2(r + 1), IDCG@k that sum had they taken the first ranks.

`exclude` leaves one document out of each query's ranking (the query itself, where queries and documents are
drawn from one pool): it is ranked after every other, so no other document's rank moves.

`retrieval_metrics` scores by the dot product of L2-normalised embeddings (the cosine); `evaluate_retrieval`
encodes queries and documents of any modalities with a served `Model` (`uform.load`) and scores them by
their pooled embeddings or, with `late=True`, by MaxSim over their token vectors. `encode_texts` embeds
texts with a trainer's current weights through the serving path (`Model.from_trainer`), for evaluation
during training: eval mode, no gradients, nothing of the trainer changed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .enums import LateInteractionSide, Modality
from .serve import Model

__all__ = ["encode_texts", "evaluate_retrieval", "ranking_metrics", "retrieval_metrics"]


# --------------------------------------------------------------------------------------------------
# Metrics


def _relevance(relevant: Any, queries: int, documents: int) -> list[np.ndarray]:
    """Per-query arrays of relevant document ids, from a sequence of ints / sequences or a (data, offsets) tape."""
    tape = (
        isinstance(relevant, tuple)
        and len(relevant) == 2
        and isinstance(relevant[0], np.ndarray)
        and isinstance(relevant[1], np.ndarray)
    )
    if tape:
        data = np.asarray(relevant[0])
        offsets = np.asarray(relevant[1])
        if data.ndim != 1 or offsets.ndim != 1:
            raise ValueError("relevant: a (data, offsets) tape needs two flat arrays")
        if data.size and data.dtype.kind not in "iu":
            raise ValueError(f"relevant: the tape's data must be integer document ids, got {data.dtype}")
        if offsets.dtype.kind not in "iu":
            raise ValueError(f"relevant: the tape's offsets must be integers, got {offsets.dtype}")
        if offsets.size != queries + 1:
            raise ValueError(
                f"relevant: the tape's offsets must hold queries + 1 = {queries + 1} entries, got {offsets.size}"
            )
        if offsets[0] != 0 or offsets[-1] != data.size or np.any(np.diff(offsets) < 0):
            raise ValueError(f"relevant: the tape's offsets must rise from 0 to len(data) = {data.size}")
        per_query = [data[int(a) : int(b)].astype(np.int64) for a, b in itertools.pairwise(offsets)]
    elif isinstance(relevant, (Sequence, np.ndarray)) and not isinstance(relevant, (str, bytes)):
        if len(relevant) != queries:
            raise ValueError(f"relevant: needs one entry per query ({queries}), got {len(relevant)}")
        per_query = []
        for i, r in enumerate(relevant):
            if _is_int(r):
                per_query.append(np.array([int(r)], dtype=np.int64))
                continue
            if isinstance(r, (str, bytes)) or not isinstance(r, (Sequence, np.ndarray)):
                raise ValueError(f"relevant[{i}]: expected a document id or a sequence of them, got {type(r).__name__}")
            if not all(_is_int(x) for x in r):
                raise ValueError(f"relevant[{i}]: document ids must be integers")
            per_query.append(np.array([int(x) for x in r], dtype=np.int64))
    else:
        raise ValueError(
            f"relevant: expected a sequence per query or a (data, offsets) tape, got {type(relevant).__name__}"
        )
    for i, ids in enumerate(per_query):
        if ids.size == 0:
            raise ValueError(f"relevant[{i}]: every query needs at least one relevant document")
        if ids.min() < 0 or ids.max() >= documents:
            raise ValueError(f"relevant[{i}]: document ids must lie in [0, {documents}), got {ids.tolist()}")
    return [np.unique(ids) for ids in per_query]


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _embeddings(value: Any, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.ndim != 2:
        raise ValueError(f"{name}: expected a [count, width] matrix, got {value.ndim} dimensions")
    if not (value.is_floating_point() or value.dtype == torch.int8):
        raise ValueError(f"{name}: expected float embeddings, got {value.dtype}")
    value = value.detach().float().cpu()
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name}: embeddings must be finite")
    return value


def retrieval_metrics(
    queries: Tensor, documents: Tensor, relevant: Any, ks: Sequence[int] = (1, 10)
) -> dict[str, float]:
    """Recall@k for every k in `ks` and MRR of `queries` [Q, D] retrieving from `documents` [N, D].

    `relevant` names each query's relevant document ids: a sequence with one entry per query, each an
    int or a sequence of ints, or a `(data, offsets)` tape of two numpy arrays (offsets of Q + 1
    entries). Every query needs
    at least one. Embeddings are taken as L2-normalised, so the dot product is the cosine score; ties
    rank the lower document index first. Answers `{"recall@1": ..., "recall@10": ..., "mrr": ...}`.
    Raises `ValueError` naming the argument on bad input.
    """
    q = _embeddings(queries, "queries")
    d = _embeddings(documents, "documents")
    if q.shape[0] == 0:
        raise ValueError("queries: needs at least one query")
    if d.shape[0] == 0:
        raise ValueError("documents: needs at least one document")
    if q.shape[1] != d.shape[1]:
        raise ValueError(f"documents: width {d.shape[1]} differs from the queries' width {q.shape[1]}")
    _check_ks(ks)
    per_query = _relevance(relevant, q.shape[0], d.shape[0])
    return _rank(q.double() @ d.double().T, per_query, ks)


def ranking_metrics(
    scores: Tensor,
    relevant: Any,
    ks: Sequence[int] = (1, 10),
    *,
    ndcg: Sequence[int] = (),
    exclude: Sequence[int] | np.ndarray | None = None,
) -> dict[str, float]:
    """Recall@k for every k in `ks` and MRR of a score matrix `scores` [Q, N] (higher is better; ties rank
    the lower document index first), with `relevant` as `retrieval_metrics` takes it; nDCG@k for every k in
    `ndcg`. `exclude` [Q] names a document each query's ranking leaves out (-1: none), which must not be one
    of its relevant ones (see the module's docstring)."""
    if not isinstance(scores, Tensor) or scores.ndim != 2 or not scores.is_floating_point():
        raise ValueError("scores: expected a [queries, documents] float tensor")
    if scores.shape[0] == 0:
        raise ValueError("scores: needs at least one query")
    if scores.shape[1] == 0:
        raise ValueError("scores: needs at least one document")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores: must be finite")
    _check_ks(ks)
    if len(ndcg):
        _check_ks(ndcg)
    per_query = _relevance(relevant, scores.shape[0], scores.shape[1])
    scored = scores.detach().double().cpu()
    if exclude is not None:
        left = np.asarray(exclude)
        if left.shape != (scores.shape[0],) or (left.size and left.dtype.kind not in "iu"):
            raise ValueError(f"exclude: expected one document id (or -1) per query, {scores.shape[0]} ints")
        if left.size and (left.min() < -1 or left.max() >= scores.shape[1]):
            raise ValueError(f"exclude: document ids must lie in [-1, {scores.shape[1]})")
        for i, ids in enumerate(per_query):
            if left[i] in ids:
                raise ValueError(f"exclude[{i}]: document {int(left[i])} is one of the query's relevant documents")
        rows = np.flatnonzero(left >= 0)
        scored = scored.clone()
        scored[torch.from_numpy(rows), torch.from_numpy(left[rows].astype(np.int64))] = -math.inf  # ranked last
    return _rank(scored, per_query, ks, ndcg)


def _check_ks(ks: Any) -> None:
    if isinstance(ks, (int, str, bytes)) or not isinstance(ks, Sequence) or len(ks) == 0:
        raise ValueError("ks: expected a non-empty sequence of positive integers")
    if not all(_is_int(k) and k >= 1 for k in ks):
        raise ValueError(f"ks: every k must be a positive integer, got {list(ks)}")


def _rank(scores: Tensor, per_query: list[np.ndarray], ks: Sequence[int], ndcg: Sequence[int] = ()) -> dict[str, float]:
    scores_np = scores.numpy()  # [Q, N]
    # Rank of document j for query i (0 = best): descending score, ties to the lower index. A stable
    # sort of the negated scores keeps equal scores in index order.
    order = np.argsort(-scores_np, axis=1, kind="stable")  # [Q, N]
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(scores_np.shape[1])[None, :].repeat(scores_np.shape[0], 0), axis=1)

    out: dict[str, float] = {}
    ranks = [rank[i, ids] for i, ids in enumerate(per_query)]
    for k in ks:
        out[f"recall@{int(k)}"] = float(np.mean([(r < k).sum() / r.size for r in ranks]))
    out["mrr"] = float(np.mean([1.0 / (r.min() + 1) for r in ranks]))
    for k in ndcg:
        gains = [np.sum(1.0 / np.log2(r[r < k] + 2.0)) for r in ranks]  # rank r (from 0) discounts log2(r + 2)
        ideal = [np.sum(1.0 / np.log2(np.arange(min(int(k), r.size)) + 2.0)) for r in ranks]
        out[f"ndcg@{int(k)}"] = float(np.mean([g / i for g, i in zip(gains, ideal, strict=True)]))
    return out


# --------------------------------------------------------------------------------------------------
# The whole loop: a served model's retrieval


def _side_items(items: Any, field: str) -> tuple[Any, Any]:
    """(modalities, contents) of one side: a `(modalities, contents)` pair (a 2-tuple whose first element is
    a sequence of modalities, not a text) or a sequence of texts."""
    pair = isinstance(items, tuple) and len(items) == 2 and isinstance(items[0], (Sequence, np.ndarray))
    if pair and not isinstance(items[0], (str, bytes, bytearray)):
        return items
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError(
            f"{field}: expected a sequence of texts or a (modalities, contents) pair, got {type(items).__name__}"
        )
    return [Modality.Text] * len(items), items


def evaluate_retrieval(
    model: Any,
    queries: Any,
    documents: Any,
    relevant: Any,
    *,
    ks: Sequence[int] = (1, 10),
    width: int | None = None,
    late: bool = False,
) -> dict[str, float]:
    """Recall@k for every k in `ks` and MRR of `queries` retrieving `documents` with a served `model`.

    `queries` and `documents` are each a sequence of texts or a `(modalities, contents)` pair of any
    modalities, as `Model.encode` takes them; `relevant` names each query's relevant document indices (as
    `retrieval_metrics`). Scores are the cosine of the pooled embeddings (at Matryoshka `width` when given)
    or, with `late`, the MaxSim of the queries' `Query` token vectors against the documents' `Document`
    ones (a run that trained late interaction). A media item the model cannot embed raises `MediaError`
    naming it (the model's default `errors="raise"`): a metric over a stand-in vector would be wrong silently.
    """
    q_modalities, q_contents = _side_items(queries, "queries")
    d_modalities, d_contents = _side_items(documents, "documents")
    if late:
        if width is not None:
            raise ValueError("width: a Matryoshka width applies to pooled embeddings, not to late interaction")
        q_tokens = model.tokens(q_modalities, q_contents, LateInteractionSide.Query)
        d_tokens = model.tokens(d_modalities, d_contents, LateInteractionSide.Document)
        return ranking_metrics(model.maxsim(q_tokens, d_tokens), relevant, ks)
    q = model.encode(q_modalities, q_contents, width)
    d = model.encode(d_modalities, d_contents, width)
    return retrieval_metrics(q, d, relevant, ks)


# --------------------------------------------------------------------------------------------------
# Embedding texts with a trainer's network


@torch.no_grad()
def encode_texts(trainer: Any, texts: Sequence[bytes | str], chunk: int = 256) -> Tensor:
    """L2-normalised pooled embeddings [len(texts), hidden] (f32, on the host) of `texts` under
    `trainer`'s current weights, through the serving path (`Model.from_trainer(trainer).encode`).

    Texts are cut at the row's width, as in training, and nothing is corrupted. At most `chunk` texts (and
    at most the run's `max_segments_per_device`) go through one forward. The network runs in eval mode
    without gradients (bf16 autocast on CUDA, as in training) and is put back in the mode it was in;
    weights, optimizer and step are untouched.
    """
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise ValueError(f"texts: expected a sequence of bytes or str, got {type(texts).__name__}")
    if not _is_int(chunk) or chunk < 1:
        raise ValueError(f"chunk: must be a positive integer, got {chunk!r}")
    model = Model.from_trainer(trainer, segments=int(chunk))
    try:
        return model.encode([Modality.Text] * len(texts), list(texts))
    finally:
        model.close()
