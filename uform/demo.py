"""The demo: train a small tower contrastively on real text and watch retrieval improve.

This module is the text part; `uform.demo_shapes` is the image-text part (pictures drawn at run time and
their captions), and `uform demo` runs both by default (`--part text|image|both`), then prints `report`.

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

Training does not use the pairs themselves. On a few hundred pairs a byte-level tower trained from
scratch memorises them (measured: recall@1 on training pairs climbs to 1.0 while held-out recall stays
flat, on CPU and on a GPU after thousands of steps). It trains instead on independent random crops of
the training paragraphs, after Contriever (Izacard et al. 2021): from every prose paragraph except the
held-out ones, a query crop of 6 to 25 consecutive words and a document crop of 20 to 60, drawn
independently (they may overlap), are a positive pair. Random crops cannot be memorised, and what the
tower learns from them (which words two spans of one paragraph share) transfers to the held-out pairs.
Each step takes `segments // 2` paragraphs in a keyed shuffled order, epoch after epoch: item 2k is
paragraph k's query crop, item 2k + 1 its document crop, attract edges both ways, every other pair of
the step repelling under `Negatives.Ambient`, scored by the pooled sigmoid (SigLIP) loss under
`Objective.Contrastive` (`Objective.Joint` measured no better here, and corrupts the training inputs
that evaluation then sees clean).

Evaluation: the held-out opening sentences are the queries, the held-out rests the documents, each
query's one relevant document its own rest, cut at the row's width (as the serving path would cut them),
embedded through the serving path (`Model.from_trainer`) and scored by `uform.evaluate_retrieval`;
recall@1, recall@10 and MRR are printed before and after training. Given a `checkpoint` path, the demo
closes the whole loop: it saves the trained run there, loads it back with `uform.load` and evaluates the
loaded model too (the same numbers, up to float noise). The defaults (300 steps of 64 pairs, a 2 x 128 tower, rows of 128 bytes, peak learning rate
5e-4) finish in about two minutes on two CPU cores; measured over three seeds they beat 600 steps of 32
pairs, 150 of 128, and a peak of 1e-3.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
import torch

from .config import BatchShape, Contrastive, Schedule, TrainerInitVramConfig, TrainerStepConfig, TrainerStepStats
from .enums import Modality, Objective, PairLossForm
from .evaluate import evaluate_retrieval
from .relations import Edges, Relations
from .runtime.executor import Executor
from .serve import Model, load
from .trainer import Trainer
from .vocab import prefix

__all__ = ["held_out_split", "load_pairs", "load_paragraphs", "report", "run_demo", "text_pairs"]

DEFAULTS: dict[str, Any] = {
    "steps": 300,
    "depth": 2,
    "hidden": 128,
    "rows": 128,
    "columns": 128,
    "segments": 128,
    "seed": 0,
    "learning_rate": 5e-4,
}
"""The defaults of `run_demo` and of `uform demo`."""

MIN_QUERY = 20
"""Characters an opening sentence needs to make a pair."""
MIN_DOCUMENT = 60
"""Characters the rest of its paragraph needs."""
QUERY_WORDS = (6, 25)
"""Words of a training query crop, inclusive bounds."""
DOCUMENT_WORDS = (20, 60)
"""Words of a training document crop, inclusive bounds."""
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


def load_paragraphs() -> list[str]:
    """The prose paragraphs of CPython's `pydoc_data.topics`, whitespace-normalised, each once, in topic order."""
    from pydoc_data.topics import topics  # local: a megabyte of CPython's docs, loaded when a demo runs

    found: dict[str, None] = {}
    for name in sorted(topics):
        for paragraph in re.split(r"\n[ \t]*\n", topics[name]):
            if paragraph.strip() and _prose(paragraph):
                found.setdefault(" ".join(paragraph.split()), None)
    return list(found)


def load_pairs(paragraphs: list[str] | None = None) -> list[tuple[str, str]]:
    """(opening sentence, rest of the paragraph) pairs of the prose paragraphs (`load_paragraphs()` by
    default); an opening sentence shared by different paragraphs is dropped."""
    found = []
    for text in load_paragraphs() if paragraphs is None else paragraphs:
        cut = _SENTENCE_END.search(text)
        if cut is None:
            continue
        query, document = text[: cut.start()], text[cut.end() :]
        if len(query) >= MIN_QUERY and len(document) >= MIN_DOCUMENT:
            found.append((query, document))
    openings = Counter(query for query, _ in found)
    return [pair for pair in found if openings[pair[0]] == 1]


def _crop(words: list[str], bounds: tuple[int, int], rng: np.random.Generator) -> str:
    """A random run of `bounds` words (fewer when the paragraph is shorter)."""
    count = min(int(rng.integers(bounds[0], bounds[1] + 1)), len(words))
    start = int(rng.integers(0, len(words) - count + 1))
    return " ".join(words[start : start + count])


def held_out_split(count: int, seed: int, fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices of `count` pairs: a keyed-random `fraction` held out (at least two)."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(count)
    held = max(2, round(fraction * count))
    return np.sort(order[held:]), np.sort(order[:held])


def text_pairs(seed: int, max_paragraphs: int | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """(paragraphs, pairs) of the text part: every prose paragraph, or a keyed-random `max_paragraphs` of
    them, and their pairs (`load_pairs`); at least two pairs, for the held-out tenth."""
    paragraphs = load_paragraphs()
    if max_paragraphs is not None:
        if max_paragraphs < 4:
            raise ValueError(f"max_paragraphs: needs at least 4 paragraphs, got {max_paragraphs}")
        keep = np.random.default_rng([seed, 0xC0DE]).permutation(len(paragraphs))[:max_paragraphs]
        paragraphs = [paragraphs[i] for i in sorted(keep)]
    pairs = load_pairs(paragraphs)
    if len(pairs) < 2:
        raise ValueError(
            f"max_paragraphs: {max_paragraphs} paragraphs make {len(pairs)} pairs; the held-out tenth needs two"
        )
    return paragraphs, pairs


def report(text: dict[str, dict[str, float]], images: dict[str, Any], text_held: int) -> str:
    """The closing summary of both parts, after training: `text` as `run_demo` answers it (over `text_held`
    held-out pairs), `images` as `uform.demo_shapes.run_image_demo` does, each beside its chance level."""
    after, shapes = text["after"], images["after"]
    lines = [
        "held-out retrieval after training (chance in brackets):",
        f"  text, sentence -> rest of paragraph: recall@1 {after['recall@1']:.3f} ({1 / text_held:.3f})"
        f"  recall@10 {after['recall@10']:.3f} ({min(1.0, 10 / text_held):.3f})",
    ]
    for direction, metrics in shapes.items():
        lines.append(
            f"  images, {direction:<11}: recall@1 {metrics['recall@1']:.3f} ({metrics['chance@1']:.3f})"
            f"  recall@5 {metrics['recall@5']:.3f} ({metrics['chance@5']:.3f})"
        )
    return "\n".join(lines)


def default_executor() -> Executor:
    """The first GPU when there is one, else the CPU."""
    return Executor.for_vram([0]) if torch.cuda.is_available() else Executor.cpu()


def progress_bar(out: TextIO, done: int, total: int, loss: float, rate: float, width: int = 30) -> None:
    """Rewrites one line of `out`: a bar of `done` of `total` steps, the last loss and the rate."""
    filled = width * done // max(total, 1)
    out.write(f"\r[{'#' * filled}{'-' * (width - filled)}] {done}/{total} loss {loss:.3f} {rate:.1f} steps/s")
    out.flush()


def train_pairs(
    trainer: Trainer,
    executor: Executor,
    *,
    steps: int,
    per_step: int,
    count: int,
    pair: Callable[[int, np.random.Generator], tuple[list[Modality], list[Any]]],
    rng: np.random.Generator,
    out: TextIO,
    progress: bool,
    what: str,
) -> None:
    """`steps` steps of `per_step` pairs drawn in epochs over `count` pairs, each epoch in a keyed shuffled order;
    `pair(i, rng)` answers pair i's two items (item 2k and 2k + 1 of a step attract each other). Writes the
    progress bar and, after, a warning for a last loss that is not finite and a note of the `what` that found
    no room. Both parts of the demo train this way."""
    attract = Relations(attract=Edges(offsets=list(range(2 * per_step + 1)), ids=[i ^ 1 for i in range(2 * per_step)]))
    order: list[int] = []
    stats = TrainerStepStats()
    step_config = TrainerStepConfig(relations=attract, stats=stats)
    on = trainer.on(executor)
    started = time.perf_counter()
    dropped = 0
    for step in range(1, steps + 1):
        while len(order) < per_step:
            order.extend(rng.permutation(count).tolist())
        chosen, order = order[:per_step], order[per_step:]
        modalities: list[Modality] = []
        contents: list[Any] = []
        for i in chosen:
            kinds, items = pair(i, rng)
            modalities += kinds
            contents += items
        on.step(modalities, contents, step_config)
        dropped += stats.dropped
        if progress and (step == steps or step % max(1, steps // 100) == 0):
            progress_bar(out, step, steps, stats.loss, step / max(time.perf_counter() - started, 1e-9))
    if progress:
        out.write("\n")
    if not math.isfinite(stats.loss):
        out.write(f"warning: the last loss is {stats.loss}\n")
    if dropped:
        out.write(f"note: {dropped} {what} found no room in their step (raise rows)\n")


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
    max_paragraphs: int | None = None,
    executor: Executor | None = None,
    progress: bool = True,
    out: TextIO | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> dict[str, dict[str, float]]:
    """Trains a `depth` x `hidden` tower for `steps` steps on CPython's documentation and answers the
    held-out retrieval metrics `{"before": {...}, "after": {...}}`, each with `recall@1`, `recall@10` and
    `mrr` (see the module's docstring for the data); with a `checkpoint` path, the trained run is saved
    there, loaded back (`uform.load`) and evaluated again under `"loaded"`.

    Each step packs `segments // 2` crop pairs into `rows` rows of `columns` bytes (longer texts are cut
    at the row's width), at peak `learning_rate` over a warmup and cosine `Schedule`. `max_paragraphs` keeps
    only that many paragraphs (a keyed-random subset, for quick runs). Runs on `executor`, by default
    the first GPU when there is one, else the CPU. Writes a progress bar (when `progress`) and the
    before / after lines to `out` (default `sys.stdout`).
    """
    out = sys.stdout if out is None else out
    if steps < 1:
        raise ValueError(f"steps: must be at least 1, got {steps}")
    if segments < 2:
        raise ValueError(f"segments: a step needs at least one pair (two segments), got {segments}")
    executor = default_executor() if executor is None else executor

    paragraphs, pairs = text_pairs(seed, max_paragraphs)
    _, held = held_out_split(len(pairs), seed)
    # Training paragraphs: every prose paragraph but the held-out ones, long enough for two crops.
    held_text = {f"{pairs[i][0]} {pairs[i][1]}" for i in held}
    pool = [p.split() for p in paragraphs if p not in held_text and len(p.split()) >= 2 * QUERY_WORDS[0]]
    per_step = max(1, min(segments // 2, len(pool)))

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
        # Cut at the row's width here, as the served model would (the same bytes), so that the evaluation
        # does not warn about a cut the demo chose.
        room = columns - len(prefix(Modality.Text, None))
        queries = [pairs[i][0].encode()[:room] for i in held]
        documents = [pairs[i][1].encode()[:room] for i in held]
        relevant = list(range(len(held)))

        def evaluate(model: Model) -> dict[str, float]:
            return evaluate_retrieval(model, queries, documents, relevant)

        live = Model.from_trainer(trainer, segments=2 * per_step)

        out.write(
            f"uform demo: {len(pool)} training paragraphs, {len(held)} held-out pairs, {depth} x {hidden} tower, "
            f"{steps} steps of {per_step} pairs on {executor}\n"
        )
        before = evaluate(live)
        out.write(_line("before training", before) + "\n")
        out.flush()

        # Item 2k is pair k's query crop, item 2k + 1 its document crop.
        def crops(i: int, rng: np.random.Generator) -> tuple[list[Modality], list[Any]]:
            query = _crop(pool[i], QUERY_WORDS, rng).encode()[:room]
            return [Modality.Text, Modality.Text], [query, _crop(pool[i], DOCUMENT_WORDS, rng).encode()[:room]]

        rng = np.random.default_rng([seed, 0xBA7C])
        train_pairs(
            trainer,
            executor,
            steps=steps,
            per_step=per_step,
            count=len(pool),
            pair=crops,
            rng=rng,
            out=out,
            progress=progress,
            what="crops",
        )
        after = evaluate(live)
        out.write(_line("after training ", after) + "\n")
        out.flush()
        if checkpoint is None:
            return {"before": before, "after": after}
        trainer.save(checkpoint)
    finally:
        trainer.close()
    with load(checkpoint, executor) as served:
        loaded = evaluate(served)
    out.write(_line(f"loaded {os.fsdecode(checkpoint)}", loaded) + "\n")
    out.flush()
    return {"before": before, "after": after, "loaded": loaded}
