"""1-bit Adam's update rules as functions of tensors: the warm-up step (torch's own AdamW kernel,
so the warm-up is DDP + ``torch.optim.AdamW`` bit for bit) and the compressed-phase update with
the frozen variance. Shared by the data-parallel optimizer
(:mod:`plait.onebit_optim.data_parallel.onebit_adam`) and its ZeRO form
(:mod:`plait.onebit_optim.under_zero.onebit_adam`), so both give the same bits for the same elements.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.adam import adam as torch_adam


def adam_state(state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """``state`` (one parameter's optimizer state) with Adam's entries, created on first use.

    The names, dtypes and the float32 step tensor are torch's Adam's, so states compare directly.
    """
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def adamw_step(states: Any, params: list[torch.Tensor], group: dict[str, Any]) -> None:
    """The warm-up step: torch's own AdamW kernel over ``params`` (those with a gradient)."""
    if not params:
        return
    per_param = [adam_state(states[p], p) for p in params]
    beta1, beta2 = group["betas"]
    torch_adam(params, [p.grad for p in params], [s["exp_avg"] for s in per_param],
               [s["exp_avg_sq"] for s in per_param], [], [s["step"] for s in per_param],
               decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
               weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def frozen_denominator(exp_avg_sq: torch.Tensor, group: dict[str, Any], freeze_step: int) -> torch.Tensor:
    """``sqrt(v / (1 - beta2^freeze_step)) + eps`` of a variance frozen at ``freeze_step``, computed
    as :func:`frozen_variance_update` does (a new tensor): constant while the variance is frozen."""
    beta2, eps = group["betas"][1], group["eps"]
    return exp_avg_sq.sqrt().div_(math.sqrt(1 - beta2 ** freeze_step)).add_(eps)


def frozen_variance_update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], freeze_step: int,
                           denom: torch.Tensor | None = None) -> None:
    """One compressed-phase update of ``p`` from its synchronised ``exp_avg`` and the variance frozen at
    ``freeze_step`` (bias-corrected as of that step), with decoupled weight decay.

    Args:
        p, state, group, freeze_step: the parameter, its state, options and the freeze step.
        denom: :func:`frozen_denominator` of ``state["exp_avg_sq"]`` when the caller keeps it (the
            same bits; saves its square root every step), else computed here.
    """
    beta1 = group["betas"][0]
    lr, weight_decay = group["lr"], group["weight_decay"]
    state["step"] += 1
    step_size = lr / (1 - beta1 ** state["step"].item())
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    if denom is None:
        denom = frozen_denominator(state["exp_avg_sq"], group, freeze_step)  # one temporary
    p.addcdiv_(state["exp_avg"], denom, value=-step_size)
