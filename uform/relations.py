"""A step's contrastive targets: three edge sets over its items, checked and resolved into pair targets.

`Edges` and `Relations` mirror UForm 4's trainer API's `uform_edges_view_t` / `uform_relations_view_t`. `check_relations`
is the binding's check of a step's relations against its items (raising `ValueError` naming the field, or
`TypeError` for a wrong type, and never changing its input); `pair_targets` resolves them, with the run's
`Negatives`, into the dense per-pair sign and weight matrices the contrastive loss reads (docs/design.md §5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .enums import Negatives


@dataclass(kw_only=True)
class Edges:
    """One edge set over a step's items, as compressed sparse rows; empty offsets name no edges."""

    offsets: Sequence[int] = ()
    """The step's count plus one non-decreasing offsets into ids."""
    ids: Sequence[int] = ()
    """Item i links to items ids[offsets[i]..offsets[i + 1]], indices into the step's items, ascending within
    each run."""
    weights: Sequence[float] = ()
    """The weight of each edge, paired with ids; empty weighs every edge one."""


@dataclass(kw_only=True)
class Relations:
    """The contrastive targets of one step, resolved per pair in this order: a pair ignore names is skipped,
    one attract names pulls together, one repel names pushes apart, and every other pair follows the run's
    Negatives."""

    attract: Edges = field(default_factory=Edges)
    """Pairs pulled together."""
    repel: Edges = field(default_factory=Edges)
    """Pairs pushed apart."""
    ignore: Edges = field(default_factory=Edges)
    """Pairs skipped, like known false negatives; their weights are not read."""


_SETS = ("attract", "repel", "ignore")


# --------------------------------------------------------------------------------------------------
# Reading the user's sequences (read-only views; nothing is ever written back)


def _flat(value: Any, name: str) -> np.ndarray:
    """`value` (a list, tuple, range or numpy array) as a one-dimensional numpy array, without copying an array."""
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        if any(isinstance(v, (bool, np.bool_)) for v in value):
            raise TypeError(f"{name}: expected numbers, got a bool")
        try:
            array = np.asarray(value)
        except (ValueError, TypeError, OverflowError) as error:
            raise TypeError(f"{name}: expected a flat sequence of numbers ({error})") from None
    else:
        raise TypeError(f"{name}: expected a list, tuple or numpy array, got {type(value).__name__}")
    if array.ndim != 1:
        raise TypeError(f"{name}: expected a flat sequence, got {array.ndim} dimensions")
    return array


def _integers(value: Any, name: str) -> np.ndarray:
    """`value` as int64 indices; floats, bools and other non-integers are a `TypeError`."""
    array = _flat(value, name)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind == "u":
        if int(array.max()) >= 2**62:
            raise ValueError(f"{name}: {int(array.max())} is out of range")
        return array.astype(np.int64)
    if array.dtype.kind != "i":
        raise TypeError(f"{name}: expected integers, got {array.dtype} values")
    return array.astype(np.int64, copy=False)


def _reals(value: Any, name: str) -> np.ndarray:
    """`value` as float64 weights; bools, strings and other non-numbers are a `TypeError`."""
    array = _flat(value, name)
    if array.size == 0:
        return np.zeros(0, dtype=np.float64)
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected real numbers, got {array.dtype} values")
    return array.astype(np.float64, copy=False)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _rows(offsets: np.ndarray, count: int) -> np.ndarray:
    """The source item of every edge: row i repeated over its run ids[offsets[i]:offsets[i + 1]]."""
    if offsets.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(np.arange(count, dtype=np.int64), np.diff(offsets))


# --------------------------------------------------------------------------------------------------
# The check


def edge_limit(run: Any, devices: int = 1) -> tuple[int, str]:
    """(edges one edge set of a step may name, the words naming that limit) for the resolved run `run` over
    `devices` devices. Where `contrastive.max_edges_per_device` equals `batch.max_segments_per_device` it
    may never have been set (zero derives it), so the words name both fields."""
    limit, segments = run.contrastive.max_edges_per_device, run.batch.max_segments_per_device
    words = f"contrastive.max_edges_per_device ({limit})"
    if limit == segments:
        words = (
            f"contrastive.max_edges_per_device ({limit}; left zero, it derives from batch.max_segments_per_device, "
            "so raise either)"
        )
    if devices > 1:
        words = f"{devices} devices x {words}"
    return limit * devices, words


def _check_edges(edges: Any, name: str, count: int, max_edges: int, limit: str, read_weights: bool) -> None:
    if not isinstance(edges, Edges):
        raise TypeError(f"{name}: expected an Edges, got {type(edges).__name__}")
    offsets = _integers(edges.offsets, f"{name}.offsets")
    ids = _integers(edges.ids, f"{name}.ids")
    weights = _reals(edges.weights, f"{name}.weights") if read_weights else None

    if offsets.size == 0:
        _need(ids.size == 0, f"{name}.offsets: empty offsets name no edges, yet ids holds {ids.size}")
    else:
        _need(bool((offsets >= 0).all()), f"{name}.offsets: must not be negative, got {int(offsets.min())}")
        _need(
            offsets.size == count + 1,
            f"{name}.offsets: must hold the step's count plus one ({count + 1}) offsets, or none, got {offsets.size}",
        )
        _need(int(offsets[0]) == 0, f"{name}.offsets: must start at 0, got {int(offsets[0])}")
        steps = np.diff(offsets)
        if (steps < 0).any():
            at = int(np.argmax(steps < 0))
            raise ValueError(
                f"{name}.offsets: must be non-decreasing, got {int(offsets[at])} then {int(offsets[at + 1])} at {at}"
            )
        _need(
            int(offsets[-1]) == ids.size,
            f"{name}.offsets: must end at the length of ids ({ids.size}), got {int(offsets[-1])}",
        )
    _need(
        ids.size <= max_edges,
        f"{name}.ids: names {ids.size} edges, more than {limit}",
    )
    if ids.size:
        _need(bool((ids >= 0).all()), f"{name}.ids: must not be negative, got {int(ids.min())}")
        _need(
            bool((ids < count).all()),
            f"{name}.ids: must index the step's {count} items, got {int(ids.max())}",
        )
        rows = _rows(offsets, count)
        same_run = rows[1:] == rows[:-1]
        unordered = same_run & (ids[1:] <= ids[:-1])
        if unordered.any():
            at = int(np.argmax(unordered))
            raise ValueError(
                f"{name}.ids: must be strictly ascending within each run, got {int(ids[at])} then "
                f"{int(ids[at + 1])} in item {int(rows[at])}'s run"
            )
        selfish = rows == ids
        if selfish.any():
            at = int(rows[np.argmax(selfish)])
            raise ValueError(f"{name}.ids: item {at} links to itself; self pairs never score")
    if weights is not None:
        _need(
            weights.size in (0, ids.size),
            f"{name}.weights: must be empty or as long as ids ({ids.size}), got {weights.size}",
        )
        _need(
            bool((np.abs(weights) <= np.finfo(np.float32).max).all()),
            f"{name}.weights: must be finite in float32 (|w| < 3.4e38)",
        )
        _need(
            bool((weights >= 0).all()),
            f"{name}.weights: must not be negative, got {weights.min() if weights.size else 0}",
        )


def check_relations(relations: Relations | None, count: int, max_edges: int, limit: str | None = None) -> None:
    """Checks a step's relations against its `count` items; `max_edges` bounds each edge set, `limit` the
    words naming that bound in an error (`edge_limit`'s).

    Raises `ValueError` naming the field (`relations.attract.offsets: ...`) and the rule, or `TypeError`
    for a wrong type. `None` names no edges. Reads, never writes, its input.
    """
    if relations is None:
        return
    limit = f"contrastive.max_edges_per_device ({max_edges})" if limit is None else limit
    if not isinstance(relations, Relations):
        raise TypeError(f"relations: expected a Relations, got {type(relations).__name__}")
    for set_name in _SETS:
        _check_edges(
            getattr(relations, set_name),
            f"relations.{set_name}",
            count,
            max_edges,
            limit,
            read_weights=set_name != "ignore",
        )


# --------------------------------------------------------------------------------------------------
# Resolution into pair targets


def _edge_cells(edges: Edges, count: int, with_weights: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, columns, weights) of every edge of a checked set; weights are float32 (ones when empty)."""
    offsets = _integers(edges.offsets, "offsets")
    ids = _integers(edges.ids, "ids")
    rows = _rows(offsets, count)
    if with_weights and len(edges.weights):
        weights = np.asarray(edges.weights, dtype=np.float32)
    else:
        weights = np.ones(ids.size, dtype=np.float32)
    return rows, ids, weights


def pair_targets(
    relations: Relations | None, count: int, negatives: Negatives, ambient_weight: float
) -> tuple[np.ndarray, np.ndarray]:
    """Resolves checked relations into `(z, w)`, each `[count, count]` (row i, column j).

    `z` (int8) is +1 where the pair attracts, -1 where it repels (a repel edge, or an unnamed pair under
    `Negatives.Ambient`), 0 where it does not score; `w` (float32) is the pair's weight, exactly 0 where
    `z` is 0. Per cell (i, j), j != i: an ignore edge i->j skips it, else an attract edge, else a repel
    edge, else the negatives rule (`ambient_weight` under Ambient, skipped under Named). The diagonal never
    scores, and a zero-weight edge is named but scores nothing.
    """
    negatives = Negatives.parse(negatives, "contrastive.negatives")
    relations = Relations() if relations is None else relations
    if negatives == Negatives.Ambient:
        z = np.full((count, count), -1, dtype=np.int8)
        w = np.full((count, count), ambient_weight, dtype=np.float32)
    else:
        z = np.zeros((count, count), dtype=np.int8)
        w = np.zeros((count, count), dtype=np.float32)
    # Lowest precedence first, so that each later set overwrites the cells it names.
    rows, cols, weights = _edge_cells(relations.repel, count, with_weights=True)
    z[rows, cols] = -1
    w[rows, cols] = weights
    rows, cols, weights = _edge_cells(relations.attract, count, with_weights=True)
    z[rows, cols] = 1
    w[rows, cols] = weights
    rows, cols, _ = _edge_cells(relations.ignore, count, with_weights=False)
    z[rows, cols] = 0
    diagonal = np.arange(count)
    z[diagonal, diagonal] = 0
    z[w == 0] = 0
    w[z == 0] = 0
    return z, w


# --------------------------------------------------------------------------------------------------
# Routing a step's relations to devices


def first_crossing(relations: Relations | None, count: int, bags: np.ndarray) -> tuple[str, int, int] | None:
    """The first edge (set name, i, j) of checked relations whose items lie in different bags, or None."""
    if relations is None:
        return None
    for set_name in _SETS:
        edges = getattr(relations, set_name)
        rows, cols, _ = _edge_cells(edges, count, with_weights=False)
        crossing = bags[rows] != bags[cols]
        if crossing.any():
            at = int(np.argmax(crossing))
            return set_name, int(rows[at]), int(cols[at])
    return None


def restrict(relations: Relations | None, items: np.ndarray, count: int) -> Relations:
    """The edges of checked relations among `items` (ascending indices into the step's `count` items),
    renumbered to positions in `items`; edges leaving `items` are left out."""
    if relations is None:
        return Relations()
    local = np.full(count, -1, dtype=np.int64)
    local[items] = np.arange(len(items))
    out = {}
    for set_name in _SETS:
        edges = getattr(relations, set_name)
        if len(edges.offsets) == 0:
            out[set_name] = Edges()
            continue
        rows, cols, weights = _edge_cells(edges, count, with_weights=True)
        keep = (local[rows] >= 0) & (local[cols] >= 0)
        rows, cols, weights = local[rows[keep]], local[cols[keep]], weights[keep]
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.add.at(offsets, rows + 1, 1)
        out[set_name] = Edges(
            offsets=np.cumsum(offsets).tolist(),
            ids=cols.tolist(),
            weights=weights.tolist() if len(edges.weights) else [],
        )
    return Relations(**out)
