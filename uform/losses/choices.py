"""Calibrated choices: the masked text head at an item's appended MASK, restricted to its legal bytes.

Shape legend: S segment slots (an item that makes a choice holds one), K `max_choices_per_item`,
V = 256 byte values.

    p = softmax over the legal bytes of the head's logits at the MASK
    term = KL(q || p) = sum_k q_k (log q_k - log p_k)   (terms with q_k = 0 add nothing)

The term is a sum over the slots that made a choice with their count, so the caller (or the world)
divides once. `choice_probabilities` is the same `p` the serving `text_choose` answers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .term import Term


def choice_log_probabilities(logits: Tensor, legal_bytes: Tensor, legal: Tensor) -> Tensor:
    """log p [S, K] over each slot's legal bytes (-inf where not legal, a finite 0 row where none is).

    logits [S, V] the masked text head at each slot's MASK; legal_bytes [S, K] int64 byte values (any
    value where not legal); legal [S, K] bool.
    """
    chosen = logits.float().gather(1, legal_bytes.long())  # [S, K]
    chosen = torch.where(legal, chosen, float("-inf"))
    any_legal = legal.any(dim=1, keepdim=True)  # [S, 1]
    # A row with no legal byte would be all -inf (NaN in log_softmax and its gradient); it is scored as
    # zeros instead and never read.
    chosen = torch.where(any_legal, chosen, 0.0)
    return torch.log_softmax(chosen, dim=1)  # [S, K]


def choice_probabilities(logits: Tensor, legal_bytes: Tensor, legal: Tensor) -> Tensor:
    """p [S, K]: softmax over each slot's legal bytes, exactly 0 where not legal."""
    return torch.where(legal, choice_log_probabilities(logits, legal_bytes, legal).exp(), 0.0)


def choices_sum(logits: Tensor, legal_bytes: Tensor, legal: Tensor, targets: Tensor, valid: Tensor) -> Term:
    """(sum over the slots that made a choice of KL(q || p), their count).

    logits [S, V]; legal_bytes, legal as in `choice_log_probabilities`; targets [S, K] the target
    probabilities q (0 where not legal); valid [S] 1 for a slot that made a choice, 0 otherwise.
    """
    log_p = choice_log_probabilities(logits, legal_bytes, legal)  # [S, K]
    q = targets.float()
    scored = legal & (q > 0)  # [S, K]
    # q log q - q log p, zeroed (before any arithmetic reaches a -inf) where q is 0 or the byte not legal.
    safe_q = torch.where(scored, q, 1.0)
    per_choice = torch.where(scored, q * (safe_q.log() - torch.where(scored, log_p, 0.0)), 0.0)  # [S, K]
    weight = valid.float()
    return Term((per_choice.sum(dim=1) * weight).sum(), weight.sum())
