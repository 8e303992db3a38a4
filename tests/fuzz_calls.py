"""The fuzz campaign's step calls and its model of the rules (issue 10: "random and property-based step calls
checked against a model of the rules, state compared with a twin after each rejection").

`draw_call` builds one step call from a `Source` of choices, valid or not field by field (wrong types,
integers out of range up to and past 2^63, negatives, wrong lengths, lone surrogates, broken relations and
tapes, bad sides, choices and scalars). `violations` is the model: written from the documented rules alone
(docstrings of `TrainerStepConfig`, `Relations`, `parse_choices`), never calling the checks it judges, it
answers the fields a call breaks; none means the trainer must step. `Campaign` runs calls against a trainer
and its twin (which takes only the accepted calls) and tallies what it saw. tests/test_fuzz.py runs it
through Hypothesis and a seeded random source at CI size; bench/fuzz.py runs the large campaign.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from conftest import snapshot

from uform import (
    Arena,
    BatchShape,
    Choices,
    Contrastive,
    Edges,
    LateInteraction,
    LateInteractionSide,
    Modality,
    Objective,
    Relations,
    Scalar,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    TrainerStepStats,
)

SEGMENTS, MAX_CHOICES, GROUPS = 8, 4, 3
MAX_EDGES = SEGMENTS  # contrastive.max_edges_per_device left to derive
BAG_LIMIT = 2**32

FIELDS = ("config", "modalities", "contents", *(f.name for f in dataclasses.fields(TrainerStepConfig)))
"""Every name a refusal may give as its field."""


def fuzz_run(seed: int = 11) -> TrainerInitVramConfig:
    """A tiny run that reads every argument of a step: Joint (relations), late interaction (sides), choices,
    three temperature groups; a long schedule, so no call runs past it."""
    return TrainerInitVramConfig(
        depth=1,
        hidden=128,
        objective=Objective.Joint,
        batch=BatchShape(
            max_rows_per_device=2,
            max_segments_per_device=SEGMENTS,
            max_columns_per_row=64,
            max_choices_per_item=MAX_CHOICES,
        ),
        contrastive=Contrastive(temperature_groups=GROUPS),
        late_interaction=LateInteraction(weight=0.5, width=32),
        choices=Choices(weight=0.5),
        schedule=Schedule(steps=1_000_000, warmup_steps=10, learning_rate=1e-3),
        seed=seed,
    )


# --------------------------------------------------------------------------------------------------
# Sources of choices: Hypothesis's `data.draw` or a seeded `random.Random`


class Source(Protocol):
    def integer(self, low: int, high: int) -> int:
        """An int in [low, high]."""
        ...

    def pick(self, options: Sequence[Any]) -> Any: ...


def chance(source: Source, p: float) -> bool:
    return source.integer(0, 999) < round(p * 1000)


class RandomSource:
    """Choices from a seeded `random.Random`."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.random.randint(low, high)

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.random.randrange(len(options))]


class HypothesisSource:
    """Choices from Hypothesis (`st.data()`), so that its search and shrinking apply."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def integer(self, low: int, high: int) -> int:
        return int(self.data.draw(self.st.integers(low, high)))

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.integer(0, len(options) - 1)]


# --------------------------------------------------------------------------------------------------
# Drawing a call

BAD_INTEGERS = [-1, -(2**63) - 1, 2**63, 2**64, 2**63 - 1, 1.0, 0.5, True, "0", None, np.float64(1.0)]
WORDS = ["text", "Text", " TEXT ", Modality.Text, 0, np.int64(0)]
BAD_WORDS = ["image", "video", "audio", Modality.Image, 1, 3, "banana", "", True, 3.5, None, np.bool_(False), 7, -1]
SIDES = [*LateInteractionSide, "query", "document", "none", "QueryAndDocument", 0, 1, 2, 3]
BAD_SIDES = ["sideways", 7, -1, True, 1.5, None, Modality.Text, "\ud800"]
SCALARS = [*Scalar, "f32", "BF16", "i8", 0, 3]
BAD_SCALARS = ["f64", 9, True, 1.5, None, "\udcff"]
TEXTS = ["a small cat sleeps", "the red bus stops", "", "ünïcödé ☃", "x" * 90, "rain on a window"]
BAD_ITEMS = ["half \ud800 a pair", "\udfff", 5, None, 1.5, ["a"], np.zeros((2, 2), np.uint8), np.zeros(3, np.float32)]
WEIGHTS = [0.0, 0.5, 1.0, 2.0, 3.5]
BAD_WEIGHTS = [-1.0, math.nan, math.inf, 1e39, True, "1"]


@dataclass
class Call:
    """One step call: the receiver's verb and its three arguments."""

    verb: str
    modalities: Any
    contents: Any
    config: Any
    count: int
    """The number of items the call was drawn for (len(modalities) when it is valid)."""


def _mutate(source: Source, values: list[Any], bad: Sequence[Any]) -> Any:
    """`values` broken one way: an element replaced by a bad one, one too many or too few, or no sequence."""
    how = source.integer(0, 5)
    if how <= 2 and values:
        out = list(values)
        out[source.integer(0, len(out) - 1)] = source.pick(bad)
        return out
    if how == 3:
        return [*values, values[0] if values else 0]
    if how == 4 and values:
        return values[:-1]
    shape = source.integer(0, 5)
    if shape == 4:
        try:
            return np.array([values, values])  # two dimensions
        except ValueError:  # ragged (items of several lengths): numpy refuses to build it
            shape = 0
    return [5, "ab", {0, 1}, (v for v in values), None, 2.5][shape]


def _sequence(source: Source, values: list[Any]) -> Any:
    """`values` as a list, a tuple or (integers only) a numpy array."""
    form = source.integer(0, 2)
    if form == 2 and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in values):
        return np.array(values, dtype=source.pick([np.int64, np.int32, np.uint32]))
    return tuple(values) if form == 1 else list(values)


def _per_item(source: Source, n: int, good: Sequence[Any], bad: Sequence[Any], p_bad: float) -> Any:
    if chance(source, 0.3):
        return source.pick([(), None, []])
    values = [source.pick(good) for _ in range(n)]
    return _mutate(source, values, bad) if chance(source, p_bad) else _sequence(source, values)


def _contents(source: Source, n: int, p_bad: float) -> Any:
    items: list[Any] = []
    for _ in range(n):
        text = source.pick(TEXTS)
        raw = text.encode()
        forms = [text, raw, bytearray(raw), np.frombuffer(raw, np.uint8), memoryview(raw), memoryview(raw * 2)[::2]]
        items.append(forms[source.integer(0, len(forms) - 1)])
    if chance(source, 0.2):  # the tape form
        data = np.frombuffer(
            b"".join(bytes(memoryview(i)) if not isinstance(i, str) else i.encode() for i in items), np.uint8
        )
        sizes = [len(i.encode()) if isinstance(i, str) else len(i) for i in items]
        offsets = np.cumsum([0, *sizes]).astype(source.pick([np.int64, np.uint64, np.int32]))
        if chance(source, p_bad):
            how = source.integer(0, 4)
            if how == 0 and n > 1:
                offsets = offsets[[0, 2, 1, *range(3, n + 1)]] if n > 2 else offsets[::-1].copy()
            elif how == 1:
                offsets = offsets + 1
            elif how == 2:
                data = data.astype(np.int32)
            elif how == 3:
                offsets = offsets.astype(np.float64)
            else:
                offsets = offsets[:-1]
        return (data, offsets)
    if chance(source, p_bad):
        return _mutate(source, items, BAD_ITEMS) if chance(source, 0.8) else source.pick(["text", b"bytes", 5, None])
    return _sequence(source, items)


def _choices(source: Source, n: int, p_bad: float) -> tuple[Any, Any]:
    if chance(source, 0.4):
        return source.pick([((), ()), (None, None), ([], [])])
    legal, targets = [], []
    for _ in range(n):
        k = source.integer(0, MAX_CHOICES)
        legal.append(bytes(random.Random(source.integer(0, 2**30)).sample(range(256), k)))
        weights = [source.integer(1, 9) for _ in range(k)]
        targets.append([w / sum(weights) for w in weights])
    if chance(source, p_bad):
        i = source.integer(0, n - 1)
        how = source.integer(0, 9)
        if how == 0:
            legal[i] = bytes(range(10, 11 + MAX_CHOICES))  # one too many
            targets[i] = [1.0 / (MAX_CHOICES + 1)] * (MAX_CHOICES + 1)
        elif how == 1:
            legal[i], targets[i] = b"aa", [0.5, 0.5]  # a byte twice
        elif how == 2:
            targets[i] = [*targets[i], 0.0]  # one target too many
        elif how == 3:
            legal[i], targets[i] = b"ab", [0.25, 0.25]  # not summing to one
        elif how == 4:
            legal[i], targets[i] = b"ab", source.pick([[-0.5, 1.5], [math.nan, 1.0], [math.inf, 0.0], [10**400, 0]])
        elif how == 5:
            return ((), ()), targets  # targets without choices
        elif how == 6:
            return legal, ((), ())  # choices without targets
        elif how == 7:
            legal[i] = source.pick([7, "\ud800", 1.5, None])
        elif how == 8:
            return legal[:-1] or [b"a"] * 2, targets
        else:
            return source.pick([5, "ab"]), targets
        return legal, targets
    if chance(source, 0.3):  # the tape form
        data = np.frombuffer(b"".join(legal), np.uint8)
        offsets = np.cumsum([0] + [len(x) for x in legal]).astype(source.pick([np.int64, np.uint64]))
        values = np.array([t for ts in targets for t in ts], np.float32)
        if chance(source, p_bad) and n > 2 and offsets[1] < offsets[2]:  # falling offsets, wrapped by uint64
            offsets = offsets[[0, 2, 1, *range(3, n + 1)]]
        return (data, offsets), (values, offsets.copy())
    return _sequence(source, legal), [source.pick([list, tuple, np.array])(t) for t in targets]


def _edges(source: Source, n: int, budget: int) -> Edges:
    """A valid edge set of at most `budget` edges: each item's run ascending, no self pairs."""
    runs: list[list[int]] = []
    for i in range(n):
        others = [j for j in range(n) if j != i]
        take = min(source.integer(0, 2), len(others), budget)
        budget -= take
        runs.append(sorted(random.Random(source.integer(0, 2**30)).sample(others, take)))
    offsets = np.cumsum([0] + [len(r) for r in runs]).tolist()
    ids = [j for r in runs for j in r]
    weights = [source.pick(WEIGHTS) for _ in ids] if chance(source, 0.5) else []
    if not ids and chance(source, 0.5):
        return Edges()
    return Edges(offsets=_sequence(source, offsets), ids=_sequence(source, ids), weights=weights)


def _relations(source: Source, n: int, p_bad: float) -> Any:
    if chance(source, 0.25):
        return None
    sets = {name: _edges(source, n, source.integer(0, MAX_EDGES)) for name in ("attract", "repel", "ignore")}
    if chance(source, p_bad):
        name = source.pick(["attract", "repel"])
        e = sets[name]
        offsets, ids, weights = [int(v) for v in e.offsets], [int(v) for v in e.ids], list(e.weights)
        how = source.integer(0, 12)
        if how == 0:
            offsets = offsets[:-1] if offsets else [0]
        elif how == 1:
            offsets = [1, *offsets[1:]] if offsets else [1] * (n + 1)
        elif how == 2 and ids:
            offsets[-1] += 1
        elif how == 3:
            ids, offsets, weights = [n], [0, 1] + [1] * (n - 1), []  # an id past the items
        elif how == 4:
            ids, offsets, weights = [-1], [0, 1] + [1] * (n - 1), []
        elif how == 5:
            ids, offsets, weights = [0], [0, 1] + [1] * (n - 1), []  # item 0 links to itself
        elif how == 6 and n >= 3:
            ids, offsets, weights = [2, 1], [0, 2] + [2] * (n - 1), []  # not ascending
        elif how == 7 and n * (n - 1) > MAX_EDGES:
            pairs = [(i, j) for i in range(n) for j in range(n) if i != j][: MAX_EDGES + 1]
            offsets = np.cumsum([0] + [sum(1 for a, _ in pairs if a == i) for i in range(n)]).tolist()
            ids, weights = [j for _, j in pairs], []
        elif how == 8 and ids:
            weights = [1.0] * (len(ids) + 1)
        elif how == 9 and ids:
            weights = [1.0] * len(ids)
            weights[0] = source.pick(BAD_WEIGHTS)
        elif how == 10 and ids:
            ids = source.pick([[float(j) for j in ids], [source.pick([2**63, 2**64, 2**70, -(2**63) - 1])] * len(ids)])
        elif how == 11:
            return source.pick([{"attract": Edges()}, "relations", 5])
        else:
            sets[name] = source.pick([[0, 1], None, "edges"])  # type: ignore[assignment]
            return Relations(**sets)
        sets[name] = Edges(offsets=offsets, ids=ids, weights=weights)
    return Relations(**sets)


def draw_call(source: Source, p_bad: float = 0.08) -> Call:
    """One step call over 1 to 10 items (8 fit): each field broken with chance `p_bad`."""
    n = source.integer(1, 10)
    modalities: Any = [source.pick(WORDS) for _ in range(n)]
    if chance(source, p_bad):
        modalities = (
            source.pick([[], "text", 5, None]) if chance(source, 0.3) else _mutate(source, modalities, BAD_WORDS)
        )
    else:
        modalities = _sequence(source, modalities)
    contents = _contents(source, n, p_bad)
    choices, targets = _choices(source, n, p_bad)
    config = TrainerStepConfig(
        bags=_per_item(source, n, range(0, 4), [*BAD_INTEGERS, BAG_LIMIT], p_bad),
        temperature_groups=_per_item(source, n, range(GROUPS), [*BAD_INTEGERS, GROUPS], p_bad),
        sides=_per_item(source, n, SIDES, BAD_SIDES, p_bad),
        choices=choices,
        choice_targets=targets,
        relations=_relations(source, n, p_bad),
        arena=source.pick([None, Arena()]) if not chance(source, p_bad) else source.pick(["arena", 5]),
        outputs_scalar=source.pick(SCALARS) if not chance(source, p_bad) else source.pick(BAD_SCALARS),
        stats=source.pick([None, TrainerStepStats()]) if not chance(source, p_bad) else source.pick([{}, 5]),
    )
    step_config: Any = config
    if chance(source, p_bad / 3):
        step_config = source.pick([dataclasses.asdict(TrainerStepConfig()), 5, "config"])
    elif chance(source, 0.05):
        step_config = None
    return Call(source.pick(["on", "deferred"]), modalities, contents, step_config, n)


# --------------------------------------------------------------------------------------------------
# The model: which fields a call breaks, from the documented rules


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _listed(value: Any) -> list[Any] | bool | None:
    """A per-item sequence's values; None when absent or empty; False when it is no flat sequence."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return False if value.ndim != 1 else (value.tolist() or None)
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        return False
    return list(value) or None


def _finite(x: Any) -> bool:
    """A real number that float64 holds, finite (a Python int past its range is not)."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _unicode(text: str) -> bool:
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _word_ok(value: Any, kind: type[enum.Enum], words: set[str], numbers: range) -> bool:
    """An enum field: its own member, one of its words (any case, spaces around), or an integer value
    (Python or numpy); never a bool or another enum's member."""
    if isinstance(value, kind):
        return True
    if isinstance(value, enum.Enum):
        return False
    if isinstance(value, str):
        return value.strip().lower() in words
    return _is_int(value) and int(value) in numbers


def _modality_ok(m: Any) -> bool:
    return _word_ok(m, Modality, {"text"}, range(1)) and not (isinstance(m, Modality) and m != Modality.Text)


def _side_ok(s: Any) -> bool:
    return _word_ok(s, LateInteractionSide, {"none", "query", "document", "queryanddocument"}, range(4))


def _scalar_ok(s: Any) -> bool:
    return _word_ok(s, Scalar, {"f32", "f16", "bf16", "i8"}, range(4))


def _item_ok(c: Any) -> bool:
    if isinstance(c, str):
        return _unicode(c)
    if isinstance(c, np.ndarray):
        return c.ndim == 1 and c.dtype == np.uint8
    return isinstance(c, (bytes, bytearray, memoryview))


def _tape_ok(data: np.ndarray, offsets: np.ndarray, items: int | None) -> bool:
    if data.ndim != 1 or data.dtype != np.uint8 or offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        return False
    if len(offsets) == 0 or offsets[0] != 0 or np.any(offsets[1:] < offsets[:-1]):
        return False
    return int(offsets[-1]) == len(data) and (items is None or len(offsets) == items + 1)


def _integers_ok(value: Any, n: int, below: int) -> bool:
    listed = _listed(value)
    if listed is None:
        return True
    if listed is False:
        return False
    return len(listed) == n and all(_is_int(v) and 0 <= int(v) < below for v in listed)


def _choices_empty(value: Any) -> bool:
    if value is None or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 0):
        return True
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, (Sequence, np.ndarray)) and len(v) == 0 for v in value)
    )


def _choices_broken(choices: Any, targets: Any, n: int) -> set[str]:
    if _choices_empty(choices):
        return set() if _choices_empty(targets) else {"choice_targets"}
    if _choices_empty(targets):
        return {"choice_targets"}
    if isinstance(choices, tuple) and len(choices) == 2 and all(isinstance(v, np.ndarray) for v in choices):
        if not _tape_ok(choices[0], choices[1], n):
            return {"choices"}
        data, offsets = choices
        legal = [bytes(data[offsets[i] : offsets[i + 1]]) for i in range(n)]
    else:
        if not isinstance(choices, (list, tuple)) or len(choices) != n:
            return {"choices"}
        legal = []
        for c in choices:
            if isinstance(c, str) and _unicode(c):
                c = c.encode()
            if not isinstance(c, (bytes, bytearray)):
                return {"choices"}
            legal.append(bytes(c))
    if any(len(x) > MAX_CHOICES or len(set(x)) != len(x) for x in legal):
        return {"choices"}
    if isinstance(targets, tuple) and len(targets) == 2 and all(isinstance(v, np.ndarray) for v in targets):
        values, offsets = targets
        if values.ndim != 1 or offsets.ndim != 1 or len(offsets) != n + 1 or int(offsets[-1]) != len(values):
            return {"choice_targets"}
        per_item = [list(values[offsets[i] : offsets[i + 1]]) for i in range(n)]
    else:
        if not isinstance(targets, (list, tuple)) or len(targets) != n:
            return {"choice_targets"}
        per_item = [list(t) for t in targets]
    for x, ts in zip(legal, per_item, strict=True):
        if len(ts) != len(x) or not all(isinstance(t, (float, int, np.floating)) for t in ts):
            return {"choice_targets"}
        if ts and (not all(_finite(t) and t >= 0 for t in ts) or abs(sum(ts) - 1) > 1e-3):
            return {"choice_targets"}
    return set()


def _edges_ok(e: Any, n: int, weighted: bool) -> bool:
    if not isinstance(e, Edges):
        return False
    parts = []
    for name in ("offsets", "ids", *(("weights",) if weighted else ())):
        v = getattr(e, name)
        if not isinstance(v, (list, tuple, np.ndarray)) or any(isinstance(x, (bool, str)) for x in list(v)):
            return False
        parts.append(list(v))
    offsets, ids = parts[0], parts[1]
    if not all(_is_int(x) for x in offsets + ids):
        return False
    if not offsets:
        if ids:
            return False
    elif (
        len(offsets) != n + 1
        or offsets[0] != 0
        or offsets[-1] != len(ids)
        or any(b < a for a, b in itertools.pairwise(offsets))
    ):
        return False
    if len(ids) > MAX_EDGES or any(not 0 <= j < n for j in ids):
        return False
    for i in range(n if offsets else 0):
        run = ids[offsets[i] : offsets[i + 1]]
        if i in run or any(b <= a for a, b in itertools.pairwise(run)):
            return False
    if weighted:
        weights = parts[2]
        if len(weights) not in (0, len(ids)):
            return False
        if not all(_finite(w) and 0 <= w <= 3.4e38 for w in weights):
            return False
    return True


def violations(call: Call) -> set[str]:
    """The fields `call` breaks, by the documented rules (an empty set: the trainer must take the step)."""
    config = TrainerStepConfig() if call.config is None else call.config
    if not isinstance(config, TrainerStepConfig):
        return {"config"}
    broken: set[str] = set()
    mods = call.modalities
    if isinstance(mods, (str, bytes)) or not isinstance(mods, (Sequence, np.ndarray)):
        return {"modalities"}  # without a count nothing else can be judged
    if len(mods) == 0 or not all(_modality_ok(m) for m in mods):
        broken.add("modalities")
    n = len(mods)
    contents = call.contents
    if isinstance(contents, tuple) and len(contents) == 2 and all(isinstance(v, np.ndarray) for v in contents):
        if not _tape_ok(contents[0], contents[1], n):
            broken.add("contents")
    elif (
        isinstance(contents, (str, bytes, bytearray, memoryview))
        or not isinstance(contents, Sequence)
        or len(contents) != n
        or not all(_item_ok(c) for c in contents)
    ):
        broken.add("contents")
    if not _integers_ok(config.bags, n, BAG_LIMIT):
        broken.add("bags")
    if not _integers_ok(config.temperature_groups, n, GROUPS):
        broken.add("temperature_groups")
    sides = _listed(config.sides)
    if sides is False or (sides and (len(sides) != n or not all(_side_ok(s) for s in sides))):
        broken.add("sides")
    broken |= _choices_broken(config.choices, config.choice_targets, n)
    relations = config.relations
    if relations is not None and (
        not isinstance(relations, Relations)
        or not all(_edges_ok(getattr(relations, s), n, s != "ignore") for s in ("attract", "repel", "ignore"))
    ):
        broken.add("relations")
    if config.arena is not None and not isinstance(config.arena, Arena):
        broken.add("arena")
    if config.stats is not None and not isinstance(config.stats, TrainerStepStats):
        broken.add("stats")
    if not _scalar_ok(config.outputs_scalar):
        broken.add("outputs_scalar")
    return broken


# --------------------------------------------------------------------------------------------------
# Running calls against a trainer and its twin


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _named(message: str) -> bool:
    return any(message.startswith(f) or f"{f}:" in message or f"{f}[" in message or f"{f}." in message for f in FIELDS)


@dataclass
class Campaign:
    """A trainer and its twin; `run(call)` applies a call to the trainer, and to the twin when it was
    accepted, and records the outcome. `problems` lists every disagreement with the model or the twin."""

    trainer: Trainer
    twin: Trainer
    tally: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    unnamed: list[str] = field(default_factory=list)

    def run(self, call: Call) -> None:
        expected = violations(call)
        before = self.trainer.steps_taken
        try:
            answer = getattr(self.trainer, call.verb)(self.trainer.executor).step(
                call.modalities, call.contents, call.config
            )
            if isinstance(answer, Future):
                answer.result(timeout=120)
        except (ValueError, TypeError) as error:
            self._refused(call, expected, error, before)
            return
        except Exception as error:  # any other exception is a finding, tallied
            self.tally["refused with another error"] += 1
            self.problems.append(f"{type(error).__name__}: {error} (expected {sorted(expected) or 'a step'})")
            self._refused(call, expected, error, before, counted=False)
            return
        self.tally["accepted"] += 1
        if expected:
            self.problems.append(f"accepted a call that breaks {sorted(expected)}: {call!r:.300}")
        twin_answer = self.twin.on(self.twin.executor).step(call.modalities, call.contents, call.config)
        del twin_answer
        if self.trainer.steps_taken != before + 1 or not _same(snapshot(self.trainer), snapshot(self.twin)):
            self.problems.append(f"an accepted step left the trainer unlike its twin: {call!r:.300}")

    def _refused(self, call: Call, expected: set[str], error: BaseException, before: int, counted: bool = True) -> None:
        message = str(error)
        if counted:
            self.tally["refused"] += 1
        if not _named(message):
            self.unnamed.append(f"{type(error).__name__}: {message}")
        if not expected:
            self.problems.append(f"refused a valid call: {type(error).__name__}: {message} ({call!r:.300})")
        elif not any(f in message for f in expected):
            self.problems.append(f"the refusal names none of {sorted(expected)}: {type(error).__name__}: {message}")
        if self.trainer.steps_taken != before or not _same(snapshot(self.trainer), snapshot(self.twin)):
            self.problems.append(f"a refusal changed the trainer: {type(error).__name__}: {message}")
