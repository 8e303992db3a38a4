"""The learning-rate schedule and the optimizer.

Schedule: linear warmup from zero to the peak over `warmup_steps`, then a half cosine from the peak to
the floor over the remaining `steps - warmup_steps`, then the floor; step numbers count from one across
resumes, so a resumed run continues the same curve.

Optimizer: AdamW (Loshchilov & Hutter 2019) with betas (0.9, 0.98) and epsilon 1e-6, RoBERTa's choice
for transformer pretraining at large batch (the lower beta2 reacts faster to the loss spikes of early
training than 0.999); weight decay 0.01 on the matrices of the tower and heads only: embedding rows,
norms, biases and the learnable temperatures and biases of the contrastive groups are not decayed (a
decayed temperature is pulled toward 1, fighting the loss). The fused kernel on CUDA; on CPU the
for-each implementation, whose arithmetic is deterministic.

An update happens whole or not at all (`Optimizer.step_unless`): a step whose loss or gradients hold a NaN
or an infinity (`nonfinite`), or whose learning rate would carry the update out of float32
(`rate_overflows`), leaves every weight, moment and step counter as it was. Parameters no gradient reached
(`reach`: a media modality's input and head in a step without its units, late interaction's head in a
step without query or document tokens) are left alone as torch.optim
leaves a parameter whose `grad` is None: no decay, no moment update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..config import Schedule

BETAS = (0.9, 0.98)
EPSILON = 1e-6
WEIGHT_DECAY = 0.01


def learning_rate(schedule: Schedule, step: int) -> float:
    """The learning rate applied at optimizer step `step` (counted from one)."""
    peak, floor = schedule.learning_rate, schedule.min_learning_rate
    warmup = schedule.warmup_steps
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    span = schedule.steps - warmup
    if span <= 0 or step >= schedule.steps:
        return floor
    progress = (step - warmup) / span
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decays(name: str, parameter: nn.Parameter) -> bool:
    """Matrices decay; embeddings, norms, biases and temperatures do not."""
    return parameter.ndim >= 2 and not name.startswith(("embed.", "temperatures."))


LATE = "late"
"""The `reach` part of late interaction's token head and temperatures."""


def reach(name: str) -> str | None:
    """The part of the network that only some steps reach, for parameter `name`: "media.<kind>" (a media
    modality's unit and mask embeddings) or "reconstruct.<kind>" (its reconstruction head), reached only by
    a step holding units of that kind; "late" (the token head and late temperatures), reached only by a step
    holding both query and document tokens; None for every other parameter. A step without a part's inputs
    still runs its modules over inert padding, whose gradients are exact zeros: that is not a gradient."""
    parts = name.split(".")
    if parts[0] in ("token_head", "late_temperatures"):
        return LATE
    return ".".join(parts[:2]) if parts[0] in ("media", "reconstruct") and len(parts) > 2 else None


class Optimizer(torch.optim.AdamW):
    """AdamW whose parameter groups each hold one `reach` part (the "reach" key, None for the rest), so that
    a device-side flag can skip one part's update without the host reading it (`step_unless`)."""

    def step_unless(self, skips: Sequence[Tensor | None]) -> None:
        """One step of every group, group g's skipped on the device where `skips[g]` (a 0-d float32 flag on
        the parameters' device, fused kernel only) is 1: its weights and moments are not written and its step
        counters go back (torch's GradScaler protocol, `found_inf`). None: the group steps as `step` does."""
        groups = self.param_groups
        try:
            for group, skip in zip(groups, skips, strict=True):
                self.param_groups = [group]
                if skip is None:
                    self.__dict__.pop("found_inf", None)
                else:
                    self.found_inf = skip
                super().step()
        finally:
            self.param_groups = groups
            self.__dict__.pop("found_inf", None)


def build_optimizer(network: nn.Module, device: torch.device) -> Optimizer:
    """AdamW over `network`: a decayed and a plain group per `reach` part."""
    groups: dict[tuple[str | None, bool], list[nn.Parameter]] = {}
    for name, p in network.named_parameters():
        groups.setdefault((reach(name), decays(name, p)), []).append(p)
    cuda = device.type == "cuda"
    return Optimizer(
        [
            {"params": params, "weight_decay": WEIGHT_DECAY if decayed else 0.0, "reach": part}
            for (part, decayed), params in groups.items()
        ],
        lr=0.0,
        betas=BETAS,
        eps=EPSILON,
        fused=cuda or None,
        foreach=None if cuda else True,
    )


def rate_overflows(rate: float) -> bool:
    """Whether AdamW's update at learning rate `rate` can leave float32 whatever the gradients: its largest
    step size is rate / (1 - beta1) (a parameter's first update, whose bias correction is 1 - beta1), and
    torch either raises part-way through the groups converting it (for-each) or writes infinities (fused)."""
    largest = torch.finfo(torch.float32).max
    return not math.isfinite(rate) or rate / (1.0 - BETAS[0]) > largest or rate * WEIGHT_DECAY > largest


def nonfinite(grads: list[Tensor], loss: Tensor) -> Tensor:
    """A 0-d float32 flag on the loss's device: 1 when `loss` or any gradient holds a NaN or an infinity.
    GradScaler's check (one fused kernel per dtype, the gradients multiplied by exactly 1); no host read."""
    flag = (~torch.isfinite(loss.detach().float())).float().reshape(())
    one = torch.ones((), device=flag.device)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, flag, one)
    return flag
