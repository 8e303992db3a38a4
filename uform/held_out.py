"""Held-out evaluation during a run: the held-out records read once, then scored with the trainer's current
weights whenever asked (`fit` asks every `eval.every` steps and after the last).

    held = HeldOut.read("held.jsonl", {"jpg": "image", "txt": "text"}, run.trainer, EvalConfig(every=100))
    results = held.evaluate(trainer)  # {"eval/text->image/recall@10": 0.42, ...}
    held.close()

Shape legend: N held-out items, Q queries, M documents, D hidden.

What is scored. The records follow the record convention (`uform.sources`): a record is a bag and its
positives are each other's relevant documents. For every ordered pair of modalities (a, b) the records hold,
each positive item of modality a that has a positive of modality b in its record queries every item of
modality b (its record's positives are relevant; named negatives and other records' items are not; a query
never retrieves itself), by the cosine of pooled embeddings at every width of `eval.widths`, and, where the run
trains late interaction and the fields give sides, each query-side item of modality a queries every
document-side item of modality b by MaxSim. Each answers recall@1/5/10 and MRR, and nDCG@10 where some query
has several relevant documents (`uform.evaluate.ranking_metrics`). Where the run trains choices, each record's
choice is made (`Model.text_choose`) and scored against its targets: the mean KL(q || p) and the accuracy
(the most probable legal byte is the target's). Where the run trains a masked objective, the held-out
records are packed into steps of one device's room (`uform.sources.Loader`) and their masked terms taken
without an update (`Replica.held_out_terms`, the same masks every evaluation).

Names. `eval/<query modality>-><document modality>/<metric>` at the full width (`eval/text->image/recall@10`),
`eval/<a>-><b>@<width>/<metric>` at a narrower Matryoshka width (`eval/text->image@64/mrr`),
`eval/<a>-><b>@maxsim/<metric>` by late interaction, `eval/choices/kl` and `eval/choices/accuracy`,
`eval/loss/<term>` (`eval/loss/masked_text`), and `eval/seconds` the evaluation's wall time.

Where it runs. On a trainer of one device the work is queued on its replica's device thread, after the steps
called before (`Replica.queued`), over a serving model of the live network made once (`Model.from_trainer`).
On a trainer of several devices each device's worker takes a share of the items (sent once, with the model
over its replica made there once: `uform.held_out_fleet`), and only embeddings, token vectors, probabilities
and loss sums come back; metrics are computed here. Media are decoded once, on the first evaluation
(`Model.keep_decoded`). Nothing of the trainer changes: no update, no step counted, no draw of a training step
(every draw is keyed by its step number, and an evaluation takes none), so training after an evaluation is
bitwise what it is without one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .config import TrainerInitVramConfig, resolve
from .enums import LateInteractionSide, Modality, Objective
from .evaluate import ranking_metrics
from .held_out_fleet import FleetWork, LocalWork, Work
from .notices import MediaWarning, Notices
from .run_config import EvalConfig, check_eval
from .sources import Loader, open_source
from .sources.fields import Fields, RecordItems, read_record

__all__ = ["RECALL_AT", "HeldOut"]

RECALL_AT = (1, 5, 10)
"""The ranks recall is scored at; nDCG at the last."""


@dataclass
class _Pair:
    """One ordered pair of modalities' retrieval: query items, document items, each query's relevant
    documents (indices into `documents`) and the document its ranking leaves out (itself; -1: none)."""

    name: str
    queries: list[int]
    documents: list[int]
    relevant: list[list[int]]
    exclude: list[int]


@dataclass
class _Choice:
    item: int
    legal: bytes
    targets: np.ndarray  # [K] float64


@dataclass
class HeldOut:
    """Held-out records read once, and what each evaluation scores of them (see the module's docstring)."""

    config: TrainerInitVramConfig
    """The run's resolved trainer config."""
    eval: EvalConfig
    """The `[eval]` table, checked, its widths filled in."""
    records: list[RecordItems]
    """The records read (at most `eval.records`; those naming a missing file or holding no item left out)."""
    notices: Notices = field(default_factory=Notices)
    """Where the reading's warnings go (a missing file, a record too large for a step): the run's, in `fit`."""
    modalities: list[Modality] = field(default_factory=list)
    """[N] every held-out item's modality, record by record."""
    contents: list[bytes] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    sides: list[LateInteractionSide] | None = None
    """[N] each item's side where the fields give sides (passed to encode as a step passes them)."""
    pooled: list[_Pair] = field(default_factory=list)
    late: list[_Pair] = field(default_factory=list)
    choices: list[_Choice] = field(default_factory=list)
    steps: list[tuple[list[Modality], list[bytes], Any, int]] = field(default_factory=list)
    """Held-out steps for the masked terms: (modalities, contents, TrainerStepConfig, the draws' step key)."""
    _work: Work | None = None
    _trainer: Any = None
    _pooled_items: list[int] = field(default_factory=list)
    _late_at: list[tuple[list[int], list[int]]] = field(default_factory=list)

    # ---- reading -----------------------------------------------------------------------------------

    @classmethod
    def read(
        cls,
        spec: Any,
        fields: Mapping[str, Any] | Fields,
        config: TrainerInitVramConfig,
        eval_config: EvalConfig | None = None,
        *,
        notices: Notices | None = None,
    ) -> HeldOut:
        """The held-out records of `spec` (what `uform.sources.open_source` opens) read by `fields`, at most
        `eval_config.records` of them, for the run `config`; `ValueError` naming `data.held_out` where they
        hold nothing to score."""
        run = resolve(config)
        checked = check_eval(EvalConfig() if eval_config is None else eval_config, run)
        notices = Notices() if notices is None else notices
        raw: list[dict[str, Any]] = []
        records: list[RecordItems] = []
        try:  # every refusal of the readers names the table it came from
            source = open_source(spec, fields=fields)
            for shard in range(len(source.shards)):
                if len(raw) == checked.records:
                    break
                for record in source.records(shard):
                    if len(raw) == checked.records:
                        break
                    items = read_record(record, source.fields)
                    if items.missing is not None:
                        notices.warn(
                            "held_out.missing",
                            f"uform: held-out record {items.id} names a missing file ({items.missing}); such "
                            "records are left out of evaluation and counted",
                            MediaWarning,
                        )
                    elif items.modalities:
                        raw.append(record)
                        records.append(items)
        except (OSError, ValueError, TypeError) as error:
            raise type(error)(f"data.held_out: {error}") from error
        if not records:
            raise ValueError("data.held_out: names no record with an item to evaluate on")
        held = cls(run, checked, records, notices)
        held._plan(source.fields, raw)
        if not (held.pooled or held.late or held.choices or held.steps):
            raise ValueError(
                "data.held_out: no record holds two positives, a choice or (for a masked objective) an item; "
                "nothing would be scored"
            )
        return held

    def _plan(self, fields: Fields, raw: list[dict[str, Any]]) -> None:
        """Which items query which, which choices are made, which steps the masked terms take."""
        record_of = np.array([r for r, items in enumerate(self.records) for _ in items.modalities], dtype=np.int64)
        self.modalities = [m for r in self.records for m in r.modalities]
        self.contents = [c for r in self.records for c in r.contents]
        self.kinds = [k for r in self.records for k in r.kinds]
        self.sides = [s for r in self.records for s in r.sides] if fields.late else None
        present = sorted(set(self.modalities), key=int)
        positive = [k != "negative" for k in self.kinds]
        for a in present:
            for b in present:
                documents = [j for j, m in enumerate(self.modalities) if m == b]
                queries = [i for i, m in enumerate(self.modalities) if m == a and positive[i]]
                self._pair(f"{a}->{b}", record_of, queries, documents, positive, self.pooled)
                if self.config.late_interaction.weight > 0:
                    queries = [i for i, m in enumerate(self.modalities) if m == a and self.kinds[i] == "query"]
                    late_documents = [j for j in documents if self.kinds[j] == "document"]
                    self._pair(f"{a}->{b}@maxsim", record_of, queries, late_documents, positive, self.late)
        if self.config.choices.weight > 0:
            base = 0
            for r in self.records:
                if r.choices:
                    self.choices.append(_Choice(base + r.chooser, r.choices, np.array(r.targets, dtype=np.float64)))
                base += len(r.modalities)
        if self.config.objective != Objective.Contrastive:
            self._steps(fields, raw)

    @staticmethod
    def _pair(
        name: str, record_of: np.ndarray, queries: list[int], documents: list[int], positive: list[bool], out: list
    ) -> None:
        at = {j: n for n, j in enumerate(documents)}
        of_record: dict[int, list[int]] = {}
        for j in documents:
            if positive[j]:
                of_record.setdefault(int(record_of[j]), []).append(j)
        kept, relevant, exclude = [], [], []
        for i in queries:
            mine = [at[j] for j in of_record.get(int(record_of[i]), []) if j != i]
            if mine:
                kept.append(i)
                relevant.append(mine)
                exclude.append(at.get(i, -1))
        if kept:
            out.append(_Pair(name, kept, documents, relevant, exclude))

    def _steps(self, fields: Fields, raw: list[dict[str, Any]]) -> None:
        """One epoch of the held-out records in steps of one device's room, as training fills them."""
        loader = Loader(open_source(raw, fields=fields), self.config, devices=1)
        loader.notices = self.notices
        while loader.state()["shares"]["0"][0] == 0:
            step = loader.next_step()
            if step.modalities:
                self.steps.append((step.modalities, step.contents, step.config, step.step))

    # ---- scoring -----------------------------------------------------------------------------------

    @property
    def items(self) -> int:
        """Held-out items read."""
        return len(self.modalities)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """Every figure of the module's docstring under `trainer`'s current weights (after every step called
        before), by name; the trainer is left as it was. The first call builds what later calls reuse."""
        if (trainer.config.depth, trainer.config.hidden) != (self.config.depth, self.config.hidden):
            raise ValueError("trainer: it trains another network than the run these held-out records were read for")
        started = time.perf_counter()
        work = self._prepare(trainer)
        answers = work.run()
        out: dict[str, float] = {}
        widths = list(self.eval.widths)
        if self.pooled:
            full = answers["pooled"]  # [N', D] L2-normalised, for the items of `self._pooled_items`
            row = {item: n for n, item in enumerate(self._pooled_items)}
            for width in widths:
                cut = F.normalize(full[:, :width], dim=-1) if width < self.config.hidden else full
                suffix = "" if width == self.config.hidden else f"@{width}"
                for pair in self.pooled:
                    q = cut[[row[i] for i in pair.queries]]
                    d = cut[[row[j] for j in pair.documents]]
                    out.update(_named(f"eval/{pair.name}{suffix}", q.double() @ d.double().T, pair))
        for pair, (rows, columns) in zip(self.late, self._late_at, strict=True):
            scores = answers["maxsim"][rows][:, columns]  # [Q, M] of all late queries against all late documents
            out.update(_named(f"eval/{pair.name}", scores, pair))
        if self.choices:
            kl, right = [], []
            for choice, p in zip(self.choices, answers["choose"], strict=True):
                q = choice.targets
                scored = q > 0
                kl.append(float(np.sum(q[scored] * (np.log(q[scored]) - np.log(np.maximum(p[scored], 1e-45))))))
                right.append(int(np.argmax(p)) == int(np.argmax(q)))
            out["eval/choices/kl"] = float(np.mean(kl))
            out["eval/choices/accuracy"] = float(np.mean(right))
        if self.steps:
            sums: dict[str, list[float]] = {}
            for terms in answers["terms"]:  # in step order, whatever device took each step
                for name, (total, count) in terms.items():
                    sums.setdefault(name, [0.0, 0.0])
                    sums[name][0] += total
                    sums[name][1] += count
            for name, (total, count) in sums.items():
                if name.startswith("masked_") and count > 0:
                    out[f"eval/loss/{name}"] = total / count
        out["eval/seconds"] = time.perf_counter() - started
        return out

    def _prepare(self, trainer: Any) -> Work:
        """What runs each evaluation, built on the first (and again for another trainer)."""
        if self._work is not None and self._trainer is trainer:
            return self._work
        self.close()
        used = sorted({i for pair in self.pooled for i in (*pair.queries, *pair.documents)})
        self._pooled_items = used
        late_queries = sorted({i for pair in self.late for i in pair.queries})
        late_documents = sorted({j for pair in self.late for j in pair.documents})
        sides = self.sides
        job = {
            "pooled": (
                [self.modalities[i] for i in used],
                [self.contents[i] for i in used],
                () if sides is None else [sides[i] for i in used],
            ),
            "tokens": [
                ([self.modalities[i] for i in items], [self.contents[i] for i in items], side)
                for items, side in (
                    (late_queries, LateInteractionSide.Query),
                    (late_documents, LateInteractionSide.Document),
                )
            ]
            if self.late
            else [],
            "choose": ([self.contents[c.item] for c in self.choices], [c.legal for c in self.choices]),
            "steps": self.steps,
        }
        q_at = {i: n for n, i in enumerate(late_queries)}
        d_at = {j: n for n, j in enumerate(late_documents)}
        self._late_at = [([q_at[i] for i in p.queries], [d_at[j] for j in p.documents]) for p in self.late]
        segments = self.eval.batch
        self._work = (FleetWork if trainer.executor.has_workers() else LocalWork)(trainer, job, segments)
        self._trainer = trainer
        return self._work

    def close(self) -> None:
        """Lets go of what the evaluations built (the workers' shares and models)."""
        if self._work is not None:
            self._work.close()
        self._work = None
        self._trainer = None


def _named(prefix: str, scores: torch.Tensor, pair: _Pair) -> dict[str, float]:
    graded = any(len(r) > 1 for r in pair.relevant)
    metrics = ranking_metrics(
        scores.float() if scores.dtype != torch.float64 else scores,
        pair.relevant,
        RECALL_AT,
        ndcg=RECALL_AT[-1:] if graded else (),
        exclude=pair.exclude,
    )
    return {f"{prefix}/{name}": value for name, value in metrics.items()}
