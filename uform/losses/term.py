"""A loss term as a (sum, count) pair, and the one reduction of a world's counts.

Every loss of `uform.losses` answers a `Term`: the SUM of its per-anchor (per-position, per-unit, per-slot)
values and how many there were, both 0-d tensors. The step divides each sum by its count once; in a world,
by the world's count (`world_counts`), so the mean is the world's whatever the number of processes
(torchtitan and open_clip divide by global counts the same way). Which tensors are counts is told by the
type, never by a name: a new term slots in by answering a `Term`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from .peers import Peers


class Term(NamedTuple):
    """One loss term of a step: `sum` [] of its values (differentiable), `count` [] of them (no gradient
    needed; float). A NamedTuple, so `total, count = term` unpacks and a compiled step returns it as is."""

    sum: Tensor
    count: Tensor  # type: ignore[assignment]  # the field shadows tuple.count, which no term needs


def check_term(name: str, value: object) -> Term:
    """`value` if it is a `Term`; else a TypeError naming the term (a bare tuple or tensor would leave the
    world reduction unable to tell its count)."""
    if not isinstance(value, Term):
        raise TypeError(
            f"loss term {name!r}: expected a uform.losses.term.Term (sum, count), got {type(value).__name__}; "
            "every loss answers its sum with its count so the step can divide by the world's count"
        )
    return value


def world_counts(terms: Mapping[str, Term], world: Peers) -> dict[str, Term]:
    """The terms with every count summed over the world (one all-reduce, no gradient) and every sum as it
    was, so that each process's sums divided by them add up, over the processes, to the world's means."""
    names = sorted(terms)
    for name in names:
        check_term(name, terms[name])
    if not names:
        return dict(terms)
    counts = world.all_reduce(torch.stack([terms[k].count.detach().float() for k in names]))  # [T]
    return {k: Term(terms[k].sum, counts[i].to(terms[k].count.dtype)) for i, k in enumerate(names)}
