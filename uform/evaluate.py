"""Retrieval evaluation: recall@k and MRR of query embeddings against document embeddings, and the
small helper that embeds texts with a trainer's network for it.

Shape legend: Q queries, N documents, D embedding width.

`retrieval_metrics` scores every (query, document) pair by the dot product of L2-normalised embeddings
(the cosine), ranks each query's documents by descending score with ties broken by the lower document
index, and answers

- `recall@k`: the mean over queries of |relevant documents in the top k| / |relevant documents|;
- `mrr`: the mean over queries of 1 / (rank of the best-ranked relevant document), ranks counted from 1.

`encode_texts` is the evaluation path until the serving model (`uform.load(...).encode`) exists: it
runs the trainer's network forward in eval mode, without gradients and without touching the weights,
the optimizer or the step counter. `choose_texts` answers, the same way, the choice distribution the
choices term trains (what `text_choose` serves): p over each state's legal bytes at its appended MASK.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import vocab
from .config import Choices
from .data.batch import prepare
from .data.items import ChoiceTapes
from .enums import LateInteractionSide, Modality, Objective
from .losses.choices import choice_probabilities
from .model.attention import document_mask

__all__ = ["choose_texts", "encode_texts", "retrieval_metrics"]


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
    if isinstance(ks, (int, str, bytes)) or not isinstance(ks, Sequence) or len(ks) == 0:
        raise ValueError("ks: expected a non-empty sequence of positive integers")
    if not all(_is_int(k) and k >= 1 for k in ks):
        raise ValueError(f"ks: every k must be a positive integer, got {list(ks)}")
    per_query = _relevance(relevant, q.shape[0], d.shape[0])

    scores = (q.double() @ d.double().T).numpy()  # [Q, N]
    # Rank of document j for query i (0 = best): descending score, ties to the lower index. A stable
    # sort of the negated scores keeps equal scores in index order.
    order = np.argsort(-scores, axis=1, kind="stable")  # [Q, N]
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(scores.shape[1])[None, :].repeat(scores.shape[0], 0), axis=1)

    out: dict[str, float] = {}
    ranks = [rank[i, ids] for i, ids in enumerate(per_query)]
    for k in ks:
        out[f"recall@{int(k)}"] = float(np.mean([(r < k).sum() / r.size for r in ranks]))
    out["mrr"] = float(np.mean([1.0 / (r.min() + 1) for r in ranks]))
    return out


# --------------------------------------------------------------------------------------------------
# Embedding texts with a trainer's network (the evaluation path until `uform.load(...).encode`)


def _chunks(lengths: Sequence[int], rows: int, columns: int, segments: int) -> list[tuple[int, int, int]]:
    """Splits items of `lengths` positions (prefix + content, each already cut to `columns`) into
    consecutive chunks `(start, stop, rows_needed)` that the packer is sure to place whole.

    First-fit fails an item of length s only when every row has less than s free, which needs more than
    rows * (columns - s) positions already used. So a chunk fits in `r` rows whenever it holds at most `r`
    items, or its total length is at most r * (columns - its longest item).
    """
    out = []
    start = 0
    while start < len(lengths):
        total, longest, stop = 0, 0, start
        while stop < len(lengths) and stop - start < segments:
            total_next, longest_next = total + lengths[stop], max(longest, lengths[stop])
            need = _rows_for(stop + 1 - start, total_next, longest_next, columns)
            if need > rows and stop > start:
                break
            total, longest, stop = total_next, longest_next, stop + 1
        out.append((start, stop, _rows_for(stop - start, total, longest, columns)))
        start = stop
    return out


def _rows_for(count: int, total: int, longest: int, columns: int) -> int:
    by_count = count
    by_room = -(-total // (columns - longest)) if longest < columns else count
    return max(1, min(by_count, by_room))


@torch.no_grad()
def encode_texts(trainer: Any, texts: Sequence[bytes | str], chunk: int = 256) -> Tensor:
    """L2-normalised pooled embeddings [len(texts), hidden] (f32, on the host) of `texts` under
    `trainer`'s current weights.

    The evaluation path until the serving model (`uform.load(...).encode`) arrives. Texts go through the
    trainer's own packing (`data.batch.prepare`) with the contrastive objective, so nothing is corrupted;
    a text longer than a row is cut at the row's width, as in training. At most `chunk` texts (and at most
    the run's `max_rows_per_device` rows of `max_columns_per_row`) go through one forward, grouped so that
    the packer never drops one. The network runs in eval mode without gradients (bf16 autocast on CUDA,
    as in training) and is put back in the mode it was in; weights, optimizer and step are untouched.
    """
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise ValueError(f"texts: expected a sequence of bytes or str, got {type(texts).__name__}")
    if not _is_int(chunk) or chunk < 1:
        raise ValueError(f"chunk: must be a positive integer, got {chunk!r}")
    items = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in texts]
    network = trainer.network
    device = trainer.device
    if not items:
        return torch.zeros(0, trainer.config.hidden)
    b = trainer.config.batch
    columns = b.max_columns_per_row
    head = len(vocab.prefix(Modality.Text, None))
    lengths = [min(head + len(t), columns) for t in items]
    segments = min(int(chunk), b.max_segments_per_device)
    out = torch.zeros(len(items), trainer.config.hidden)
    was_training = network.training
    network.eval()
    try:
        for start, stop, rows in _chunks(lengths, b.max_rows_per_device, columns, segments):
            n = stop - start
            # The run's config with contrastive alone (no corruption), no late interaction (no side
            # markers) and a geometry just big enough for this chunk (the forward takes any shape).
            config = dataclasses.replace(
                trainer.config,
                objective=Objective.Contrastive,
                late_interaction=dataclasses.replace(trainer.config.late_interaction, weight=0.0),
                batch=dataclasses.replace(
                    b, max_rows_per_device=rows, max_segments_per_device=n, max_bags_per_device=0
                ),
            )
            batch = prepare(
                config,
                [Modality.Text] * n,
                items[start:stop],
                bags=None,
                groups=None,
                sides=None,
                relations=None,
                step=0,
            )
            if batch.dropped:  # pragma: no cover - _chunks makes this impossible
                raise RuntimeError(f"encode_texts: {batch.dropped} texts found no room")
            tensors = {k: v.to(device) for k, v in batch.host_tensors(pin=False).items()}
            # The dense document mask computes the same function as the flex path and takes any geometry.
            mask = document_mask(tensors["segments"], "dense", None)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                states = network.states(tensors, mask)
                pooled = network.pooled(states, tensors["segments"], tensors["counts"])
            pooled = F.normalize(pooled.float(), dim=-1).cpu()  # [n, hidden], by slot
            out[start:stop] = pooled[torch.from_numpy(batch.layout.slot)]
    finally:
        network.train(was_training)
    return out


@torch.no_grad()
def choose_texts(
    network: Any,
    states: Sequence[bytes | str],
    choices: Sequence[bytes | str],
    *,
    side: LateInteractionSide = LateInteractionSide.None_,
    chunk: int = 256,
) -> list[np.ndarray]:
    """p over each state's legal bytes: float32 arrays, `p[i][k]` the probability of `choices[i][k]`.

    `network` is a run's `Network` (a trainer's `trainer.network`; the serving model holds the same).
    Each state goes through the trainer's own packing exactly as a training item that makes a choice:
    its bytes with a MASK appended, the head cut where the row is too short, uncorrupted, with the
    prefix of `side` where the run has late interaction on. The masked text head's logits at the MASK,
    restricted to the legal bytes, are soft-maxed. Eval mode, no gradients (bf16 autocast on CUDA, as in
    training); the network's mode is put back, nothing else is touched. Legal bytes must be unique and
    at least one per state.
    """
    if isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
        raise ValueError(f"states: expected a sequence of bytes or str, got {type(states).__name__}")
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or len(choices) != len(states):
        raise ValueError("choices: expected one bytes or str of legal bytes per state")
    if not _is_int(chunk) or chunk < 1:
        raise ValueError(f"chunk: must be a positive integer, got {chunk!r}")
    items = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in states]
    legal = [c.encode("utf-8") if isinstance(c, str) else bytes(c) for c in choices]
    for i, c in enumerate(legal):
        if not c or len(set(c)) != len(c):
            raise ValueError(f"choices[{i}]: needs at least one legal byte, each unique")
    if not items:
        return []
    run = network.config
    device = next(network.parameters()).device
    b = run.batch
    columns = b.max_columns_per_row
    late = run.late_interaction.weight > 0
    head = len(vocab.prefix(Modality.Text, side if late else None))
    lengths = [min(head + len(t) + 1, columns) for t in items]
    segments = min(int(chunk), b.max_segments_per_device)
    out: list[np.ndarray] = []
    was_training = network.training
    network.eval()
    try:
        for start, stop, rows in _chunks(lengths, b.max_rows_per_device, columns, segments):
            n = stop - start
            width = max(len(c) for c in legal[start:stop])
            # The run's config with contrastive alone (no corruption), choices on and a geometry just big
            # enough for this chunk (the forward takes any shape).
            config = dataclasses.replace(
                run,
                objective=Objective.Contrastive,
                choices=Choices(weight=1.0),
                late_interaction=dataclasses.replace(  # room for every state, whatever its side
                    run.late_interaction,
                    max_query_tokens_per_device=run.late_interaction.max_query_span * n,
                    max_documents_per_device=n,
                    max_document_tokens_per_device=rows * columns,
                ),
                batch=dataclasses.replace(
                    b,
                    max_rows_per_device=rows,
                    max_segments_per_device=n,
                    max_bags_per_device=0,
                    max_choices_per_item=width,
                ),
            )
            offered = legal[start:stop]
            offsets = np.cumsum([0] + [len(c) for c in offered]).astype(np.int64)
            tapes = ChoiceTapes(
                data=np.frombuffer(b"".join(offered), dtype=np.uint8).copy(),
                offsets=offsets,
                targets=np.concatenate([np.full(len(c), 1.0 / len(c), dtype=np.float32) for c in offered]),
            )
            batch = prepare(
                config,
                [Modality.Text] * n,
                items[start:stop],
                bags=None,
                groups=None,
                sides=[side] * n,
                relations=None,
                step=0,
                choices=tapes,
            )
            if batch.dropped:  # pragma: no cover - _chunks makes this impossible
                raise RuntimeError(f"choose_texts: {batch.dropped} states found no room")
            tensors = {k: v.to(device) for k, v in batch.host_tensors(pin=False).items()}
            mask = document_mask(tensors["segments"], "dense", None)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                states_ = network.states(tensors, mask)
                flat = states_.reshape(-1, states_.shape[-1])
                logits = network.text_head(flat[tensors["choice.index"]])  # [n, 256]
            p = choice_probabilities(logits.float(), tensors["choice.bytes"], tensors["choice.legal"]).cpu().numpy()
            for k, slot in enumerate(batch.layout.slot.tolist()):
                out.append(p[slot, : len(offered[k])].astype(np.float32))
    finally:
        network.train(was_training)
    return out
