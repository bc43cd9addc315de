"""Splitting a model's parameters into flat units, and materialising meta parameters unit by unit.

Stages 1/2: parameters are packed into buckets of about ``reduce_bucket_elements`` in reverse
registration order (roughly the order backward produces their gradients), one set of buckets
per user parameter group. Stage 3: one unit per module group (children of ``nn.ModuleList`` by
default), the remaining parameters form the root unit, and parameters smaller than
``param_persistence_threshold`` go to resident buckets handled like stage 2. A parameter used by
two module groups (tied weights) belongs to the root unit, which stays gathered from forward
until backward ends.

With ``separate_root=True`` (chosen when parameters are offloaded, ZeRO-Infinity) every module
outside the module groups that owns parameters itself (the embedding, the output head) becomes a
module group of its own: gathered for its forward and again for its backward like a layer,
instead of staying gathered, with its gradient, through the whole backward inside the root unit.
That costs one more gather of those parameters per step (a file read when they are offloaded)
and bounds memory by the largest module instead of the sum of the root's. Tied parameters (an
embedding shared with the head) are used by two modules and stay in the root unit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.zero_sharding.config import ZeroConfig
from plait.zero_sharding.construction import ConstructedParameter, check_consistent, release
from plait.zero_sharding.low_precision import block_multiple
from plait.zero_sharding.tensor_parallel import local_numel, local_shape
from plait.zero_sharding.units import FlatUnit, ParamSlot


@dataclasses.dataclass
class OptionGroup:
    """One user parameter group: optimizer options and where it is sharded.

    Attributes:
        options: optimizer options of the group (``lr``, ``weight_decay``...).
        params: the group's parameters, in model order.
        group: process group to shard over.
        group_rank: this rank's index in ``group``.
        group_size: ranks in ``group``.
        replicas: identical copies of this group's state outside ``group`` (world / group for
            dense parameters, 1 for parameters that differ across the other ranks, e.g. experts).
        grad_divisor: what the group's summed gradients are divided by (``None``: its
            ``group_size``); see ``zero_grad_divisor`` in :func:`plait.zero_sharding.zero_shard`.
        reducer, gatherer: the group's own extension points (``None``: the engine's).
        placement: the group's own state placement (``None``: the engine's); see
            :mod:`plait.zero_sharding.placements`.
        global_of: ``(name, shape) -> (global name, global shape, dim-0 row offset)`` for
            parameters that are part of a larger global tensor (``None``: each is its own).
        state_dtype: the group's ``zero_state_dtype`` (``None``: ``ZeroConfig.optimizer_state_dtype``).
        master_dtype: the group's ``zero_master_dtype`` (``None``: ``ZeroConfig.master_dtype``).
        block: what its units' shard lengths must also be a multiple of (an inner optimizer's
            quantisation block, see :mod:`plait.zero_sharding.lowbit`; 1: nothing).
    """

    options: dict[str, Any]
    params: list[nn.Parameter]
    group: Any
    group_rank: int
    group_size: int
    replicas: int
    grad_divisor: float | None = None
    reducer: Any = None
    gatherer: Any = None
    global_of: Any = None
    placement: Any = None
    state_dtype: str | None = None
    master_dtype: torch.dtype | None = None
    block: int = 1


@dataclasses.dataclass
class Partition:
    """The result: units, and for stage 3 which module gathers which units.

    Attributes:
        units: every unit, in a stable order (keys ``u0``, ``u1``...).
        module_units: stage 3: module -> the sharded units it gathers in its hooks.
        root_units: stage 3: sharded units of the root (gathered forward to end of backward).
        unit_of: id(param) -> unit.
    """

    units: list[FlatUnit]
    module_units: dict[nn.Module, list[FlatUnit]]
    root_units: list[FlatUnit]
    unit_of: dict[int, FlatUnit]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its first fully qualified name (tied parameters appear once)."""
    return {id(p): name for name, p in model.named_parameters()}


def unit_modules(model: nn.Module, config: ZeroConfig) -> list[nn.Module]:
    """Stage 3 module groups, outer before inner (pre-order)."""
    if config.unit_classes:
        found = [m for m in model.modules() if type(m).__name__ in config.unit_classes and m is not model]
        if not found:
            raise ValueError(
                f"ZeroConfig.unit_classes={config.unit_classes} matched no module of {type(model).__name__}; "
                "use class names that occur in the model (e.g. the transformer block class) or leave it empty."
            )
        return found
    out = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            out.extend(module)
    return out


def _owners(model: nn.Module, modules: list[nn.Module]) -> dict[int, nn.Module | None]:
    """id(param) -> deepest unit module owning it, or None (root) when shared by unrelated units."""
    subtree = {id(m): {id(s) for s in m.modules()} for m in modules}
    owner: dict[int, nn.Module | None] = {}
    shared: set[int] = set()
    for module in modules:
        for p in module.parameters():
            prev = owner.get(id(p))
            if prev is None or id(module) in subtree[id(prev)]:
                owner[id(p)] = module  # first owner, or a deeper one nested in it
            elif id(prev) not in subtree[id(module)]:
                shared.add(id(p))
    for key in shared:
        owner[key] = None
    return owner


def _buckets(params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    size = limit
    for p in params:
        if size + local_numel(p) > limit and (not out or out[-1]):
            out.append([])
            size = 0
        out[-1].append(p)
        size += local_numel(p)
    return [b for b in out if b]


def root_modules(model: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """Modules outside every module group (and not ``model`` itself) that own parameters
    directly, in pre-order: the groups ``separate_root`` adds (embedding, head, final norm)."""
    inside = {id(sub) for module in modules for sub in module.modules()}
    return [m for m in model.modules()
            if m is not model and id(m) not in inside and any(p is not None for p in m._parameters.values())]


def build_partition(model: nn.Module, config: ZeroConfig, groups: list[OptionGroup],
                    init_fn: Callable[[nn.Module], None] | None, device: torch.device, *,
                    separate_root: bool = False, after_unit: Callable[[FlatUnit], None] | None = None) -> Partition:
    """Create and fill every unit (see the module docstring).

    Args:
        model: the model (parameters may be on the meta device).
        config: the engine config.
        groups: user parameter groups, every trainable and frozen parameter in exactly one.
        init_fn: called on a module whose meta parameters were just allocated; default
            ``module.reset_parameters()``.
        device: the compute device every unit's storage is allocated on.
        separate_root: stage 3: the root's own modules become module groups (see the module
            docstring).
        after_unit: called with each unit as soon as it is built, before the next one is (a
            placement that takes units over one at a time, so the model is never whole).

    Returns:
        The :class:`Partition`.

    Raises:
        ValueError: a meta parameter whose module has no ``reset_parameters`` and no ``init_fn``.
    """
    names = parameter_names(model)
    plans: list[tuple[list[nn.Parameter], OptionGroup, int, bool, nn.Module | None]] = []
    if config.stage < 3:
        for index, og in enumerate(groups):
            for bucket in _buckets(list(reversed(og.params)), config.reduce_bucket_elements):
                plans.append((bucket, og, index, True, None))
    else:
        modules = unit_modules(model, config)
        if separate_root:
            order = {id(m): i for i, m in enumerate(model.modules())}
            modules = sorted(modules + root_modules(model, modules), key=lambda m: order[id(m)])
        owner = _owners(model, modules)
        for index, og in enumerate(groups):
            small = [p for p in og.params if local_numel(p) < config.param_persistence_threshold]
            big = [p for p in og.params if local_numel(p) >= config.param_persistence_threshold]
            for module in [None, *modules]:
                members = [p for p in big if owner.get(id(p)) is module]
                if members:
                    plans.append((members, og, index, False, module))
            for bucket in _buckets(list(reversed(small)), config.reduce_bucket_elements):
                plans.append((bucket, og, index, True, None))
    check_consistent(model)  # before any slice is gathered: every rank built the same values
    materializer = _Materializer(model, init_fn, device)
    units, module_units, root_units, unit_of = [], {}, [], {}
    for params, og, index, resident, module in plans:
        slots, offset = [], 0
        for p in params:
            # A tensor-parallel (DTensor) parameter contributes its local TP shard only.
            slots.append(ParamSlot(names[id(p)], p, offset, local_numel(p), local_shape(p)))
            offset += local_numel(p)
        unit = FlatUnit(key=f"u{len(units)}", slots=slots, group=og.group, group_rank=og.group_rank,
                        group_size=og.group_size, resident=resident, compute_dtype=config.compute_dtype,
                        reduce_dtype=config.effective_reduce_dtype, option_index=index, replicas=og.replicas,
                        device=device,
                        shard_multiple=math.lcm(block_multiple(config, og.state_dtype), og.block))
        values = materializer.values_for(unit)
        master_dtype = og.master_dtype or config.master_dtype  # fp32 masters apart only under mixed precision
        unit.build(values, config.mixed_precision and master_dtype == torch.float32, config.stage,
                   owned=materializer.owned)
        values = None  # the unit holds what it needs: the next unit must not find this one's values alive
        materializer.done_with(unit)
        if after_unit is not None:
            after_unit(unit)
        units.append(unit)
        for slot in slots:
            unit_of[id(slot.param)] = unit
        if not resident:
            (root_units if module is None else module_units.setdefault(module, [])).append(unit)
    return Partition(units, module_units, root_units, unit_of)


class _Materializer:
    """Allocates and initialises meta parameters one owning module at a time."""

    def __init__(self, model: nn.Module, init_fn: Callable[[nn.Module], None] | None, device: torch.device) -> None:
        self.init_fn, self.device = init_fn, device
        self.owner_of: dict[int, nn.Module] = {}
        self.locations: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    self.owner_of.setdefault(id(p), module)
                    self.locations.setdefault(id(p), []).append((module, name))
        self.pending: dict[str, torch.Tensor] = {}
        self.owned = False  # see values_for

    def values_for(self, unit: FlatUnit) -> dict[str, torch.Tensor] | None:
        """Slot name -> whole value for a unit with constructed or meta parameters (``None``: the
        parameters hold their values). Sets :attr:`owned`: every value is a fresh tensor nothing
        else references (released slices, just-initialised meta parameters)."""
        self.owned = False
        if not any(slot.param.is_meta or isinstance(slot.param, ConstructedParameter) for slot in unit.slots):
            return None
        values = {}
        self.owned = True
        for slot in unit.slots:
            if isinstance(slot.param, ConstructedParameter):  # built under sharded_init: gather its slices
                values[slot.name] = release(slot.param)
                continue
            if slot.param.is_meta:
                self._materialize(self.owner_of[id(slot.param)])
                new = self._current(slot)
                slot.param = new
            else:
                self.owned = False  # a parameter the user built holds this value
            values[slot.name] = slot.param.detach()
        return values

    def _current(self, slot: ParamSlot) -> nn.Parameter:
        module, name = self.locations[id(slot.param)][0]
        return module._parameters[name]

    def _materialize(self, module: nn.Module) -> None:
        metas = {n: p for n, p in module._parameters.items() if p is not None and p.is_meta}
        if not metas:
            return
        if self.init_fn is None and not hasattr(module, "reset_parameters"):
            raise ValueError(
                f"{type(module).__name__} has meta parameters {sorted(metas)} but no reset_parameters(); "
                "pass init_fn=... to zero_shard to initialise it, or load weights with load_state_dict after."
            )
        for old in metas.values():
            new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=self.device),
                               requires_grad=old.requires_grad)
            for owner, attr in self.locations[id(old)]:  # tied parameters: replace every occurrence
                owner._parameters[attr] = new
            self.locations[id(new)] = self.locations[id(old)]
            self.owner_of[id(new)] = module
        with torch.no_grad():
            (self.init_fn or (lambda m: m.reset_parameters()))(module)

    def done_with(self, unit: FlatUnit) -> None:
        """Nothing is cached across units: values live only while their unit is built."""
        self.pending.clear()
