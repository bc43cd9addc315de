"""The variance floor: what the compressed optimizers do with a variance too small to trust.

Adam divides the momentum by ``sqrt(v) + eps``. Where ``v`` is a running average the two move
together: an element with a tiny variance also has a tiny momentum. Once the variance is frozen
(1-bit Adam after ``freeze_step``, 0/1 Adam after ``var_freeze_step``, and 0/1 Adam between its
rare variance updates) that link is gone. An element the frozen variance never saw (the
embedding row of a token absent from the first steps) or saw rarely has ``v`` near 0, while its
momentum is no longer near 0:

* the 1-bit exchange gives every element of a chunk the same magnitude (the tensor's scale), so
  an element whose true momentum is 0 still gets ``+-scale``;
* a token seen for the first time after the freeze brings a real gradient.

Its update is then ``|m| / eps``, up to ``1e8 |m|``: the loss explodes within a few steps
(1-bit Adam with ``freeze_step=2``, 0/1 Adam with a 3-step variance phase, at W=1 too).

**The floor.** Before such a variance is used, every element's ``v`` is raised to at least
``ratio x mean(v)`` of its own tensor. Why this bound: the exchanged momentum of an element is
at most about the tensor's RMS momentum ``sqrt(mean(m^2))``, and for Adam's averages
``mean(m^2) <= mean(v)`` (``m`` averages the gradient, ``v`` its square; Jensen's inequality per
element, equal weights up to the betas). So the largest step of a floored element is about
``lr sqrt(mean(m^2)) / sqrt(ratio mean(v)) <= lr / sqrt(ratio)``: at most about 32x Adam's usual
per-element step bound of ``lr`` with 1-bit Adam's default ``ratio=0.001``, 10x with 0/1 Adam's
``0.01``, instead of ``1e8``. A floored element
is no longer the largest of its tensor by orders of magnitude, so it cannot set the tensor's
shared 1-bit scale either (0/1 Adam exchanges parameter changes, which the floor bounds the
same way), and its error feedback stays within a bounded multiple of that scale.

Where every element already has ``v >= ratio x mean(v)`` the clamp returns the same values and
the optimizer is the published algorithm bit for bit. ``ratio=0`` turns the floor off.

The floor is a per-tensor statistic. Under ZeRO a shard holds pieces of flat units; each
tensor's mean is then summed across the shards (:mod:`plait.onebit_optim.under_zero.variance_floor`)
and the same clamp applies.
"""

from __future__ import annotations

import torch


def variance_floor(exp_avg_sq: torch.Tensor, ratio: float) -> torch.Tensor:
    """``ratio x mean(exp_avg_sq)``, as a 0-dimensional tensor (no host synchronisation).

    Args:
        exp_avg_sq: one parameter's variance (Adam's ``exp_avg_sq``).
        ratio: the fraction of the mean (``>= 0``).

    Returns:
        The floor.
    """
    # Summed in float64, so that a ZeRO shard's partial sums, all-reduced, give the same floor
    # after rounding (:mod:`plait.onebit_optim.under_zero.variance_floor`).
    mean = exp_avg_sq.sum(dtype=torch.float64) / max(exp_avg_sq.numel(), 1)
    return mean.mul_(ratio).to(exp_avg_sq.dtype)


def floored(exp_avg_sq: torch.Tensor, ratio: float) -> torch.Tensor:
    """``exp_avg_sq`` with every element raised to at least :func:`variance_floor` (a new tensor;
    the same tensor, untouched, when ``ratio`` is 0).

    Args:
        exp_avg_sq: one parameter's variance.
        ratio: the fraction of the tensor's mean below which a variance is not trusted.

    Returns:
        The floored variance.
    """
    if ratio == 0:
        return exp_avg_sq
    return exp_avg_sq.clamp(min=variance_floor(exp_avg_sq, ratio))


def floor_variance_(exp_avg_sq: torch.Tensor, ratio: float) -> int:
    """Raise ``exp_avg_sq`` to its floor in place (when it freezes) and count the raised elements.

    Args:
        exp_avg_sq: one parameter's variance, about to be frozen.
        ratio: as :func:`floored`.

    Returns:
        How many elements were below the floor.
    """
    if ratio == 0:
        return 0
    floor = variance_floor(exp_avg_sq, ratio)
    below = int((exp_avg_sq < floor).sum())
    exp_avg_sq.clamp_(min=floor)
    return below
