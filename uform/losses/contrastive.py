"""The contrastive pair losses of docs/design.md §5, as pure functions over tensors.

Shape legend (annotated inline as `[N, M]`):
    N  rows: the anchors, one per slot of this process's step (each may be an invalid, empty slot)
    M  columns: the candidates every row scores (the world's items; the rows themselves by default)
    S  segments (slots) of one device's step; the pooled embeddings of a step are `[S, D]`, so N = S locally
    D  hidden width of a pooled embedding
    W  a Matryoshka prefix width, W <= D, re-normalised on its own
    G  temperature groups, each with a learnable log inverse temperature and bias

Targets arrive as `z`, `w`, both `[N, M]`: `z` is +1 for a positive (attract), -1 for a negative (repel or
ambient), 0 for an unscored cell; `w` is the cell's weight, 0 where unscored (see `uform.relations`).

With sp = softplus and l_ij the logit of row i, column j, the forms score each anchor row as
    Sigmoid   sum_j w_ij sp(-z_ij l_ij)                                  (SigLIP, Zhai et al. 2023)
    Balanced  sum_p w_p sp(-l_p) / sum_p w_p + sum_n w_n sp(l_n) / sum_n w_n   (an empty half adds 0)
    Ranked    sum_{p,n} w_p w_n sp(l_n - l_p) / sum_{p,n} w_p w_n        (the bias cancels)
The functions answer the SUM of those anchor terms and the anchor count; the caller divides once by the
(possibly world-wide) count, so that the loss is the world mean whatever the number of processes.

Every accepted weight (finite, non-negative, up to float32's largest) scores without a non-finite value of
its own making: Balanced and Ranked are ratios of weight sums, so each row's positive and negative weights are
first divided by their own largest (the ratio is unchanged; a subnormal weight such as 1e-41 no longer makes a
denominator whose reciprocal, in the gradient, overflows, and a weight of 1e38 no longer overflows a product or
a sum). softplus is `logaddexp(0, x)`, exact in every dtype (F.softplus switches to x past a threshold of 20,
which is off by up to 2e-9 in float64) with the exact gradient sigmoid(x) everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..enums import PairLossForm
from .term import Term

_RANKED_CHUNK_ELEMENTS = 1 << 24
"""The most (row, positive, column) triples one chunk of the ranked form materialises."""

_NORMALIZE_EPS = 1e-12
"""F.normalize's floor on a norm, so an all-zero (empty slot) embedding normalises to zero, not NaN."""


def _math_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """At least float32: half and bfloat16 inputs are scored in float32, float64 ones stay float64."""
    out = torch.float32
    for dtype in dtypes:
        if dtype.is_floating_point:
            out = torch.promote_types(out, dtype)
    return out


def softplus(x: Tensor) -> Tensor:
    """log(1 + e^x) = logaddexp(0, x): exact in every dtype, its gradient sigmoid(x) (no threshold)."""
    return torch.logaddexp(torch.zeros_like(x), x)


def _per_row_unit(w: Tensor) -> Tensor:
    """w [N, M] (non-negative) divided by each row's largest, so its largest is 1 (a zero row stays zero)."""
    top = w.amax(dim=1, keepdim=True)  # [N, 1]
    return w / torch.where(top > 0, top, 1.0)


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator where the denominator is positive, else 0, with no NaN in value or gradient."""
    positive = denominator > 0
    return torch.where(positive, numerator / torch.where(positive, denominator, 1.0), 0.0)


def _form(form: PairLossForm | int, name: str) -> PairLossForm:
    form = PairLossForm(form)
    if form == PairLossForm.Derived:
        raise ValueError(f"{name}: PairLossForm.Derived must be resolved by the caller (sigmoid or ranked)")
    return form


def pair_loss(logits: Tensor, z: Tensor, w: Tensor, form: PairLossForm, positives: int | None = None) -> Term:
    """logits, z, w: [N, M] (z float or int: +1 positive, -1 negative, 0 unscored; w: weight, 0 where unscored).
    Answers (total, anchors): `total` the SUM over anchor rows of each anchor's term (a 0-d float tensor,
    differentiable w.r.t. logits), `anchors` the number of anchor rows (0-d tensor, float). The caller divides
    total by the (possibly world-wide) anchor count once.

    An anchor is a row with a scored cell (under Ranked: a positive and a negative). Rows that are not
    anchors add exactly zero to `total` and to the gradient. The math runs in at least float32.

    `positives` (Ranked only): a bound on the positives of any row, known to the caller ahead of time (the
    host counts them); without it the bound is read off the device, which synchronises and, under
    `torch.compile`, makes the shape data-dependent.
    """
    form = _form(form, "pair_loss.form")
    if logits.dim() != 2 or z.shape != logits.shape or w.shape != logits.shape:
        raise ValueError(
            f"pair_loss: logits, z and w must share one [N, M] shape, got {tuple(logits.shape)}, "
            f"{tuple(z.shape)}, {tuple(w.shape)}"
        )
    dtype = _math_dtype(logits.dtype, w.dtype)
    w = w.to(dtype)  # [N, M]
    positive = (z > 0) & (w > 0)  # [N, M]
    negative = (z < 0) & (w > 0)  # [N, M]
    scored = positive | negative  # [N, M]
    # Unscored cells are zeroed before any arithmetic, so that whatever they hold (a huge or non-finite
    # logit of an empty slot) reaches neither the value nor the gradient.
    logits = torch.where(scored, logits.to(dtype), 0.0)  # [N, M]
    w = torch.where(scored, w, 0.0)  # [N, M]

    if form == PairLossForm.Sigmoid:
        sign = torch.where(positive, 1.0, -1.0).to(dtype)  # [N, M]
        total = (w * softplus(-sign * logits)).sum()
        anchors = scored.any(dim=1).sum().to(dtype)
        return Term(total, anchors)

    # Both forms are ratios of weight sums, invariant to a row's scale per half: each half's weights are
    # divided by their largest, so no sum, product or reciprocal of them leaves the float range.
    w_pos = _per_row_unit(torch.where(positive, w, 0.0))  # [N, M], each row's largest 1
    w_neg = _per_row_unit(torch.where(negative, w, 0.0))  # [N, M], each row's largest 1
    if form == PairLossForm.Balanced:
        attract = _ratio((w_pos * softplus(-logits)).sum(dim=1), w_pos.sum(dim=1))  # [N]
        repel = _ratio((w_neg * softplus(logits)).sum(dim=1), w_neg.sum(dim=1))  # [N]
        anchors = scored.any(dim=1).sum().to(dtype)
        return Term((attract + repel).sum(), anchors)

    # Ranked: every (positive, negative) pair of a row. Each row's positives are gathered into K slots
    # (K the most positives any row holds, padding slots weighing zero), so a chunk of C rows holds
    # [C, K, M] pair scores rather than [C, M, M]; positives are usually few.
    rows, columns = logits.shape
    is_anchor = positive.any(dim=1) & negative.any(dim=1)  # [N]
    anchors = is_anchor.sum().to(dtype)
    k = positives if positives is not None else (int(positive.sum(dim=1).max()) if rows else 0)
    k = min(k, columns)
    slots = torch.topk(positive.to(dtype), k, dim=1).indices  # [N, K], every positive among them
    logits_pos = logits.gather(1, slots)  # [N, K]
    w_slots = w_pos.gather(1, slots)  # [N, K], zero on padding slots
    chunk = max(1, _RANKED_CHUNK_ELEMENTS // max(1, k * columns))
    numerators = []
    for start in range(0, rows, chunk):
        part = slice(start, start + chunk)
        margins = logits[part, None, :] - logits_pos[part, :, None]  # [C, K, M]: l_n - l_p
        per_positive = (softplus(margins) * w_neg[part, None, :]).sum(dim=2)  # [C, K]
        numerators.append((per_positive * w_slots[part]).sum(dim=1))  # [C]
    numerator = torch.cat(numerators) if numerators else logits.new_zeros(0)  # [N]
    denominator = w_pos.sum(dim=1) * w_neg.sum(dim=1)  # [N]
    total = torch.where(is_anchor, _ratio(numerator, denominator), 0.0).sum()
    return Term(total, anchors)


def contrastive_term(
    embeddings: Tensor,
    valid: Tensor,
    groups: Tensor,
    log_inverse_temperature: Tensor,
    bias: Tensor,
    z: Tensor,
    w: Tensor,
    widths: Sequence[int],
    form: PairLossForm,
    columns: Tensor | None = None,
    column_valid: Tensor | None = None,
    positives: int | None = None,
) -> Term:
    """The pooled contrastive term: (Matryoshka mean over `widths` of the summed anchor terms, anchors).

    embeddings [N, D] raw pooled embeddings of the rows; valid [N] bool, the slots holding an item; groups
    [N] int64, each row's temperature group; log_inverse_temperature [G] and bias [G] the learnable pairs
    (t_g = exp(log_t_g)); z, w [N, M] the pair targets; widths the Matryoshka prefix widths scored (empty:
    the full width D alone); columns [M, D] the candidates (default: the rows themselves, whose self cells
    z / w already leave unscored) and column_valid [M] (default: valid). A cell whose row or column is
    invalid does not score. Per width W the logits are l_ij = t_g(i) <e_i, c_j> + b_g(i) over the
    separately re-normalised W-prefixes. The caller divides the total by the anchor count (clamped at 1),
    world-wide where the columns span the world.
    """
    form = _form(form, "contrastive_term.form")
    if embeddings.dim() != 2:
        raise ValueError(f"contrastive_term: embeddings must be [N, D], got {tuple(embeddings.shape)}")
    rows, hidden = embeddings.shape
    same = columns is None and column_valid is None
    columns = embeddings if columns is None else columns
    column_valid = valid if column_valid is None else column_valid
    count = columns.shape[0]
    if columns.dim() != 2 or columns.shape[1] != hidden:
        raise ValueError(f"contrastive_term: columns must be [M, {hidden}], got {tuple(columns.shape)}")
    if tuple(z.shape) != (rows, count) or tuple(w.shape) != (rows, count):
        raise ValueError(f"contrastive_term: z and w must be [{rows}, {count}], got {tuple(z.shape)}, {tuple(w.shape)}")
    if tuple(valid.shape) != (rows,) or tuple(groups.shape) != (rows,) or tuple(column_valid.shape) != (count,):
        raise ValueError("contrastive_term: valid and groups must be [N], column_valid [M]")
    widths = [int(width) for width in widths] or [hidden]
    for width in widths:
        if not 0 < width <= hidden:
            raise ValueError(f"contrastive_term: Matryoshka width {width} outside (0, {hidden}]")

    dtype = _math_dtype(embeddings.dtype, columns.dtype, log_inverse_temperature.dtype)
    valid = valid.bool()  # [N]
    column_valid = column_valid.bool()  # [M]
    scored = valid[:, None] & column_valid[None, :]  # [N, M]
    w = torch.where(scored, w.to(dtype), 0.0)  # [N, M]
    z = torch.where(scored, z.to(dtype), 0.0)  # [N, M]
    groups = torch.where(valid, groups.long(), 0)  # [N]; an empty slot's group is never read
    inverse_temperature = log_inverse_temperature.to(dtype).exp()[groups]  # [N]
    row_bias = bias.to(dtype)[groups]  # [N]
    if form == PairLossForm.Ranked:
        # The bias cancels in l_n - l_p; leaving it out (kept in the graph times zero) makes its gradient
        # an exact zero rather than rounding noise.
        row_bias = row_bias * 0.0
    # Empty slots are zeroed first, so that whatever their buffers hold cannot reach a gradient.
    rows_x = torch.where(valid[:, None], embeddings.to(dtype), 0.0)  # [N, D]
    columns_x = rows_x if same else torch.where(column_valid[:, None], columns.to(dtype), 0.0)  # [M, D]

    total = rows_x.new_zeros(())
    anchors = rows_x.new_zeros(())
    for width in widths:
        e = F.normalize(rows_x[:, :width], dim=1, eps=_NORMALIZE_EPS)  # [N, W]
        c = e if same else F.normalize(columns_x[:, :width], dim=1, eps=_NORMALIZE_EPS)  # [M, W]
        logits = inverse_temperature[:, None] * (e @ c.T) + row_bias[:, None]  # [N, M]
        term, anchors = pair_loss(logits, z, w, form, positives)
        total = total + term
    return Term(total / len(widths), anchors)


def world_pairs(
    z: Tensor, w: Tensor, rank: int, size: int, ambient: bool, ambient_weight: float
) -> tuple[Tensor, Tensor]:
    """A process's pair targets z, w [S, S] over its own slots widened to [S, size * S] over the world's
    (`size` processes): its own block at columns rank * S, every other column a pair across processes,
    which no edge names, so an ambient negative (-1 at `ambient_weight`) under `Negatives.Ambient` and
    unscored under `Named`. Empty slots (rows or columns) are masked by the loss."""
    slots = z.shape[0]
    if ambient:
        wide_z = z.new_full((slots, size * slots), -1.0)
        wide_w = w.new_full((slots, size * slots), float(ambient_weight))
    else:
        wide_z = z.new_zeros((slots, size * slots))
        wide_w = w.new_zeros((slots, size * slots))
    columns = slice(rank * slots, (rank + 1) * slots)
    wide_z[:, columns] = z
    wide_w[:, columns] = w
    return wide_z, wide_w


def contrastive_loss(
    embeddings: Tensor,
    valid: Tensor,
    groups: Tensor,
    log_inverse_temperature: Tensor,
    bias: Tensor,
    z: Tensor,
    w: Tensor,
    widths: Sequence[int],
    form: PairLossForm,
    columns: Tensor | None = None,
    column_valid: Tensor | None = None,
) -> Tensor:
    """`contrastive_term`'s total over its own anchor count (clamped at 1): the loss of one process alone."""
    total, anchors = contrastive_term(
        embeddings, valid, groups, log_inverse_temperature, bias, z, w, widths, form, columns, column_valid
    )
    return total / anchors.clamp_min(1)
