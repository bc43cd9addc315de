"""The variance floor under ZeRO: each tensor's mean variance, from the shards of a flat unit.

The floor (:mod:`plait.onebit_optim.rules.variance_floor`) raises every element's variance to at least
``ratio x mean(v)`` of its own tensor. Under ZeRO a rank holds one contiguous shard of a flat
unit (several tensors laid end to end, padded), so a tensor's elements are spread over shards
and its mean is not local. Each rank sums the pieces of every tensor it holds (float64, one
entry per tensor of the unit, zero for tensors outside its shard) and one all-reduce of that
vector over the unit's group gives every rank each tensor's total; divided by the tensor's
element count it is the mean the data-parallel optimizer takes over the whole tensor. Bytes per
call and unit: :func:`floor_nbytes`. The clamp itself is elementwise, so a shard floored with
these means holds the same values as the corresponding slice of the floored whole tensor (up to
the rounding of the mean: float64 partial sums here, torch's float32 mean there).

Where the whole unit is at hand (0/1 Adam's local-step phase gathers the unit's variance),
:func:`floor_unit_` takes the means locally, without communication.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.kernels import collectives


def floor_nbytes(tensors: int) -> int:
    """Logical bytes one floor all-reduce records per rank for a unit of ``tensors`` tensors: a
    float64 sum per tensor.

    Args:
        tensors: the unit's tensor (slot) count.

    Returns:
        ``8 x tensors``.
    """
    return 8 * tensors


def tensor_means(unit: Any, shard: torch.Tensor, *, name: str) -> torch.Tensor:
    """The mean of every tensor of ``unit`` over all its shards (float64, one entry per slot).

    Args:
        unit: the ZeRO unit (``slots``, ``local_pieces()``, ``group``, ``group_size``).
        shard: this rank's shard of a unit-shaped quantity (the variance), flat.
        name: who asks, for the collective's name in the flight log.

    Returns:
        The means, equal on every rank of the unit's group.
    """
    sums = torch.zeros(len(unit.slots), dtype=torch.float64)
    for slot, _, (slo, shi) in unit.local_pieces():
        sums[unit.slots.index(slot)] = shard[slo:shi].sum(dtype=torch.float64)
    if unit.group_size > 1:
        collectives.all_reduce(sums, group=unit.group, name=f"{name} variance-floor mean all-reduce of `{unit.key}`")
    counts = torch.tensor([max(slot.numel, 1) for slot in unit.slots], dtype=torch.float64)
    return sums / counts


def _shard_floors(unit: Any, shard: torch.Tensor, ratio: float, *, name: str) -> torch.Tensor:
    """A shard-shaped tensor holding, at every element, the floor of its tensor (0 on padding)."""
    floors = torch.zeros_like(shard)
    means = tensor_means(unit, shard, name=name)
    for slot, _, (slo, shi) in unit.local_pieces():
        floors[slo:shi] = float(means[unit.slots.index(slot)]) * ratio
    return floors


def floored_shard(unit: Any, exp_avg_sq: torch.Tensor, ratio: float, *, name: str) -> torch.Tensor:
    """:func:`~plait.onebit_optim.rules.variance_floor.floored` for a ZeRO shard: a new tensor whose
    every element is at least ``ratio x`` the mean of its own tensor (the same tensor, untouched,
    and no communication when ``ratio`` is 0).

    Args:
        unit: the ZeRO unit the shard belongs to.
        exp_avg_sq: this rank's variance shard.
        ratio: the fraction of the tensor's mean below which a variance is not trusted.
        name: the optimizer's name (flight log).

    Returns:
        The floored shard.
    """
    if ratio == 0:
        return exp_avg_sq
    return exp_avg_sq.clamp(min=_shard_floors(unit, exp_avg_sq, ratio, name=name))


def floor_shard_(unit: Any, exp_avg_sq: torch.Tensor, ratio: float, *, name: str) -> int:
    """:func:`~plait.onebit_optim.rules.variance_floor.floor_variance_` for a ZeRO shard: raise it to
    its floor in place (when the variance freezes).

    Args:
        unit, exp_avg_sq, ratio, name: as :func:`floored_shard`.

    Returns:
        How many elements of this shard were below the floor.
    """
    if ratio == 0:
        return 0
    floors = _shard_floors(unit, exp_avg_sq, ratio, name=name)
    below = int((exp_avg_sq < floors).sum())
    exp_avg_sq.clamp_(min=floors)
    return below


def floor_unit_(unit: Any, exp_avg_sq: torch.Tensor, ratio: float) -> int:
    """Raise a whole unit's variance (padded flat, every rank holding all of it) to each tensor's
    floor in place; the means are local, nothing is communicated.

    Args:
        unit: the ZeRO unit (``slots`` with ``offset`` and ``numel``).
        exp_avg_sq: the unit's whole variance, flat.
        ratio: as :func:`floored_shard`.

    Returns:
        How many elements were below the floor.
    """
    if ratio == 0:
        return 0
    below = 0
    for slot in unit.slots:
        part = exp_avg_sq[slot.offset:slot.offset + slot.numel]
        floor = float(part.sum(dtype=torch.float64) / max(slot.numel, 1)) * ratio
        below += int((part < floor).sum())
        part.clamp_(min=floor)
    return below
