"""The demo: train a small tower contrastively on real text and watch retrieval improve.

The text is CPython's own documentation: the `topics` dict of `pydoc_data/topics.py`, which ships with
every Python (it backs `help("topics")`). Nobody here wrote it, and it needs no download.

Pairs. There are only ~80 topics, too few for a held-out tenth to measure anything (eight documents make
recall@10 trivially one), so a pair is made per *paragraph*: each topic's text is split on blank lines;
a paragraph whose lines do not share one indentation, or that looks like code or grammar (`::=`,
`>>>`, a low share of letters, no closing punctuation), is skipped; the rest are whitespace-normalised
and cut after their first sentence. The query is that opening sentence (at least 20 characters), the
document the rest of the paragraph (at least 60 characters). Paragraphs repeated across topics are kept
once, and an opening sentence shared by different paragraphs is dropped (it could not be answered). That
gives a few hundred pairs (486 on CPython 3.11). A tenth of them, chosen by a generator keyed by the
seed, is held out; the model never trains on them.

Training: each step takes `segments // 2` training pairs (query item 2k, document item 2k + 1, attract
edges both ways, every other pair of the step repelling under `Negatives.Ambient`) through the pooled
sigmoid (SigLIP) loss, over a keyed shuffle of the training pairs, epoch after epoch. Evaluation: the
held-out opening sentences are the queries, the held-out rests the documents, each query's one relevant
document its own rest; recall@1, recall@10 and MRR are printed before and after training.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections import Counter
from typing import Any, TextIO

import numpy as np
import torch

from .config import BatchShape, Contrastive, Schedule, TrainerInitVramConfig, TrainerStepConfig, TrainerStepStats
from .enums import Modality, Objective, PairLossForm
from .evaluate import encode_texts, retrieval_metrics
from .executor import Executor
from .relations import Edges, Relations
from .trainer import Trainer

__all__ = ["held_out_split", "load_pairs", "run_demo"]

DEFAULTS: dict[str, Any] = {
    "steps": 300,
    "depth": 2,
    "hidden": 128,
    "rows": 24,
    "columns": 256,
    "segments": 64,
    "seed": 0,
    "learning_rate": 2e-3,
}
"""The defaults of `run_demo` and of `uform demo`."""

MIN_QUERY = 20
MIN_DOCUMENT = 60
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"][.!?])\s+(?=[A-Z\"(*])")


def _prose(paragraph: str) -> bool:
    """Whether a paragraph reads as prose: one indentation throughout, no code or grammar."""
    lines = [line for line in paragraph.split("\n") if line.strip()]
    if len({len(line) - len(line.lstrip()) for line in lines}) != 1:
        return False
    text = " ".join(paragraph.split())
    if "::=" in text or ">>>" in text or text.startswith("..."):
        return False
    if not text.endswith((".", ":", "?", "!", ")", '"')):
        return False
    return sum(ch.isalpha() or ch == " " for ch in text) > 0.8 * len(text)


def load_pairs() -> list[tuple[str, str]]:
    """(opening sentence, rest of the paragraph) pairs from CPython's `pydoc_data.topics`, in topic order."""
    from pydoc_data.topics import topics

    found: dict[tuple[str, str], None] = {}
    for name in sorted(topics):
        for paragraph in re.split(r"\n[ \t]*\n", topics[name]):
            if not paragraph.strip() or not _prose(paragraph):
                continue
            text = " ".join(paragraph.split())
            cut = _SENTENCE_END.search(text)
            if cut is None:
                continue
            query, document = text[: cut.start()], text[cut.end() :]
            if len(query) >= MIN_QUERY and len(document) >= MIN_DOCUMENT:
                found.setdefault((query, document), None)
    openings = Counter(query for query, _ in found)
    return [pair for pair in found if openings[pair[0]] == 1]


def held_out_split(count: int, seed: int, fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices of `count` pairs: a keyed-random `fraction` held out (at least two)."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(count)
    held = max(2, round(fraction * count))
    return np.sort(order[held:]), np.sort(order[:held])


def default_executor() -> Executor:
    """The first GPU when there is one, else the CPU."""
    return Executor.for_vram([0]) if torch.cuda.is_available() else Executor.cpu()


def _bar(out: TextIO, done: int, total: int, loss: float, rate: float, width: int = 30) -> None:
    filled = width * done // max(total, 1)
    out.write(f"\r[{'#' * filled}{'-' * (width - filled)}] {done}/{total} loss {loss:.3f} {rate:.1f} steps/s")
    out.flush()


def _line(label: str, metrics: dict[str, float]) -> str:
    return (
        f"{label}: recall@1 {metrics['recall@1']:.3f}  recall@10 {metrics['recall@10']:.3f}  mrr {metrics['mrr']:.3f}"
    )


def run_demo(
    *,
    steps: int = DEFAULTS["steps"],
    depth: int = DEFAULTS["depth"],
    hidden: int = DEFAULTS["hidden"],
    rows: int = DEFAULTS["rows"],
    columns: int = DEFAULTS["columns"],
    segments: int = DEFAULTS["segments"],
    seed: int = DEFAULTS["seed"],
    learning_rate: float = DEFAULTS["learning_rate"],
    objective: Objective = Objective.Contrastive,
    max_pairs: int | None = None,
    cloze: float = 0.5,
    executor: Executor | None = None,
    progress: bool = True,
    out: TextIO | None = None,
) -> dict[str, dict[str, float]]:
    """Trains a `depth` x `hidden` tower for `steps` steps on paragraph pairs of CPython's documentation
    and answers the held-out retrieval metrics `{"before": {...}, "after": {...}}`, each with `recall@1`,
    `recall@10` and `mrr`.

    Each step packs `segments // 2` pairs into `rows` rows of `columns` bytes (longer texts are cut at the
    row's width). `max_pairs` keeps only that many pairs (a keyed-random subset, for quick runs). Runs on
    `executor`, by default the first GPU when there is one, else the CPU. Writes a progress bar (when
    `progress`) and the before / after lines to `out` (default `sys.stdout`).
    """
    out = sys.stdout if out is None else out
    if steps < 1:
        raise ValueError(f"steps: must be at least 1, got {steps}")
    if segments < 2:
        raise ValueError(f"segments: a step needs at least one pair (two segments), got {segments}")
    executor = default_executor() if executor is None else executor

    pairs = load_pairs()
    if max_pairs is not None:
        if max_pairs < 4:
            raise ValueError(f"max_pairs: needs at least 4 pairs, got {max_pairs}")
        keep = np.random.default_rng([seed, 0xC0DE]).permutation(len(pairs))[:max_pairs]
        pairs = [pairs[i] for i in sorted(keep)]
    train, held = held_out_split(len(pairs), seed)
    per_step = min(segments // 2, len(train))

    config = TrainerInitVramConfig(
        depth=depth,
        hidden=hidden,
        batch=BatchShape(max_rows_per_device=rows, max_segments_per_device=2 * per_step, max_columns_per_row=columns),
        objective=objective,
        contrastive=Contrastive(pair_loss=PairLossForm.Sigmoid),
        schedule=Schedule(steps=steps, learning_rate=learning_rate),
        seed=seed,
    )
    trainer = Trainer.init_vram(executor, config)
    try:
        queries = [pairs[i][0].encode() for i in held]
        documents = [pairs[i][1].encode() for i in held]
        relevant = list(range(len(held)))

        def evaluate() -> dict[str, float]:
            return retrieval_metrics(
                encode_texts(trainer, queries, 2 * per_step), encode_texts(trainer, documents, 2 * per_step), relevant
            )

        out.write(
            f"uform demo: {len(train)} training pairs, {len(held)} held out, {depth} x {hidden} tower, "
            f"{steps} steps of {per_step} pairs on {executor}\n"
        )
        before = evaluate()
        out.write(_line("before training", before) + "\n")
        out.flush()

        # Step items: query of pair k at 2k, its document at 2k + 1, attracting each other both ways.
        attract = Relations(
            attract=Edges(offsets=list(range(2 * per_step + 1)), ids=[i ^ 1 for i in range(2 * per_step)])
        )
        rng = np.random.default_rng([seed, 0xBA7C])
        sentences = {int(i): [pairs[i][0], *_SENTENCE_END.split(pairs[i][1])] for i in train}
        order: list[int] = []
        stats = TrainerStepStats()
        step_config = TrainerStepConfig(relations=attract, stats=stats)
        on = trainer.on(executor)
        started = time.perf_counter()
        dropped = 0
        for step in range(1, steps + 1):
            while len(order) < per_step:
                order.extend(train[rng.permutation(len(train))].tolist())
            chosen, order = order[:per_step], order[per_step:]
            contents = []
            for i in chosen:
                parts = sentences[i]
                k = int(rng.integers(1, len(parts))) if len(parts) > 1 and rng.random() < cloze else 0
                contents.append(parts[k].encode())
                contents.append(" ".join(parts[:k] + parts[k + 1 :]).encode())
            on.step([Modality.Text] * len(contents), contents, step_config)
            dropped += stats.dropped
            if progress and (step == steps or step % max(1, steps // 100) == 0):
                _bar(out, step, steps, stats.loss, step / max(time.perf_counter() - started, 1e-9))
        if progress:
            out.write("\n")
        if not math.isfinite(stats.loss):
            out.write(f"warning: the last loss is {stats.loss}\n")
        if dropped:
            out.write(f"note: {dropped} items found no room in their step (raise rows)\n")
        after = evaluate()
        out.write(_line("after training ", after) + "\n")
        out.flush()
    finally:
        trainer.close()
    return {"before": before, "after": after}
