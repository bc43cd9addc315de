"""LAMB's update rules as functions of tensors (1-bit LAMB, arXiv 2104.06069: no bias correction).

Shared by the plain :class:`~plait.onebit_optim.Lamb`, :class:`~plait.onebit_optim.OnebitLamb`
and 1-bit LAMB's ZeRO inner optimizer (:mod:`plait.onebit_optim.under_zero.onebit_lamb`): the
arithmetic is elementwise, so all give the same bits for the same elements.

**Norms that do not depend on how a tensor is cut.** The trust ratio and 1-bit LAMB's factor take
per-tensor norms. Under ZeRO a tensor is cut into shard pieces, a different cut at every world
size, and a floating-point sum of the pieces' squares depends on the cut and the order; a run
resumed at another world size then drifts from its reference in the last bits. So the norms here
are summed **exactly**: each element's square is exact in float64 (for fp32, bf16 and fp16
values), is written in fixed point below the tensor's largest magnitude (``2 x LIMB_BITS``
fractional bits, truncated per element), and the fixed-point values are summed as two int64
limbs, and integers add exactly in any order. The pieces of a tensor agree on its largest
magnitude first (a MAX, exact in any order), so the sum, and the norm computed from it in
float64, are the same bits for the whole tensor and for any cut into pieces. The truncation
loses less than ``2^-58`` of the largest square per element: a relative ``n 2^-58`` of the squared
norm for ``n`` elements (below 1e-9 for a billion elements), far below float32's resolution.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Bits per limb of the exact sums of squares: an element contributes < 2^LIMB_BITS to each limb,
# so an int64 limb sums 2^(63 - LIMB_BITS) = 2^33 elements of a tensor without overflow.
LIMB_BITS = 30


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
    weight_norm, update_norm = exact_norm(p), exact_norm(update)
    coeff = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
    coeff = min(max(coeff, min_coeff), max_coeff)
    p.add_(update, alpha=-group["lr"] * coeff)
    return coeff


def norm_exponent(max_abs: float) -> int:
    """The binary exponent ``e`` with ``max_abs < 2^e`` (0 for 0): the fixed-point position that
    every piece of a tensor uses, from the tensor's largest magnitude (finite)."""
    return math.frexp(max_abs)[1]


def square_limbs(x: torch.Tensor, exponent: int) -> torch.Tensor:
    """The sum of ``x``'s squares in fixed point, as ``[high, low]`` int64 limbs.

    Args:
        x: a tensor or a piece of one (finite, every ``|x| < 2^exponent``).
        exponent: :func:`norm_exponent` of the whole tensor's largest magnitude.

    Returns:
        ``[sum(high_i), sum(low_i)]`` where ``x_i^2 / 2^(2 exponent)``, truncated to
        ``2 LIMB_BITS`` fractional bits, is ``high_i 2^-LIMB_BITS + low_i 2^(-2 LIMB_BITS)``;
        limbs of a tensor's pieces add (exactly) to the limbs of the tensor.
    """
    scaled = x.detach().to(torch.float64).square_().mul_(2.0 ** (2 * LIMB_BITS - 2 * exponent))  # exact
    high = scaled.div(2.0 ** LIMB_BITS).floor_()
    low = scaled.sub_(high, alpha=2.0 ** LIMB_BITS).floor_()  # the remainder is exact; drop its fraction
    return torch.stack([high.sum(dtype=torch.int64), low.sum(dtype=torch.int64)])


def norm_from_limbs(limbs: torch.Tensor, exponent: int) -> float:
    """The L2 norm (float64) from a tensor's summed :func:`square_limbs` and its exponent."""
    total = float(limbs[0]) * 2.0 ** LIMB_BITS + float(limbs[1])
    return math.sqrt(total * 2.0 ** (2 * exponent - 2 * LIMB_BITS))


def exact_norm(x: torch.Tensor) -> float:
    """The L2 norm of a whole tensor, summed exactly (module docstring): bit for bit what a sharded
    tensor's pieces give through :func:`square_limbs` and :func:`norm_from_limbs`.

    Returns:
        The norm as a Python float; ``inf`` or ``nan`` when ``x`` holds one (nothing is summed then).
    """
    max_abs = float(x.detach().abs().max()) if x.numel() else 0.0
    if not math.isfinite(max_abs):
        return max_abs
    exponent = norm_exponent(max_abs)
    return norm_from_limbs(square_limbs(x, exponent), exponent)
