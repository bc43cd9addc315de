"""``freeze_step="auto"`` (and the early-freeze warning) under ZeRO stages 1 and 2.

The decision is :class:`plait.onebit_optim.rules.settle.FreezePoint`'s, on the same statistic as in plain
data parallel: per tensor, the sum of its bias-corrected variance ``sum(v) / (1 - beta2^t)``.
What changes under ZeRO is where the variance lives: a rank holds one contiguous shard of each
flat unit (several tensors end to end), so a tensor's elements may be split across shard
boundaries and ranks. Each rank sums the pieces of every tensor it holds (float64, zero for
tensors outside its shards), and **one all-reduce of that float64 vector** over ZeRO's group
gives every rank every tensor's sum: ``8 x tensors`` bytes per observed warm-up step
(:func:`settle_nbytes`), every warm-up step with ``"auto"``, the last ``window + 1`` warm-up steps
with a fixed ``freeze_step`` (the warning). Every rank then holds the same sums and takes the same
decision. The warm-up is plain Adam (LAMB) on averaged gradients, so the variance, and with it
the chosen step, is the plain data-parallel optimizer's; the sums differ from its only in the
float64 rounding of adding a tensor's pieces.

The decision and its observations are saved with the exchange's ``ext.onebit.*`` checkpoint
pieces (:func:`freeze_pieces`), so a run resumed mid-warm-up decides as the original would.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.kernels import collectives
from plait.kernels.sharded_state import ShardedTensor, ShardSpec
from plait.onebit_optim.rules.settle import FreezePoint

META, HISTORY = "ext.onebit.freeze.meta", "ext.onebit.freeze.history"


def settle_nbytes(tensors: int) -> int:
    """Logical bytes one observation's all-reduce records per rank: a float64 sum per tensor.

    Args:
        tensors: the number of tensors (slots) over all ZeRO units.

    Returns:
        ``8 x tensors``.
    """
    return 8 * tensors


def shard_variance_sums(units: list[Any], optimizer: torch.optim.Optimizer, masters: dict[str, torch.Tensor],
                        *, name: str) -> list[float]:
    """Every tensor's summed bias-corrected variance, from this rank's shards (one all-reduce).

    Args:
        units: the ZeRO units, in a fixed order (the same on every rank); their tensors are
            numbered unit by unit, slot by slot.
        optimizer: the inner optimizer over the master shards (its state holds ``exp_avg_sq``
            and ``step`` per master; its groups ``betas``).
        masters: ``{unit key: master shard}``.
        name: who asks, for the collective's name in the flight log.

    Returns:
        One float64 sum per tensor, equal on every rank of ZeRO's group.
    """
    tensors = sum(len(unit.slots) for unit in units)
    sums = torch.zeros(tensors, dtype=torch.float64)
    corrections = torch.ones(tensors, dtype=torch.float64)
    offset = 0
    for unit in units:
        state = optimizer.state.get(masters[unit.key]) or {}
        variance = state.get("exp_avg_sq")
        if variance is not None:  # every rank steps every master, so this holds on all or none
            beta2 = optimizer.param_groups[unit.option_index]["betas"][1]
            corrections[offset:offset + len(unit.slots)] = 1 - beta2 ** float(state["step"])
            for slot, _, (slo, shi) in unit.local_pieces():
                sums[offset + unit.slots.index(slot)] += variance[slo:shi].sum(dtype=torch.float64).cpu()
        offset += len(unit.slots)
    if units and units[0].group_size > 1:
        collectives.all_reduce(sums, group=units[0].group, name=f"{name} variance-settle all-reduce")
    return (sums / corrections).tolist()


def freeze_pieces(point: FreezePoint, tensors: int, everyone: tuple[int, ...]) -> dict[str, ShardedTensor]:
    """The freeze point as two replicated checkpoint pieces (the same on every rank).

    ``ext.onebit.freeze.meta``: int64 ``[chosen step or -1, observations kept, warned]``;
    ``ext.onebit.freeze.history``: float64, ``window + 1`` rows of ``tensors`` sums laid end to
    end (flat, as replicated pieces are), the kept observations first.
    A load fills these tensors in place; :func:`load_freeze_pieces` reads them back.

    Args:
        point: the exchange's freeze point.
        tensors: the number of tensors (slots) over all units.
        everyone: the ranks holding a replica (all of them).

    Returns:
        ``{piece name: ShardedTensor}``.
    """
    state = point.state_dict()
    meta = torch.tensor([-1 if state["step"] is None else state["step"], len(state["history"]), int(state["warned"])],
                        dtype=torch.int64)
    history = torch.zeros((point.settle.window + 1) * tensors, dtype=torch.float64)
    for row, sums in enumerate(state["history"]):
        history[row * tensors:(row + 1) * tensors] = torch.tensor(sums, dtype=torch.float64)
    return {name: ShardedTensor(ShardSpec.full(name, value, kind="other", replica_ranks=everyone), value)
            for name, value in ((META, meta), (HISTORY, history))}


def load_freeze_pieces(point: FreezePoint, pieces: dict[str, ShardedTensor]) -> None:
    """Restore ``point`` from the pieces :func:`freeze_pieces` returned, after a load filled them.

    Args:
        point: the exchange's freeze point.
        pieces: the pieces (the ``ext.onebit.freeze.*`` entries are read; a state without them
            leaves ``point`` as it is).
    """
    if META not in pieces:
        return
    meta = pieces[META].local.tolist()
    history = pieces[HISTORY].local.view(point.settle.window + 1, -1)
    point.load_state_dict({"step": None if meta[0] < 0 else int(meta[0]),
                           "history": [history[row].tolist() for row in range(int(meta[1]))],
                           "warned": bool(meta[2])})
