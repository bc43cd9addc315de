"""LAMB's update rules as functions of tensors (1-bit LAMB, arXiv 2104.06069: no bias correction).

Shared by the plain :class:`~plait.onebit_optim.Lamb`, :class:`~plait.onebit_optim.OnebitLamb`
and 1-bit LAMB's ZeRO inner optimizer (:mod:`plait.onebit_optim.under_zero.onebit_lamb`): the
arithmetic is elementwise, so all give the same bits for the same elements.
"""

from __future__ import annotations

from typing import Any

import torch


def lamb_state(state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """``state`` (one parameter's optimizer state) with LAMB's entries (an int step), created on first use."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def lamb_direction_(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """Advance ``state``'s step and moments with ``p.grad`` (in place) and return LAMB's update
    before its trust ratio: ``m / (sqrt(v) + eps) + weight_decay * p``.

    Shared by :class:`Lamb` (whole tensors) and 1-bit LAMB under ZeRO (shard pieces of flat
    masters, :mod:`plait.onebit_optim.under_zero.onebit_lamb`): the arithmetic is elementwise, so both give
    the same bits for the same elements.
    """
    beta1, beta2 = group["betas"]
    state["step"] += 1
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
    update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
    if group["weight_decay"]:
        update.add_(p, alpha=group["weight_decay"])
    return update


def frozen_lamb_direction(p: torch.Tensor, state: dict[str, Any], momentum: torch.Tensor, last_momentum: torch.Tensor,
                          group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressed-phase part of 1-bit LAMB that is elementwise, shared by :class:`OnebitLamb`
    and its ZeRO inner optimizer.

    The averaged gradient of the step is recovered from how the synchronised momentum moved
    (``last_momentum``, consumed in place, to ``momentum``) and updates the fresh variance
    ``state["exp_avg_sq_fresh"]``; ``state["exp_avg"]`` becomes ``momentum``.

    Returns:
        ``(denominator, preliminary update, update)``: ``sqrt(v_frozen) + eps``,
        ``m / denominator`` and that plus ``weight_decay * p``.
    """
    beta1, beta2 = group["betas"]
    eps, weight_decay = group["eps"], group["weight_decay"]
    state["step"] += 1
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    fresh = state.setdefault("exp_avg_sq_fresh", exp_avg_sq.clone())
    grad = (momentum - last_momentum.mul_(beta1)).div_(1 - beta1)
    if exp_avg is not momentum:
        exp_avg.copy_(momentum)
    fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = exp_avg_sq.sqrt().add_(eps)
    prelim = exp_avg / denom
    update = prelim.add(p, alpha=weight_decay) if weight_decay else prelim
    return denom, prelim, update


def lamb_update_(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], max_coeff: float,
                 min_coeff: float) -> float:
    """One LAMB step of ``p`` from ``p.grad``, in place; returns the trust ratio it used.

    Args:
        p: the parameter (its ``grad`` is the gradient to apply).
        state: its state (``exp_avg``, ``exp_avg_sq``, ``step``), created when empty.
        group: its param group (``lr``, ``betas``, ``eps``, ``weight_decay``).
        max_coeff, min_coeff: the trust ratio's bounds.

    Returns:
        The clamped trust ratio ``||p|| / ||update||`` (1 where either norm is 0).
    """
    update = lamb_direction_(p, lamb_state(state, p), group)
    weight_norm, update_norm = p.norm().item(), update.norm().item()
    coeff = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
    coeff = min(max(coeff, min_coeff), max_coeff)
    p.add_(update, alpha=-group["lr"] * coeff)
    return coeff
