"""0/1 Adam's update rules (arXiv 2202.06009) as functions of tensors: the local update and the
resynchronisation after the averaged parameter change comes back. Shared by the data-parallel
optimizer (:mod:`plait.onebit_optim.data_parallel.adam01`) and its ZeRO form
(:mod:`plait.onebit_optim.under_zero.adam01`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.onebit_optim.rules.variance_floor import floored


def zero_one_update_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     group: dict[str, Any], *, variance: bool, variance_floor: float = 0.0,
                     floor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """One 0/1 Adam update of ``p`` in place: ``m <- beta1 m + (1 - beta1) g``, on variance steps
    ``v <- beta2 v + (1 - beta2) g^2``, then ``p <- p - lr (m / (sqrt(v) + eps) + wd p)``.

    Elementwise when ``variance_floor`` is 0, so :class:`ZeroOneAdam` (whole tensors) and its ZeRO
    form (flat shards and units, :mod:`plait.onebit_optim.under_zero.adam01`) give the same bits for
    the same elements. With a floor, ``v`` in the denominator is raised to at least
    ``variance_floor x mean(v)`` of the tensor (:mod:`plait.onebit_optim.rules.variance_floor`; the
    stored ``v`` is unchanged, it is still being averaged). ``floor``, when given, replaces that
    clamp: it maps ``v`` to the floored variance (the ZeRO form passes one that takes each
    tensor's mean across the shards, :mod:`plait.onebit_optim.under_zero.variance_floor`).
    """
    beta1, beta2 = group["betas"]
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    if variance:
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    divisor = floor(exp_avg_sq) if floor is not None else floored(exp_avg_sq, variance_floor)
    update = exp_avg / (divisor.sqrt() + group["eps"])
    if group["weight_decay"]:
        update.add_(p, alpha=group["weight_decay"])
    p.sub_(update, alpha=group["lr"])


def resynchronise_(p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, anchor: torch.Tensor,
                   change: torch.Tensor, eps: float, lr_sum: float) -> None:
    """After the averaged parameter ``change`` since the last synchronisation came back: the
    momentum becomes ``-change x (sqrt(v) + eps) / sum(lr)`` and ``p`` and ``anchor`` become
    ``anchor + change`` (module docstring)."""
    denom = exp_avg_sq.sqrt().add_(eps)
    exp_avg.copy_(change.mul(denom)).div_(-lr_sum)
    p.copy_(anchor.add_(change))
