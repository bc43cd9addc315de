"""``gathered_parameters``: whole parameters for a scope (``deepspeed.zero.GatheredParameters``).

Two forms share the name:

* ``gathered_parameters(model)``: every parameter of a sharded model is whole and the engine's
  hooks neither gather nor free (generation without per-token gathering); ``writeback=True``
  writes edits every rank made back into shards and fp32 masters.
* ``gathered_parameters(params, modifier_rank=None, enabled=True)``: only the units holding
  ``params`` are gathered, and kept gathered while the scope lasts whatever the hooks do (a
  parameter read outside its module's forward: a tied weight read by a loss). With
  ``modifier_rank`` set, that rank's in-place edits are broadcast over each unit's group on exit
  and written into every rank's shard and master. Parameters no ZeRO engine manages are left
  alone.

Gradients: a parameter used inside the scope has its gradient reduced through the usual hooks
when backward runs inside the scope too. A backward after the scope closed would read released
(zero-sized) parameters, as under DeepSpeed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# id(parameter) -> weak references to (the parameter, its engine, its unit). Not an attribute
# on the parameter (pickling a parameter would then try to pickle a weak reference), and not a
# WeakKeyDictionary (those compare keys with ``==``, which for tensors is elementwise).
_owners: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref]] = {}


def register_owner(engine: Any) -> None:
    """Record which engine and unit manage each parameter of ``engine`` (weakly).

    Args:
        engine: a :class:`~plait.zero_sharding.engine.ZeroEngine` whose units are built.
    """
    ref = weakref.ref(engine)
    for unit in engine.units:
        for slot in unit.slots:
            key = id(slot.param)
            if key not in _owners:
                weakref.finalize(slot.param, _owners.pop, key, None)
            _owners[key] = (weakref.ref(slot.param), ref, weakref.ref(unit))


def _owner(param: Any) -> tuple[Any, Any] | None:
    """``(engine, unit)`` managing ``param``, or ``None``."""
    entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    engine, unit = entry[1](), entry[2]()
    return None if engine is None or unit is None else (engine, unit)


def _owned_units(params: Any) -> list[tuple[Any, Any]]:
    """``(engine, unit)`` for every distinct unit holding one of ``params``, in unit order."""
    if isinstance(params, torch.Tensor):
        params = [params]
    if not isinstance(params, Iterable):
        raise TypeError(f"gathered_parameters: `params` must be a parameter, an iterable of parameters or a "
                        f"model returned by zero_shard, not {type(params).__name__}.")
    seen: dict[int, tuple[Any, Any]] = {}
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"gathered_parameters: `params` holds a {type(p).__name__}; pass parameters "
                            f"(e.g. model.lm_head.weight or list(module.parameters())).")
        owner = _owner(p)
        if owner is not None:
            seen.setdefault(id(owner[1]), owner)
    return sorted(seen.values(), key=lambda eu: int(eu[1].key[1:]))


def _check_rank(units: list[tuple[Any, Any]], modifier_rank: int | None) -> None:
    if modifier_rank is None:
        return
    for _, unit in units:
        if not 0 <= modifier_rank < unit.group_size:
            raise ValueError(f"gathered_parameters: modifier_rank={modifier_rank} is not a rank of the parameters' "
                             f"group (size {unit.group_size}); pass a rank in 0..{unit.group_size - 1}.")


@torch.no_grad()
def _broadcast(unit: Any, modifier_rank: int) -> None:
    """Make ``unit.full`` equal to ``modifier_rank``'s copy on every rank of the unit's group."""
    if unit.group_size == 1 or not dist.is_initialized():
        return
    src = dist.get_global_rank(unit.group, modifier_rank)
    dist.broadcast(unit.full, src=src, group=unit.group)


@contextlib.contextmanager
def _scoped(units: list[tuple[Any, Any]], modifier_rank: int | None) -> Iterator[None]:
    fresh = []
    for engine, unit in units:
        if not unit.gathered:
            fresh.append(unit)
        unit.gather(engine.gatherer, "step")  # exact values, even under a quantized gatherer
        unit.held += 1
    try:
        yield
    finally:
        for _, unit in units:
            unit.held -= 1
        if modifier_rank is not None:
            for engine, unit in units:
                _broadcast(unit, modifier_rank)
                engine.write_back([unit])
        for _, unit in units:
            if unit in fresh and not unit.held and not _busy(unit):
                unit.release()


def _busy(unit: Any) -> bool:
    """Whether a unit gathered in the scope is now in use elsewhere (all pinned by the model-wide form)."""
    owner = _owner(unit.slots[0].param)
    return owner is not None and bool(owner[0].pinned)


def gathered_parameters(params: Any, modifier_rank: int | None = None, enabled: bool = True, *,
                        writeback: bool = False) -> contextlib.AbstractContextManager[None]:
    """Whole parameters for the ``with`` block (see the module docstring).

    Args:
        params: a model returned by :func:`~plait.zero_sharding.zero_shard` (every parameter), one
            parameter, or an iterable of parameters; parameters ZeRO does not manage are ignored.
        modifier_rank: the rank (within the parameters' sharding group; the global rank when they
            are sharded over the whole world) whose in-place edits are kept: broadcast to every
            rank and written into shards and fp32 masters on exit. ``None``: read-only (edits
            made to sharded parameters are dropped on exit).
        enabled: ``False`` makes the block a no-op.
        writeback: model form only: write back the edits every rank made identically.

    Returns:
        A context manager.

    Raises:
        TypeError: ``params`` is none of the above.
        ValueError: ``modifier_rank`` is outside the parameters' group, or ``writeback`` is given
            with parameters (use ``modifier_rank``).
    """
    if not enabled:
        return contextlib.nullcontext()
    engine = getattr(params, "zero_engine", None)
    if isinstance(params, nn.Module) and engine is not None and modifier_rank is None:
        return engine.gathered(writeback)
    if isinstance(params, nn.Module) and engine is None:
        raise TypeError(f"{type(params).__name__} is not sharded; call zero_shard(model, ...) first, or pass "
                        f"its parameters (list(model.parameters())).")
    if writeback:
        raise ValueError("gathered_parameters: `writeback` applies to a whole model; with parameters pass "
                         "modifier_rank=<the rank whose edits to keep>.")
    units = _owned_units(params.parameters() if isinstance(params, nn.Module) else params)
    _check_rank(units, modifier_rank)
    return _scoped(units, modifier_rank)
