"""`uform.evaluate`: retrieval metrics against a brute-force reference, and the text encoder of a trainer."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from uform import BatchShape, Executor, Objective, Schedule, Trainer, TrainerInitVramConfig
from uform.evaluate import encode_texts, retrieval_metrics

torch.set_num_threads(2)


def brute_force(queries: torch.Tensor, documents: torch.Tensor, relevant: list[list[int]], ks: tuple[int, ...]) -> dict:
    """Every query's ranking written out: sort (-score, index) pairs one query at a time."""
    out = {f"recall@{k}": 0.0 for k in ks}
    reciprocal = 0.0
    for i, rel in enumerate(relevant):
        scores = [float(torch.dot(queries[i].double(), documents[j].double())) for j in range(len(documents))]
        ranking = sorted(range(len(documents)), key=lambda j: (-scores[j], j))
        for k in ks:
            out[f"recall@{k}"] += len(set(ranking[:k]) & set(rel)) / len(set(rel))
        reciprocal += 1.0 / (min(ranking.index(j) for j in rel) + 1)
    count = len(relevant)
    return {**{k: v / count for k, v in out.items()}, "mrr": reciprocal / count}


def unit(rows: int, width: int, generator: torch.Generator) -> torch.Tensor:
    return F.normalize(torch.randn(rows, width, generator=generator), dim=-1)


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    queries, documents = unit(17, 8, g), unit(40, 8, g)
    relevant = [sorted(rng.choice(40, size=int(rng.integers(1, 4)), replace=False).tolist()) for _ in range(17)]
    ks = (1, 3, 10)
    got = retrieval_metrics(queries, documents, relevant, ks=ks)
    want = brute_force(queries, documents, relevant, ks)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


def test_single_ids_and_tape_agree_with_lists() -> None:
    g = torch.Generator().manual_seed(3)
    queries, documents = unit(6, 16, g), unit(12, 16, g)
    as_lists = [[i] for i in range(6)]
    as_ints = list(range(6))
    as_tape = (np.arange(6), np.arange(7))
    want = retrieval_metrics(queries, documents, as_lists)
    assert retrieval_metrics(queries, documents, as_ints) == want
    assert retrieval_metrics(queries, documents, as_tape) == want
    several = [[0, 5], [1], [2, 3, 4], [3], [4], [5, 11]]
    data = np.array([d for r in several for d in r])
    offsets = np.cumsum([0] + [len(r) for r in several])
    assert retrieval_metrics(queries, documents, (data, offsets)) == retrieval_metrics(queries, documents, several)


def test_perfect_and_worst() -> None:
    eye = torch.eye(8)
    perfect = retrieval_metrics(eye, eye, list(range(8)))
    assert perfect == {"recall@1": 1.0, "recall@10": 1.0, "mrr": 1.0}
    # Each query's relevant document scores lowest of 20: rank 20, outside the top 10.
    queries = eye[:4, :]
    documents = torch.cat([F.normalize(torch.ones(16, 8), dim=-1), -eye[:4]])
    worst = retrieval_metrics(queries, documents, [16, 17, 18, 19])
    assert worst["recall@1"] == 0.0 and worst["recall@10"] == 0.0
    assert worst["mrr"] == pytest.approx(1 / 20)


def test_ties_rank_lower_index_first() -> None:
    queries = torch.tensor([[1.0, 0.0]])
    documents = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    assert retrieval_metrics(queries, documents, [1], ks=(1,))["recall@1"] == 1.0
    assert retrieval_metrics(queries, documents, [3], ks=(1, 2, 3))["recall@2"] == 0.0
    assert retrieval_metrics(queries, documents, [3], ks=(3,))["recall@3"] == 1.0
    assert retrieval_metrics(queries, documents, [3])["mrr"] == pytest.approx(1 / 3)


def test_recall_counts_every_relevant_document() -> None:
    queries = torch.tensor([[1.0, 0.0]])
    documents = F.normalize(torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [1.0, 0.2]]), dim=-1)
    got = retrieval_metrics(queries, documents, [[0, 2]], ks=(1, 3, 4))
    assert got["recall@1"] == 0.5 and got["recall@3"] == 0.5 and got["recall@4"] == 1.0
    assert got["mrr"] == 1.0


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ((np.zeros((2, 4)), torch.zeros(3, 4), [0, 1]), "queries"),
        ((torch.zeros(4), torch.zeros(3, 4), [0]), "queries"),
        ((torch.zeros(0, 4), torch.zeros(3, 4), []), "queries"),
        ((torch.zeros(2, 4), torch.zeros(3, 5), [0, 1]), "documents"),
        ((torch.zeros(2, 4), torch.zeros(0, 4), [0, 1]), "documents"),
        ((torch.full((2, 4), math.nan), torch.zeros(3, 4), [0, 1]), "queries"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), [0]), "relevant"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), [0, 3]), "relevant[1]"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), [0, -1]), "relevant[1]"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), [[0], []]), "relevant[1]"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), [[0], [1.5]]), "relevant[1]"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), [0, "1"]), "relevant[1]"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), "01"), "relevant"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), (np.array([0, 1]), np.array([0, 1]))), "relevant"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), (np.array([0, 1]), np.array([0, 2, 1]))), "relevant"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), (np.array([0.0, 1.0]), np.array([0, 1, 2]))), "relevant"),
    ],
)
def test_bad_inputs_name_the_argument(arguments: tuple, name: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(name) + ":"):
        retrieval_metrics(*arguments)


@pytest.mark.parametrize("ks", [(), (0,), (1, -2), 5, (1.5,), (True,)])
def test_bad_ks(ks: object) -> None:
    with pytest.raises(ValueError, match=r"^ks:"):
        retrieval_metrics(torch.eye(2), torch.eye(2), [0, 1], ks=ks)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# encode_texts

TEXTS = [
    "the quick brown fox",
    "jumps over the lazy dog",
    "x",
    "",
    "a sentence long enough to be cut at the row's width: " + "lorem ipsum " * 20,
    "pack my box with five dozen liquor jugs",
    "sphinx of black quartz, judge my vow",
    "how vexingly quick daft zebras jump",
    "the five boxing wizards jump quickly",
    "bright vixens jump; dozy fowl quack",
]


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    config = TrainerInitVramConfig(
        depth=1,
        hidden=128,
        objective=Objective.Joint,
        batch=BatchShape(max_rows_per_device=2, max_segments_per_device=4, max_columns_per_row=64),
        schedule=Schedule(steps=10),
        seed=11,
    )
    made = Trainer.init_vram(Executor.cpu(), config)
    yield made
    made.close()


def test_encode_texts_shape_norm_and_independence(trainer: Trainer) -> None:
    before = {k: v.clone() for k, v in trainer.network.state_dict().items()}
    together = encode_texts(trainer, TEXTS, chunk=64)
    assert together.shape == (len(TEXTS), 128) and together.dtype == torch.float32
    assert torch.allclose(together.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    # A text's embedding does not depend on its neighbours in the pack.
    alone = torch.cat([encode_texts(trainer, [t], chunk=1) for t in TEXTS])
    assert torch.allclose(together, alone, atol=1e-5)
    assert torch.allclose(
        encode_texts(trainer, [t.encode() for t in reversed(TEXTS)], chunk=3), together.flip(0), atol=1e-5
    )
    # A text longer than a row is cut at the row's width: only its first bytes matter.
    long = TEXTS[4]
    assert torch.allclose(encode_texts(trainer, [long + " tail"], 4), encode_texts(trainer, [long], 4), atol=1e-6)
    # Nothing about the trainer changed.
    after = trainer.network.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.network.training and trainer.steps_taken == 0


def test_encode_texts_distinguishes_texts(trainer: Trainer) -> None:
    e = encode_texts(trainer, TEXTS, chunk=8)
    similarity = e @ e.T
    off = similarity[~torch.eye(len(TEXTS), dtype=torch.bool)]
    assert float(off.max()) < 0.99999


def test_encode_texts_empty_and_bad(trainer: Trainer) -> None:
    assert encode_texts(trainer, [], 4).shape == (0, 128)
    with pytest.raises(ValueError, match=r"^texts:"):
        encode_texts(trainer, "not a list", 4)
    with pytest.raises(ValueError, match=r"^chunk:"):
        encode_texts(trainer, TEXTS, 0)
