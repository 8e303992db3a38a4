"""`uform.relations`: the check of a step's edge sets and their resolution into pair targets."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from uform.enums import Negatives
from uform.relations import Edges, Relations, check_relations, pair_targets

COUNT = 4
MAX_EDGES = 16


def _valid() -> Relations:
    """A valid relations over four items, exercising every set."""
    return Relations(
        attract=Edges(offsets=[0, 1, 2, 3, 4], ids=[1, 0, 3, 2], weights=[1.0, 0.5, 2.0, 0.0]),
        repel=Edges(offsets=[0, 2, 2, 3, 3], ids=[2, 3, 1]),
        ignore=Edges(offsets=[0, 0, 1, 1, 1], ids=[3], weights=[float("nan")]),
    )


def _with(set_name: str, **fields: object) -> Relations:
    relations = _valid()
    setattr(relations, set_name, Edges(**{**vars(getattr(relations, set_name)), **fields}))
    return relations


def _snapshot(relations: object) -> object:
    """A deep copy to compare against; numpy arrays are compared by value and by identity below."""
    return copy.deepcopy(relations)


def _assert_same(before: Relations, after: Relations) -> None:
    for set_name in ("attract", "repel", "ignore"):
        old, new = getattr(before, set_name), getattr(after, set_name)
        for name in ("offsets", "ids", "weights"):
            a, b = getattr(old, name), getattr(new, name)
            assert type(a) is type(b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            if isinstance(b, np.ndarray):
                assert a.dtype == b.dtype


def test_valid_relations_pass_and_stay_unchanged() -> None:
    relations = _valid()
    before = _snapshot(relations)
    check_relations(relations, COUNT, MAX_EDGES)
    check_relations(None, COUNT, MAX_EDGES)
    check_relations(Relations(), COUNT, MAX_EDGES)
    _assert_same(before, relations)


def test_numpy_and_tuple_inputs_are_accepted() -> None:
    relations = Relations(
        attract=Edges(
            offsets=np.array([0, 1, 2, 3, 4], dtype=np.uint32),
            ids=np.array([1, 0, 3, 2], dtype=np.uint32),
            weights=np.array([1, 2, 3, 4], dtype=np.float32),
        ),
        repel=Edges(offsets=(0, 1, 1, 1, 1), ids=(3,), weights=(2,)),
        ignore=Edges(offsets=range(5), ids=np.array([2, 3, 0, 1])),
    )
    before = _snapshot(relations)
    check_relations(relations, COUNT, MAX_EDGES)
    _assert_same(before, relations)
    # Runs restart their ordering: ascending within a run, whatever the previous run ended at.
    check_relations(Relations(attract=Edges(offsets=[0, 2, 3, 3, 3], ids=[2, 3, 0])), COUNT, MAX_EDGES)
    # Empty numpy arrays are empty, whatever their dtype.
    check_relations(Relations(attract=Edges(offsets=np.array([]), ids=np.array([]))), COUNT, MAX_EDGES)


BROKEN = [
    # (set, fields, the field the message names, a word of the rule)
    ("attract", {"offsets": [0, 1, 2, 4]}, "relations.attract.offsets", "count plus one"),
    ("repel", {"offsets": [1, 2, 2, 3, 3]}, "relations.repel.offsets", "start at 0"),
    ("ignore", {"offsets": [0, 1, 0, 1, 1]}, "relations.ignore.offsets", "non-decreasing"),
    ("attract", {"offsets": [0, 1, 2, 3, 3]}, "relations.attract.offsets", "end at"),
    ("repel", {"offsets": [0, 2, -1, 3, 3]}, "relations.repel.offsets", "negative"),
    ("attract", {"offsets": [], "weights": []}, "relations.attract.offsets", "empty offsets"),
    ("attract", {"ids": [1, 0, 4, 2]}, "relations.attract.ids", "items"),
    ("repel", {"ids": [2, -3, 1]}, "relations.repel.ids", "negative"),
    ("repel", {"ids": [3, 2, 1]}, "relations.repel.ids", "ascending"),
    ("repel", {"ids": [2, 2, 1]}, "relations.repel.ids", "ascending"),
    ("ignore", {"offsets": [0, 0, 2, 2, 2], "ids": [3, 3]}, "relations.ignore.ids", "ascending"),
    ("attract", {"ids": [1, 1, 3, 2]}, "relations.attract.ids", "itself"),
    ("ignore", {"offsets": [0, 1, 1, 1, 1], "ids": [0]}, "relations.ignore.ids", "itself"),
    ("attract", {"weights": [1.0, 2.0]}, "relations.attract.weights", "as long as ids"),
    ("repel", {"weights": [1.0, float("nan"), 1.0]}, "relations.repel.weights", "finite"),
    ("repel", {"weights": [1.0, float("inf"), 1.0]}, "relations.repel.weights", "finite"),
    ("attract", {"weights": np.array([1.0, -0.5, 1.0, 1.0])}, "relations.attract.weights", "negative"),
]


@pytest.mark.parametrize(("set_name", "fields", "field", "rule"), BROKEN)
def test_each_rule_names_its_field(set_name: str, fields: dict, field: str, rule: str) -> None:
    relations = _with(set_name, **fields)
    before = _snapshot(relations)
    with pytest.raises(ValueError, match=re.escape(field)) as caught:
        check_relations(relations, COUNT, MAX_EDGES)
    assert str(caught.value).startswith(field + ":")
    assert rule in str(caught.value)
    _assert_same(before, relations)


def test_too_many_edges_names_max_edges_per_device() -> None:
    relations = _valid()
    before = _snapshot(relations)
    with pytest.raises(ValueError, match=r"relations\.attract\.ids: .*max_edges_per_device"):
        check_relations(relations, COUNT, 3)
    check_relations(relations, COUNT, 4)
    _assert_same(before, relations)


WRONG_TYPES = [
    ("attract", {"ids": [1.0, 0.0, 3.0, 2.0]}, "relations.attract.ids"),
    ("attract", {"ids": np.array([1.0, 0.0, 3.0, 2.0])}, "relations.attract.ids"),
    ("repel", {"offsets": [0, 2, 2, 3, 3.5]}, "relations.repel.offsets"),
    ("repel", {"ids": [True, 3, 1]}, "relations.repel.ids"),
    ("repel", {"ids": "231"}, "relations.repel.ids"),
    ("repel", {"ids": {2, 3, 1}}, "relations.repel.ids"),
    ("attract", {"weights": ["1", "1", "1", "1"]}, "relations.attract.weights"),
    ("attract", {"offsets": np.zeros((5, 1), dtype=np.int64)}, "relations.attract.offsets"),
]


@pytest.mark.parametrize(("set_name", "fields", "field"), WRONG_TYPES)
def test_wrong_types_raise_type_error(set_name: str, fields: dict, field: str) -> None:
    relations = _with(set_name, **fields)
    before = _snapshot(relations)
    with pytest.raises(TypeError, match=re.escape(field)):
        check_relations(relations, COUNT, MAX_EDGES)
    _assert_same(before, relations)


def test_wrong_struct_types() -> None:
    with pytest.raises(TypeError, match="relations:"):
        check_relations({"attract": Edges()}, COUNT, MAX_EDGES)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"relations\.ignore:"):
        check_relations(Relations(ignore=[0, 1]), COUNT, MAX_EDGES)  # type: ignore[arg-type]


def test_ignore_weights_are_not_read() -> None:
    relations = _with("ignore", weights=["anything", None])
    check_relations(relations, COUNT, MAX_EDGES)
    z, w = pair_targets(relations, COUNT, Negatives.Ambient, 1.0)
    assert z[1, 3] == 0 and w[1, 3] == 0


# --------------------------------------------------------------------------------------------------
# pair_targets against a double loop


def _random_edges(rng: np.random.Generator, count: int, density: float, weighted: bool) -> Edges:
    offsets, ids, weights = [0], [], []
    for i in range(count):
        run = [j for j in range(count) if j != i and rng.random() < density]
        ids.extend(run)
        weights.extend(float(rng.choice([0.0, 0.25, 1.0, 3.5])) for _ in run)
        offsets.append(len(ids))
    if rng.random() < 0.2:
        return Edges()
    return Edges(offsets=offsets, ids=ids, weights=weights if weighted else [])


def _naive(relations: Relations, count: int, negatives: Negatives, ambient: float) -> tuple[np.ndarray, np.ndarray]:
    def lookup(edges: Edges, i: int, j: int) -> float | None:
        if not len(edges.offsets):
            return None
        for k in range(edges.offsets[i], edges.offsets[i + 1]):
            if edges.ids[k] == j:
                return float(edges.weights[k]) if len(edges.weights) else 1.0
        return None

    z = np.zeros((count, count), dtype=np.int8)
    w = np.zeros((count, count), dtype=np.float32)
    for i in range(count):
        for j in range(count):
            if i == j or lookup(relations.ignore, i, j) is not None:
                continue
            if (weight := lookup(relations.attract, i, j)) is not None:
                sign = 1
            elif (weight := lookup(relations.repel, i, j)) is not None:
                sign = -1
            elif negatives == Negatives.Ambient:
                sign, weight = -1, ambient
            else:
                continue
            if weight != 0:
                z[i, j], w[i, j] = sign, weight
    return z, w


@pytest.mark.parametrize("negatives", [Negatives.Ambient, Negatives.Named])
@pytest.mark.parametrize("seed", range(6))
def test_pair_targets_match_double_loop(negatives: Negatives, seed: int) -> None:
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 12))
    relations = Relations(
        attract=_random_edges(rng, count, 0.3, weighted=True),
        repel=_random_edges(rng, count, 0.4, weighted=bool(seed % 2)),
        ignore=_random_edges(rng, count, 0.2, weighted=False),
    )
    check_relations(relations, count, count * count)
    before = _snapshot(relations)
    z, w = pair_targets(relations, count, negatives, 0.75)
    expected_z, expected_w = _naive(relations, count, negatives, 0.75)
    assert z.dtype == np.int8 and w.dtype == np.float32
    assert z.shape == w.shape == (count, count)
    np.testing.assert_array_equal(z, expected_z)
    np.testing.assert_array_equal(w, expected_w)
    assert ((z == 0) == (w == 0)).all()
    _assert_same(before, relations)


def test_pair_targets_without_relations() -> None:
    z, w = pair_targets(None, 3, Negatives.Ambient, 2.0)
    np.testing.assert_array_equal(z, np.eye(3) - 1)
    np.testing.assert_array_equal(w, 2.0 * (1 - np.eye(3)))
    z, w = pair_targets(Relations(), 3, Negatives.Named, 2.0)
    assert not z.any() and not w.any()
    z, w = pair_targets(None, 0, Negatives.Ambient, 1.0)
    assert z.shape == (0, 0) and w.shape == (0, 0)


def test_pair_targets_precedence_and_direction() -> None:
    relations = Relations(
        attract=Edges(offsets=[0, 2, 2, 2], ids=[1, 2], weights=[2.0, 3.0]),
        repel=Edges(offsets=[0, 2, 2, 2], ids=[1, 2], weights=[5.0, 5.0]),
        ignore=Edges(offsets=[0, 1, 1, 1], ids=[2]),
    )
    z, w = pair_targets(relations, 3, Negatives.Named, 1.0)
    # 0->1: attract beats repel; 0->2: ignore beats both; 1->0 is not named by 0->1.
    assert (z[0, 1], w[0, 1]) == (1, 2.0)
    assert (z[0, 2], w[0, 2]) == (0, 0.0)
    assert (z[1, 0], w[1, 0]) == (0, 0.0)
