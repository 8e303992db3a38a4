"""`uform.losses.contrastive` against a naive per-anchor, per-pair reference, forward and backward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import naive_row_loss

import uform.losses.contrastive as contrastive
from uform.enums import Negatives, PairLossForm
from uform.losses.contrastive import contrastive_loss, contrastive_term, pair_loss
from uform.relations import Edges, Relations, check_relations, pair_targets

FORMS = [PairLossForm.Sigmoid, PairLossForm.Balanced, PairLossForm.Ranked]


def reference_term(
    embeddings: torch.Tensor,
    valid: list[bool],
    groups: list[int],
    log_t: torch.Tensor,
    bias: torch.Tensor,
    z: np.ndarray,
    w: np.ndarray,
    widths: list[int],
    form: PairLossForm,
    columns: torch.Tensor | None = None,
    column_valid: list[bool] | None = None,
) -> tuple[torch.Tensor, int]:
    """docs/design.md §5 literally: loops over anchors and their cells, scalar arithmetic per pair."""
    columns = embeddings if columns is None else columns
    column_valid = valid if column_valid is None else column_valid
    rows, count = z.shape
    widths = widths or [embeddings.shape[1]]
    totals = []
    anchors = 0
    for width in widths:
        total = embeddings.new_zeros(())
        anchors = 0
        for i in range(rows):
            if not valid[i]:
                continue
            t = torch.exp(log_t[groups[i]])
            b = bias[groups[i]]
            e = embeddings[i, :width] / torch.sqrt((embeddings[i, :width] ** 2).sum())
            positives, negatives = [], []  # (logit, weight)
            for j in range(count):
                if not column_valid[j] or z[i, j] == 0 or w[i, j] == 0:
                    continue
                c = columns[j, :width] / torch.sqrt((columns[j, :width] ** 2).sum())
                logit = t * torch.dot(e, c) + b
                (positives if z[i, j] > 0 else negatives).append((logit, float(w[i, j])))
            row = naive_row_loss(positives, negatives, form)
            if row is not None:
                anchors += 1
                total = total + row
        totals.append(total)
    return sum(totals) / len(widths), anchors


def _random_edges(rng: np.random.Generator, count: int, density: float) -> Edges:
    offsets, ids, weights = [0], [], []
    for i in range(count):
        run = [j for j in range(count) if j != i and rng.random() < density]
        ids.extend(run)
        weights.extend(float(rng.choice([0.0, 0.5, 1.0, 2.5])) for _ in run)
        offsets.append(len(ids))
    return Edges(offsets=offsets, ids=ids, weights=weights)


def _case(form: PairLossForm, negatives: Negatives, layout: str, seed: int = 0) -> dict:
    """Random inputs: 10 rows over D=32, three temperature groups, two invalid rows, ignore edges."""
    rng = np.random.default_rng(seed + 100 * int(form) + 10 * int(negatives))
    n, d, groups_count = 10, 32, 3
    valid = [True] * n
    valid[3] = valid[7] = False
    groups = [int(g) for g in rng.integers(0, groups_count, n)]
    if layout == "self":
        relations = Relations(
            attract=_random_edges(rng, n, 0.25),
            repel=_random_edges(rng, n, 0.3),
            ignore=_random_edges(rng, n, 0.15),
        )
        check_relations(relations, n, n * n)
        z, w = pair_targets(relations, n, negatives, 0.7)
        columns, column_valid = None, None
    else:
        m = 12
        z = rng.choice(np.array([-1, 0, 1], dtype=np.int8), size=(n, m), p=[0.5, 0.25, 0.25])
        if negatives == Negatives.Named:
            z[rng.random((n, m)) < 0.3] = 0
        w = (rng.choice([0.0, 0.5, 1.0, 2.0], size=(n, m), p=[0.1, 0.3, 0.3, 0.3]) * (z != 0)).astype(np.float32)
        z[w == 0] = 0
        z[0], w[0] = 0, 0  # a row with no scored cell
        z[1], w[1] = 1, 1.5  # a row of positives alone
        z[2], w[2] = -1, 0.5  # a row of negatives alone
        columns = torch.tensor(rng.standard_normal((m, d)), dtype=torch.float64, requires_grad=True)
        column_valid = [bool(v) for v in rng.random(m) > 0.2]
    return {
        "embeddings": torch.tensor(rng.standard_normal((n, d)), dtype=torch.float64, requires_grad=True),
        "valid": valid,
        "groups": groups,
        "log_t": torch.tensor(rng.uniform(0.0, 1.5, groups_count), dtype=torch.float64, requires_grad=True),
        "bias": torch.tensor(rng.uniform(-2.0, 2.0, groups_count), dtype=torch.float64, requires_grad=True),
        "z": z,
        "w": w,
        "columns": columns,
        "column_valid": column_valid,
    }


def _module_args(case: dict, widths: list[int], form: PairLossForm) -> tuple:
    optional = {}
    if case["columns"] is not None:
        optional = {"columns": case["columns"], "column_valid": torch.tensor(case["column_valid"])}
    return (
        case["embeddings"],
        torch.tensor(case["valid"]),
        torch.tensor(case["groups"], dtype=torch.int64),
        case["log_t"],
        case["bias"],
        torch.from_numpy(case["z"]),
        torch.from_numpy(case["w"]),
        widths,
        form,
    ), optional


def _parameters(case: dict) -> list[torch.Tensor]:
    found = [case["embeddings"], case["log_t"], case["bias"]]
    return [*found, case["columns"]] if case["columns"] is not None else found


@pytest.mark.parametrize("layout", ["self", "columns"])
@pytest.mark.parametrize("negatives", [Negatives.Ambient, Negatives.Named])
@pytest.mark.parametrize("form", FORMS)
def test_matches_reference_forward_and_backward(form: PairLossForm, negatives: Negatives, layout: str) -> None:
    case = _case(form, negatives, layout)
    widths = [8, 16]
    args, optional = _module_args(case, widths, form)
    total, anchors = contrastive_term(*args, **optional)
    loss = contrastive_loss(*args, **optional)
    expected_total, expected_anchors = reference_term(
        case["embeddings"],
        case["valid"],
        case["groups"],
        case["log_t"],
        case["bias"],
        case["z"],
        case["w"],
        widths,
        form,
        case["columns"],
        case["column_valid"],
    )
    assert expected_anchors > 0
    assert float(anchors) == expected_anchors
    assert total.dtype == torch.float64 and total.dim() == 0 and anchors.dim() == 0
    torch.testing.assert_close(total, expected_total, rtol=1e-9, atol=1e-9)
    expected_loss = expected_total / max(expected_anchors, 1)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=1e-9)

    parameters = _parameters(case)
    grads = torch.autograd.grad(loss, parameters)
    expected_grads = torch.autograd.grad(expected_loss, parameters)
    for name, got, want in zip(["embeddings", "log_t", "bias", "columns"], grads, expected_grads, strict=False):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
    # Invalid rows neither score nor receive a gradient.
    assert not grads[0][3].any() and not grads[0][7].any()
    if form == PairLossForm.Ranked:
        assert torch.equal(grads[2], torch.zeros_like(grads[2]))


@pytest.mark.parametrize("form", FORMS)
def test_full_width_when_widths_are_empty(form: PairLossForm) -> None:
    case = _case(form, Negatives.Ambient, "self", seed=3)
    args, _ = _module_args(case, [], form)
    full, _ = contrastive_term(*args)
    args, _ = _module_args(case, [32], form)
    explicit, _ = contrastive_term(*args)
    expected, _ = reference_term(
        case["embeddings"], case["valid"], case["groups"], case["log_t"], case["bias"], case["z"], case["w"], [], form
    )
    torch.testing.assert_close(full, explicit, rtol=0, atol=0)
    torch.testing.assert_close(full, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("form", FORMS)
def test_ranked_bias_gradient_is_exactly_zero(form: PairLossForm) -> None:
    case = _case(form, Negatives.Ambient, "columns", seed=5)
    args, optional = _module_args(case, [8, 16, 32], form)
    (grad_bias,) = torch.autograd.grad(contrastive_loss(*args, **optional), [case["bias"]])
    if form == PairLossForm.Ranked:
        assert torch.equal(grad_bias, torch.zeros_like(grad_bias))
    else:
        assert grad_bias.abs().sum() > 0


def test_siglip_equality() -> None:
    """B images then B texts, attract i->B+i, repel i->B+j (j != i), texts without edges, Named, one group."""
    b_count, d = 5, 16
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(b_count, d, generator=generator, dtype=torch.float64)
    texts = torch.randn(b_count, d, generator=generator, dtype=torch.float64)
    embeddings = torch.cat([images, texts]).requires_grad_(True)  # [2B, D]
    n = 2 * b_count
    attract = Edges(offsets=[*range(b_count + 1), *[b_count] * b_count], ids=[b_count + i for i in range(b_count)])
    repel_ids = [b_count + j for i in range(b_count) for j in range(b_count) if j != i]
    repel = Edges(
        offsets=[*range(0, b_count * (b_count - 1) + 1, b_count - 1), *[len(repel_ids)] * b_count], ids=repel_ids
    )
    relations = Relations(attract=attract, repel=repel)
    check_relations(relations, n, n * n)
    z, w = pair_targets(relations, n, Negatives.Named, 1.0)

    log_scale = torch.tensor([math.log(10.0)], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([-10.0], dtype=torch.float64, requires_grad=True)
    loss = contrastive_loss(
        embeddings,
        torch.ones(n, dtype=torch.bool),
        torch.zeros(n, dtype=torch.int64),
        log_scale,
        bias,
        torch.from_numpy(z),
        torch.from_numpy(w),
        [],
        PairLossForm.Sigmoid,
    )

    # open_clip's `SigLipLoss` (open_clip/loss.py), one process: on L2-normalised features,
    # logits = logit_scale * image @ text.T + logit_bias, labels = 2 * eye - 1,
    # loss = -logsigmoid(labels * logits).sum() / batch_size.
    image_features = torch.nn.functional.normalize(embeddings[:b_count], dim=-1)
    text_features = torch.nn.functional.normalize(embeddings[b_count:], dim=-1)
    logits = log_scale.exp() * image_features @ text_features.T + bias
    labels = 2 * torch.eye(b_count, dtype=torch.float64) - 1
    expected = -torch.nn.functional.logsigmoid(labels * logits).sum() / b_count

    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(loss, [embeddings, log_scale, bias])
    want = torch.autograd.grad(expected, [embeddings, log_scale, bias])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_rows_without_an_anchor_term_add_nothing_and_no_nan(form: PairLossForm) -> None:
    logits = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits[0] = float("nan")  # a row with no scored cell may hold anything
    logits[1, 3:] = float("inf")  # unscored cells of a row of positives alone
    logits.requires_grad_(True)
    z = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, -1, 0, -1, 1], [0, -1, 1, 0, 0]], dtype=torch.int8)
    w = torch.tensor([[0, 0, 0, 0, 0], [1, 2, 1, 0, 0], [1, 1, 0, 2, 0.5], [0, 3, 1, 0, 0]], dtype=torch.float64)
    total, anchors = pair_loss(logits, z, w, form)
    assert float(anchors) == (2 if form == PairLossForm.Ranked else 3)
    (grad,) = torch.autograd.grad(total, [logits])
    assert torch.isfinite(total) and torch.isfinite(grad).all()
    assert not grad[0].any()
    assert not grad[:, 3:][z[:, 3:] == 0].any()
    if form == PairLossForm.Ranked:
        assert not grad[1].any()
    # Dropping the row without a scored cell changes nothing (nor, under Ranked, the row of positives alone).
    first = 2 if form == PairLossForm.Ranked else 1
    kept_total, _ = pair_loss(logits.detach()[first:], z[first:], w[first:], form)
    torch.testing.assert_close(total.detach(), kept_total, rtol=1e-12, atol=1e-12)


def test_nan_in_an_invalid_slot_never_reaches_a_gradient() -> None:
    case = _case(PairLossForm.Sigmoid, Negatives.Ambient, "self", seed=7)
    with torch.no_grad():
        case["embeddings"][3] = float("nan")
    for form in FORMS:
        args, _ = _module_args(case, [8, 16], form)
        loss = contrastive_loss(*args)
        grads = torch.autograd.grad(loss, _parameters(case))
        assert torch.isfinite(loss)
        assert all(torch.isfinite(g).all() for g in grads)


def test_nothing_scored_answers_zero() -> None:
    embeddings = torch.randn(3, 8, requires_grad=True)
    zeros = torch.zeros(3, 3)
    args = (embeddings, torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.int64))
    for form in FORMS:
        params = (torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True))
        total, anchors = contrastive_term(*args, *params, zeros, zeros, [8], form)
        assert float(total.detach()) == 0 and float(anchors) == 0
        loss = contrastive_loss(*args, *params, zeros, zeros, [8], form)
        (grad,) = torch.autograd.grad(loss, [embeddings])
        assert float(loss.detach()) == 0 and not grad.any()


def test_ranked_chunks_give_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(PairLossForm.Ranked, Negatives.Ambient, "columns", seed=11)
    args, optional = _module_args(case, [16], PairLossForm.Ranked)
    whole = contrastive_loss(*args, **optional)
    grads = torch.autograd.grad(whole, _parameters(case))
    monkeypatch.setattr(contrastive, "_RANKED_CHUNK_ELEMENTS", 1)
    chunked = contrastive_loss(*args, **optional)
    chunked_grads = torch.autograd.grad(chunked, _parameters(case))
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    for a, b in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", FORMS)
def test_low_precision_inputs_are_scored_in_float32(form: PairLossForm) -> None:
    case = _case(form, Negatives.Ambient, "self", seed=13)
    args, _ = _module_args(case, [8, 16], form)
    exact = contrastive_loss(*args)
    low = list(args)
    low[0] = case["embeddings"].detach().to(torch.bfloat16)
    low[3], low[4] = case["log_t"].detach().float(), case["bias"].detach().float()
    approximate = contrastive_loss(*low)
    assert approximate.dtype == torch.float32
    torch.testing.assert_close(approximate.double(), exact.detach(), rtol=2e-2, atol=2e-2)
    low[0] = case["embeddings"].detach().float()
    torch.testing.assert_close(contrastive_loss(*low).double(), exact.detach(), rtol=1e-5, atol=1e-5)


def test_derived_and_bad_shapes_are_refused() -> None:
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="Derived"):
        pair_loss(logits, logits, logits, PairLossForm.Derived)
    with pytest.raises(ValueError, match="shape"):
        pair_loss(logits, torch.zeros(3, 2), logits, PairLossForm.Sigmoid)
    embeddings = torch.randn(2, 8)
    args = (
        embeddings,
        torch.ones(2, dtype=torch.bool),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(1),
        torch.zeros(1),
    )
    with pytest.raises(ValueError, match="Derived"):
        contrastive_term(*args, torch.zeros(2, 2), torch.zeros(2, 2), [], PairLossForm.Derived)
    with pytest.raises(ValueError, match="width"):
        contrastive_term(*args, torch.zeros(2, 2), torch.zeros(2, 2), [16], PairLossForm.Sigmoid)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements of any tensor an op makes while it is on (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_in_a_world_term(form: PairLossForm, world: int, slots: int = 16, hidden: int = 32) -> int:
    """One process's contrastive term in a world of `world` processes of `slots` slots each (issue 16, item 2):
    the world's columns gathered, its own rows against them, forward and backward, as `Network.heads` scores it
    (`world_pairs`, then `contrastive_term`); answers the largest tensor made."""
    generator = torch.Generator().manual_seed(world)
    rows = torch.randn(slots, hidden, generator=generator, requires_grad=True)
    others = torch.randn(world * slots, hidden, generator=generator)
    z = torch.zeros(slots, slots)
    w = torch.zeros(slots, slots)
    z[torch.arange(slots), torch.arange(slots).roll(1)] = 1.0  # one positive a row, in its own process's block
    w[torch.arange(slots), torch.arange(slots).roll(1)] = 1.0
    with _LargestTensor() as seen:
        columns = torch.cat([others[: world // 2 * slots], rows, others[(world // 2 + 1) * slots :]])  # [W*S, D]
        wide_z, wide_w = contrastive.world_pairs(z, w, world // 2, world, True, 0.5)
        term = contrastive_term(
            rows,
            torch.ones(slots, dtype=torch.bool),
            torch.zeros(slots, dtype=torch.int64),
            torch.zeros(1, requires_grad=True),
            torch.zeros(1, requires_grad=True),
            wide_z,
            wide_w,
            [hidden // 2, hidden],
            form,
            columns=columns,
            column_valid=torch.ones(world * slots, dtype=torch.bool),
            positives=1 if form == PairLossForm.Ranked else None,
        )
        term.sum.backward()
    assert rows.grad is not None and torch.isfinite(rows.grad).all()
    return seen.largest


@pytest.mark.parametrize("form", FORMS)
def test_a_world_term_holds_local_by_world_cells_never_world_squared(form: PairLossForm) -> None:
    """The term's memory grows with local slots x world slots: from 16 to 64 processes its largest tensor grows
    4x (never 16x), and is the world's gathered columns [W * S, D] or a small multiple of one [S, W * S] score
    matrix, far below a [W * S, W * S] one."""
    slots, hidden = 16, 32
    largest = {world: _largest_in_a_world_term(form, world, slots, hidden) for world in (16, 64)}
    for world, elements in largest.items():
        cells = slots * world * slots  # one [S, W * S] matrix
        assert elements <= max(2 * cells, world * slots * hidden), (world, elements, cells)
    assert largest[64] <= (64 * slots) ** 2 / 16
    assert largest[64] <= 4.5 * largest[16]
