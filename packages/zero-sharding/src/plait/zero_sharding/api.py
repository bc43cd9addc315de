"""The public API: ``zero_shard``, ``sharded_init`` (and ``gathered_parameters``, from :mod:`.scoped_gather`).

``zero_shard(model, optimizer, config, mesh=...)`` modifies ``model`` in place (its class becomes
a :class:`~plait.zero_sharding.module.ZeroModule` subclass, as ``fully_shard`` does) and returns it
with a :class:`~plait.zero_sharding.optimizer.ZeroOptimizer`. The user's forward,
``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()`` and LR schedulers stay as they
are. Everything that can be wrong with the input is checked before anything is allocated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.kernels.mesh import complement_dims, flat_group
from plait.zero_sharding.composition import notify
from plait.zero_sharding.config import ZeroConfig
from plait.zero_sharding.construction import ConstructedParameter, ConstructionGroup, slice_parameter
from plait.zero_sharding.engine import ZeroEngine
from plait.zero_sharding.extension import DefaultGatherer, DefaultReducer, LocalPlacement
from plait.zero_sharding.loss_scaler import LossScaler
from plait.zero_sharding.low_precision import check_composes, group_master_dtype, group_state_dtype, wrap_low_precision
from plait.zero_sharding.lowbit import lowbit_block_size
from plait.zero_sharding.module import ZeroModule, install
from plait.zero_sharding.optimizer import ZeroOptimizer
from plait.zero_sharding.partition import OptionGroup, build_partition
from plait.zero_sharding.placements import GroupedPlacement
from plait.zero_sharding.scoped_gather import gathered_parameters  # noqa: F401  (public here too)
from plait.zero_sharding.tensor_parallel import check_tensor_parallel
from plait.zero_sharding.validation import check_no_compiled_autograd, check_optimizer, check_same_across_ranks
from plait.zero_sharding.whole_tensor import WholeTensorPlacement, check_placement, is_whole_tensor, update_cost
from plait.zero_sharding.zeropp.config import make_zeropp_policies
from plait.zero_sharding.zeropp.exact import HierarchicalReducer
from plait.zero_sharding.zeropp.nodes import NODE_VARIABLES, detect_layout

_before_sharding: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_init_mesh: list[Any] = []


DEFAULT_SHARD_DIMS = ("dp", "sp")


def resolve_group(mesh: Any, config: ZeroConfig) -> Any:
    """The process group to shard over (see :func:`resolve_groups`)."""
    return resolve_groups(mesh, config)[0]


def resolve_groups(mesh: Any, config: ZeroConfig) -> tuple[Any, Any]:
    """``(shard group, replicate group or None)``: a 1-D mesh's group, the flattened
    ``shard_dims`` of an N-D mesh (sequence-parallel ranks count as data-parallel) with the other
    dimensions flattened into the replicate group (HSDP), a process group, or the world.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an N-D mesh without any of the shard dimensions, or an explicit
            ``config.shard_dims`` naming a dimension the mesh does not have.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "zero_shard needs torch.distributed initialised (torchrun, or dist.init_process_group('gloo'|'nccl')) "
            "before sharding; a single process uses world size 1."
        )
    if mesh is None:
        return dist.group.WORLD, None
    if not isinstance(mesh, DeviceMesh):
        return mesh, None
    if mesh.ndim == 1:
        return mesh.get_group(), None
    names = mesh.mesh_dim_names or ()
    unknown = [d for d in config.shard_dims or () if d not in names]
    if unknown:
        raise ValueError(f"ZeroConfig.shard_dims={config.shard_dims} names {unknown}, which the mesh (dimensions "
                         f"{names}) does not have; name only its dimensions, or leave shard_dims=None.")
    dims = tuple(name for name in names if name in (config.shard_dims or DEFAULT_SHARD_DIMS))
    if not dims:
        raise ValueError(
            f"mesh has dimensions {names} but none is a ZeRO shard dimension (shard_dims={config.shard_dims}, "
            f"default {DEFAULT_SHARD_DIMS}); pass mesh['dp'] or set shard_dims to the data-parallel dimension names."
        )
    replicate = complement_dims(mesh, dims)
    return flat_group(mesh, dims), (flat_group(mesh, replicate) if replicate else None)


def compute_device(model: nn.Module, mesh: Any) -> torch.device:
    """Where units live: the mesh's device type, else the model's (non-meta) parameters, else
    the current CUDA device when the process group is NCCL, else CPU."""
    if isinstance(mesh, DeviceMesh) and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    real = [p.device for p in model.parameters() if not p.is_meta]
    if real:
        return real[0]
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _option_groups(model: nn.Module, optimizer: Any, param_groups: list[dict[str, Any]] | None,
                   kwargs: dict[str, Any], group: Any, replicate: Any,
                   config: ZeroConfig) -> tuple[list[OptionGroup], type]:
    world = dist.get_world_size()
    # The data-parallel world (shard x replicate ranks): the default divisor of every group's gradients.
    data_parallel = dist.get_world_size(group) * (1 if replicate is None else dist.get_world_size(replicate))
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError(
                f"optimizer {type(optimizer).__name__} already has state; shard before the first step "
                "(or pass the optimizer class instead of an instance)."
            )
        if param_groups is not None or kwargs:
            raise ValueError("pass either an optimizer instance or an optimizer class with options, not both.")
        raw = [dict(g) for g in optimizer.param_groups]
        cls = type(optimizer)
    else:
        cls = optimizer
        raw = [dict(g) for g in param_groups] if param_groups is not None else [{"params": list(model.parameters())}]
        for g in raw:
            for key, value in kwargs.items():
                g.setdefault(key, value)
    model_params = {id(p): p for p in model.parameters()}
    seen: set[int] = set()
    out = []
    for index, g in enumerate(raw):
        params = list(g.pop("params"))
        foreign = [p for p in params if id(p) not in model_params]
        if foreign:
            raise ValueError(f"param_groups[{index}] holds {len(foreign)} tensor(s) that are not parameters of the "
                             "model; pass only model.parameters() (or subsets of them).")
        twice = [p for p in params if id(p) in seen]
        if twice:
            raise ValueError(f"param_groups[{index}] repeats parameters of an earlier group; list each once.")
        seen.update(id(p) for p in params)
        sub = g.pop("zero_group", None)
        distinct = g.pop("zero_distinct", sub is not None)
        pg = group if sub is None else (_mesh_group(sub) if isinstance(sub, DeviceMesh) else sub)
        size = dist.get_world_size(pg)
        # Dense and distinct parameters (experts) are averaged over the data-parallel world; a
        # replicated group sharded over another group only ever sees that group's gradients.
        own = pg is not group and not distinct
        divisor = _grad_divisor(index, g.pop("zero_grad_divisor", size if own else data_parallel))
        reducer = _extension(index, "zero_reducer", g.pop("zero_reducer", None), ("reduce_scatter", "all_reduce"))
        gatherer = _extension(index, "zero_gatherer", g.pop("zero_gatherer", None), ("all_gather",))
        placement = _extension(index, "zero_placement", g.pop("zero_placement", None),
                               ("place_master", "make_optimizer", "step", "read_master", "masters"))
        global_of = g.pop("zero_global", None)
        state_dtype = group_state_dtype(index, g.pop("zero_state_dtype", None))
        master_dtype = group_master_dtype(index, g.pop("zero_master_dtype", None), config)
        if global_of is not None and not callable(global_of):
            raise ValueError(f"param_groups[{index}]['zero_global'] must be callable(name, shape) -> (global name, "
                             "global shape, dim-0 offset), e.g. mapping a local expert to its global index.")
        order = {id(p): i for i, p in enumerate(model_params.values())}
        params.sort(key=lambda p: order[id(p)])
        out.append(OptionGroup(options=g, params=params, group=pg, group_rank=dist.get_rank(pg), group_size=size,
                               replicas=1 if distinct else max(1, world // size), grad_divisor=divisor,
                               reducer=reducer, gatherer=gatherer, global_of=global_of, placement=placement,
                               state_dtype=state_dtype, master_dtype=master_dtype))
    rest = [p for p in model_params.values() if id(p) not in seen]
    if rest:
        # Parameters outside every group (frozen ones, typically) are still sharded and gathered.
        size = dist.get_world_size(group)
        out.append(OptionGroup(options={"lr": 0.0}, params=rest, group=group, group_rank=dist.get_rank(group),
                               group_size=size, replicas=max(1, world // size), grad_divisor=data_parallel))
    return out, cls


def _engine_placement(placement: Any, groups: list[OptionGroup], partition: Any) -> Any:
    """``placement``, or a :class:`GroupedPlacement` when a parameter group has its own (each unit's
    reduced gradient then goes to its own placement's ``grad_device``)."""
    if all(g.placement is None for g in groups):
        return placement
    grouped = GroupedPlacement([g.placement or placement for g in groups],
                               {unit.key: unit.option_index for unit in partition.units})
    for unit in partition.units:
        device = getattr(grouped.group_placements[unit.option_index], "grad_device", None)
        unit.grad_device = None if device is None else torch.device(device)
    return grouped


def _offload_as_built(placement: Any, config: ZeroConfig, groups: list[OptionGroup]) -> Any:
    """The ``after_unit`` of :func:`build_partition` that hands each sharded unit to an offloading
    placement as soon as it is built, or ``None``.

    Without it every unit's master is in memory until the optimizer exists: at world size 1 that
    is the whole model once, which is what stops a model bigger than memory at ``zero_shard``.
    With a placement that offers ``release_master`` (an optional member; plait-offload-io's on
    NVMe) the unit's master is placed, its compute shard written to the shard storage and the
    master's values released to the placement, before the next unit is built.
    """
    if config.stage != 3 or not getattr(placement, "releases_masters", False) or \
            any(g.placement is not None for g in groups) or not callable(getattr(placement, "release_master", None)):
        return None
    storage = placement.shard_storage()

    def offload(unit: Any) -> None:
        if unit.resident:
            return  # kept whole in memory anyway (small parameters)
        # In fp32 the master is the compute shard itself: the shard's file then holds its values.
        same = unit.master.untyped_storage().data_ptr() == unit.shard.untyped_storage().data_ptr()
        placed = placement.place_master(unit.key, nn.Parameter(unit.master, requires_grad=True))
        unit.attach_storage(storage)
        placement.release_master(unit.key, stored_as=unit.key if same else None)
        unit.master = placed

    return offload


def _mesh_group(mesh: DeviceMesh) -> Any:
    """A (sub-)mesh given as a parameter group's ``zero_group``: its dimensions, flattened."""
    return mesh.get_group() if mesh.ndim == 1 else flat_group(mesh, mesh.mesh_dim_names or ())


def _extension(index: int, key: str, value: Any, methods: tuple[str, ...]) -> Any:
    missing = [m for m in methods if value is not None and not callable(getattr(value, m, None))]
    if missing:
        raise ValueError(f"param_groups[{index}]['{key}'] is a {type(value).__name__} without {missing}; pass an "
                         "object implementing plait.zero_sharding's GradientReducer / ParamGatherer / StatePlacement "
                         "protocol, or leave it out.")
    return value


def _set_global(slot: Any, name: str, shape: tuple[int, ...], row: int) -> None:
    """Give ``slot`` its global identity: rows ``[row, row + shape[0])`` of tensor ``name``."""
    shape, local = tuple(shape), slot.shape
    rows = local[0] if local else 1
    if shape[1:] != local[1:] or not 0 <= row <= (shape[0] if shape else 1) - rows or len(shape) != len(local):
        raise ValueError(f"zero_global({slot.name!r}, {local}) returned shape {shape} at row {row}: the local "
                         "parameter must be whole rows of the global tensor (same trailing dimensions).")
    slot.global_name, slot.global_shape = name, shape
    slot.global_offset = row * (slot.numel // rows if rows else 0)


def _grad_divisor(index: int, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"param_groups[{index}]['zero_grad_divisor']={value!r} must be a positive finite number "
                         "(the data-parallel world size, which is the default, averages like DDP).")
    return float(value)


def _constructor_options(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The subset of an optimizer instance's ``defaults`` its constructor accepts. torch stores
    derived entries there too (AdamW's ``decoupled_weight_decay``), which the constructor refuses."""
    accepted = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted}


def _zeropp_policies(config: ZeroConfig, group: Any, gatherer: Any, reducer: Any) -> tuple[Any, Any]:
    """The gatherer and reducer ``config.zeropp`` asks for (collective: it may read the node layout);
    without ZeRO++, plain stage 3's node-aware reducer (see :func:`_node_aware_reducer`)."""
    group = None if group is dist.group.WORLD else group
    if config.zeropp is None:
        if reducer is None and config.stage == 3 and config.two_hop_reduce:
            reducer = _node_aware_reducer(group, config.ranks_per_node)
        return gatherer, reducer
    if gatherer is not None or reducer is not None:
        raise ValueError("zero_shard: ZeroConfig.zeropp builds the gatherer and reducer itself, and gatherer=/reducer= "
                         "were given too; drop one of them (make_zeropp_policies builds the same policies by hand).")
    zeropp = config.zeropp
    if zeropp.ranks_per_node == "auto" and config.ranks_per_node != "auto":
        zeropp = dataclasses.replace(zeropp, ranks_per_node=config.ranks_per_node)  # e.g. Lightning's num_nodes
    return make_zeropp_policies(zeropp, group)


def _node_aware_reducer(group: Any, ranks_per_node: int | str = "auto") -> Any:
    """Plain stage 3 across several nodes: the exact two-hop reduce-scatter (inside each node, then
    across; :class:`~plait.zero_sharding.zeropp.HierarchicalReducer`), which sends a third of what
    gloo's one-hop reduce-scatter sends between two nodes. With ``ranks_per_node`` given, where it
    makes several nodes of several ranks. With ``"auto"``, only where a launcher says there are
    several nodes (torchrun's ``GROUP_RANK`` or ``LOCAL_WORLD_SIZE`` below the world size,
    Lightning's ``NODE_RANK``, SLURM's ``SLURM_NODEID``) and they are several, of more than one
    rank each, consecutive in ``group``; otherwise ``None`` (the one-hop default). Collective over
    ``group`` when it reads the layout.
    """
    if not dist.is_initialized():
        return None
    world = dist.get_world_size(group)
    if ranks_per_node != "auto":
        if not 1 < ranks_per_node < world or world % ranks_per_node:  # type: ignore[operator]
            return None  # one node, one rank per node, or a size that does not cut the group: one hop
        return HierarchicalReducer(node_size=ranks_per_node, group=group)  # type: ignore[arg-type]
    local, everyone = os.environ.get("LOCAL_WORLD_SIZE", "").strip(), dist.get_world_size()
    if local == str(everyone):
        return None  # the launcher put every rank on this node (the same on every rank): no collective
    several = local.isdigit() and int(local) < everyone  # torchrun's word, even without GROUP_RANK
    if not several and not any(os.environ.get(name, "").strip() for name in NODE_VARIABLES):
        return None
    try:
        layout = detect_layout(group)
    except ValueError:  # unequal or interleaved nodes (the same verdict on every rank): one hop
        return None
    return HierarchicalReducer(node_size=layout.ranks_per_node, group=group) if layout.multi_node else None


def zero_shard(model: nn.Module, optimizer: Any, config: ZeroConfig | None = None, *, mesh: Any = None,
               param_groups: list[dict[str, Any]] | None = None, reducer: Any = None, gatherer: Any = None,
               placement: Any = None, init_fn: Callable[[nn.Module], None] | None = None,
               **optimizer_kwargs: Any) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard ``model`` and its optimizer with ZeRO stage 1, 2 or 3 (in place).

    Args:
        model: a plain ``nn.Module`` (parameters may be on the meta device, e.g. built under
            :func:`sharded_init`; they are then allocated and initialised one module at a time).
        optimizer: an optimizer class (e.g. ``torch.optim.AdamW``) built with
            ``optimizer_kwargs``, or an optimizer instance with no state yet (its class, groups
            and options are used).
        config: the :class:`ZeroConfig` (default ``ZeroConfig()``, stage 3).
        mesh: a 1-D ``DeviceMesh``, an N-D mesh (its ``config.shard_dims`` are flattened), a
            process group, or ``None`` for the world.
        param_groups: optimizer parameter groups (dicts with ``params`` and options). Extra keys:
            ``zero_group`` shards that group over another process group or mesh (MoE experts over
            the expert-data-parallel group); ``zero_distinct`` (default ``True`` with
            ``zero_group``) says its parameters differ across the other ranks;
            ``zero_global`` maps ``(name, shape)`` of each parameter of the group to ``(global
            name, global shape, dim-0 row offset)`` for parameters that live on some ranks only
            (experts under expert parallelism): checkpoints and exports use that identity;
            ``zero_reducer`` / ``zero_gatherer`` / ``zero_placement`` replace the engine's reducer /
            gatherer / placement for the group's units (``zero_placement``: its masters and optimizer
            state, see :mod:`plait.zero_sharding.placements`; see
            :mod:`plait.zero_sharding.composition` for the optional members the engine calls);
            ``zero_grad_divisor`` is what the group's gradients, summed over its ranks, are divided by (default with
            ``zero_distinct``: the data-parallel world, i.e. the ranks ``mesh`` shards over, so expert gradients
            reduced over a smaller group are scaled as dense ones are, as DeepSpeed does; otherwise the group's own
            size); ``zero_state_dtype`` / ``zero_master_dtype`` override ``ZeroConfig.optimizer_state_dtype`` /
            ``master_dtype`` for the group (see :mod:`plait.zero_sharding.low_precision`).
        reducer, gatherer, placement: extension points (see :mod:`plait.zero_sharding.extension`).
            Without ``reducer`` and ZeRO++, stage 3 reduces in two exact hops when the launcher
            names several nodes or ``ZeroConfig.ranks_per_node`` cuts the group into several
            (:func:`_node_aware_reducer`), in one otherwise or with ``two_hop_reduce=False``.
        init_fn: initialises a module whose meta parameters were just allocated (default
            ``module.reset_parameters()``).
        **optimizer_kwargs: options for the optimizer class.

    Returns:
        ``(model, optimizer)``: the same model object, now a ``ZeroModule``, and a ``ZeroOptimizer``.

    Raises:
        TypeError: ``config`` is not a ``ZeroConfig`` or ``model`` not an ``nn.Module``.
        ValueError: unsupported optimizer, bad parameter groups, configs differing across ranks.
        RuntimeError: torch.distributed is not initialised.
    """
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a plait.zero_sharding.ZeroConfig, got {type(config).__name__}; "
                        "build one with ZeroConfig(stage=...).")
    if not isinstance(model, nn.Module):
        raise TypeError(f"zero_shard(model=...) needs an nn.Module, got {type(model).__name__}.")
    if isinstance(model, ZeroModule):
        if model.zero_engine.config == config:
            return model, model.zero_optimizer
        raise ValueError("model is already sharded with a different ZeroConfig; build a fresh model to re-shard.")
    cls = type(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    check_no_compiled_autograd(config.stage)
    check_optimizer(cls, config)
    check_placement(cls, placement, param_groups)
    dicts = [g if isinstance(g, dict) else {} for g in param_groups or []]
    check_composes(cls, config, [group_state_dtype(i, g.get("zero_state_dtype")) for i, g in enumerate(dicts)],
                   placement=placement, param_groups=param_groups,
                   whole_tensor=is_whole_tensor(cls) and not config.elementwise_optimizer,
                   group_masters=[group_master_dtype(i, g.get("zero_master_dtype"), config)
                                  for i, g in enumerate(dicts)])
    compose = getattr(cls, "compose_with_zero", None)
    if callable(compose):  # an optimizer bringing its own exchange (plait-onebit-optim's 1-bit Adam) or refusing
        optimizer, param_groups, optimizer_kwargs, reducer = compose(
            optimizer, config, param_groups=param_groups, reducer=reducer, **optimizer_kwargs)
        if gatherer is None and callable(getattr(reducer, "all_gather", None)):
            gatherer = reducer  # an exchange that also gathers (0/1 Adam's local steps skip the post-step gather)
    if mesh is None and _init_mesh:
        mesh = _init_mesh[-1]
    group, replicate = resolve_groups(mesh, config)
    check_tensor_parallel(model, group, replicate, compute_dtype=config.compute_dtype, reducer=reducer,
                          gatherer=gatherer,
                          whole_tensor=is_whole_tensor(cls) and not config.elementwise_optimizer)
    check_model = getattr(placement, "check_model", None)
    if callable(check_model):  # optional: a placement that sizes itself for the model (a memory budget)
        check_model(model, dist.get_world_size(group))
    groups, cls = _option_groups(model, optimizer, param_groups, optimizer_kwargs, group, replicate, config)
    block = lowbit_block_size(cls, optimizer, optimizer_kwargs)
    for og in groups if block is not None else ():
        og.block = block  # torchao's low-bit states: no quantisation block spans two ranks
    check_same_across_ranks(model, config, cls, None if group is dist.group.WORLD else group)
    for module in model.modules():
        handle = _before_sharding.pop(module, None)
        if handle is not None:
            handle.remove()
    if getattr(placement, "offloads_parameters", False) and config.stage != 3:
        raise ValueError(f"the placement offloads parameters (OffloadConfig.param_device), which needs "
                         f"ZeroConfig(stage=3), got stage={config.stage}; use stage=3 or param_device='none'.")
    gatherer, reducer = _zeropp_policies(config, group, gatherer, reducer)
    # Offloaded parameters (ZeRO-Infinity): the embedding and the head get units of their own, so
    # memory is bounded by the largest module rather than by the root unit (see partition.py).
    partition = build_partition(model, config, groups, init_fn, compute_device(model, mesh),
                                separate_root=getattr(placement, "offloads_parameters", False),
                                # whole-tensor optimizers keep host masters: nothing to release as built
                                after_unit=None if is_whole_tensor(cls) and not config.elementwise_optimizer
                                else _offload_as_built(placement, config, groups))
    for unit in partition.units:
        unit.grad_divisor = groups[unit.option_index].grad_divisor or unit.group_size
        if unit.group is group:
            unit.replicate_group = replicate  # HSDP: the dimensions not sharded over
        unit.reducer, unit.gatherer = groups[unit.option_index].reducer, groups[unit.option_index].gatherer
        if groups[unit.option_index].global_of is not None:
            for slot in unit.slots:
                _set_global(slot, *groups[unit.option_index].global_of(slot.name, slot.shape))
    if is_whole_tensor(cls) and not config.elementwise_optimizer:  # each tensor stepped whole by one rank
        # check_placement refused any placement but a host offload; the class may weigh its own updates
        placement = WholeTensorPlacement(partition.units, getattr(cls, "whole_tensor_cost", update_cost),
                                         offload=placement)
    engine = ZeroEngine(model, config, partition, reducer=reducer or DefaultReducer(),
                        gatherer=gatherer or DefaultGatherer(),
                        placement=_engine_placement(placement or LocalPlacement(), groups, partition))
    inner_groups = []
    for index, og in enumerate(groups):
        masters = []
        for unit in partition.units:
            if unit.option_index == index:
                placed = unit.master if unit.storage is not None else \
                    engine.placement.place_master(unit.key, nn.Parameter(unit.master, requires_grad=True))
                unit.master = placed
                masters.append(placed)
        inner_groups.append({"params": masters, **og.options})
    def build(pg: list[dict[str, Any]]) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return cls(pg, **_constructor_options(cls, optimizer.defaults))
        return cls(pg, **optimizer_kwargs)

    inner = engine.placement.make_optimizer(wrap_low_precision(build, config, groups, partition), inner_groups)
    storage = engine.placement.shard_storage() if hasattr(engine.placement, "shard_storage") else None
    if storage is not None:
        engine.attach_storage(storage)  # ZeRO-Infinity: stage-3 shards live on CPU/NVMe between gathers
    grad_storage = engine.placement.grad_storage() if hasattr(engine.placement, "grad_storage") else None
    if grad_storage is not None:
        engine.attach_grad_storage(grad_storage)  # reduced gradient shards live there until the step
    scaler = LossScaler(config, enabled=config.compute_dtype == torch.float16)
    zero_optimizer = ZeroOptimizer(engine, inner, scaler)
    install(model, engine, zero_optimizer)
    notify(engine, "bind", engine)  # extensions that need the units, groups or keys
    return model, zero_optimizer


@contextlib.contextmanager
def sharded_init(mesh: Any = None, *, init: str = "construct", placement: Any = None) -> Iterator[None]:
    """Build a model so that no rank ever holds all of it; ``zero_shard`` then shards it.

    ``init="construct"`` (default) runs the modules' own constructors, so the weights are bitwise
    those of the same model built without plait from the same seed; each parameter keeps only
    this rank's slice of its value as soon as the next module starts registering parameters (see
    :mod:`plait.zero_sharding.construction`). Every rank must build the same model with the same
    seed; ``zero_shard`` checks it. ``init="meta"`` puts every parameter on the meta device
    instead (buffers stay real, so computed tables such as RoPE survive), and ``zero_shard``
    initialises one module at a time with ``reset_parameters()`` or its ``init_fn``: for models
    whose weights are loaded right after (no initialisation is wasted).

    With ``placement`` (the one later given to ``zero_shard``) whose parameters are offloaded
    (plait-offload-io's ``OffloadConfig(param_device="nvme")``), each finished slice is written
    to the placement's shard storage and freed as soon as the next module starts, at any world
    size including 1 (DeepSpeed's ``zero.Init(remote_device="nvme")``): building then holds one
    module at a time, not the model.

    Using the model before ``zero_shard`` raises an error either way.

    Args:
        mesh: the mesh ``zero_shard`` should use when it is not given one; its ranks (the world
            when ``None``) build the model together.
        init: ``"construct"`` or ``"meta"``.
        placement: optional; a placement with a ``shard_storage()`` (parameter offload) that
            keeps the slices while the model is built.

    Raises:
        ValueError: ``init`` is neither; ``placement`` has no shard storage or ``init="meta"``.
    """
    if init not in ("construct", "meta"):
        raise ValueError(f"sharded_init(init={init!r}): use 'construct' (the model's own initialisation, sliced as "
                         "it is built) or 'meta' (no values until zero_shard's reset_parameters/init_fn).")
    storage = _construction_storage(placement, init)
    original = nn.Module.register_parameter
    created: list[nn.Module] = []
    group = ConstructionGroup(_construction_group(mesh), storage) if init == "construct" else None
    pending: list[nn.Parameter] = []

    def slice_pending() -> None:
        for param in pending:
            if not isinstance(param, ConstructedParameter):
                slice_parameter(param, group)
        pending.clear()

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and not isinstance(param, ConstructedParameter):
            if group is None:
                param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            else:  # the previous module's constructor is done with its parameters: keep slices only
                if not created or created[-1] is not self:
                    slice_pending()
                pending.append(param)
            created.append(self)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    _init_mesh.append(mesh)
    try:
        yield
        if group is not None:
            slice_pending()
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        _init_mesh.pop()
        for module in {id(m): m for m in created}.values():
            _before_sharding[module] = module.register_forward_pre_hook(_refuse_unsharded)


def _construction_storage(placement: Any, init: str) -> Any:
    """The shard storage ``sharded_init(placement=...)`` writes slices to (``None`` without one)."""
    if placement is None:
        return None
    if init != "construct":
        raise ValueError("sharded_init(placement=...) stores constructed values; with init='meta' there are none "
                         "until zero_shard: drop placement= or use init='construct'.")
    storage = placement.shard_storage() if callable(getattr(placement, "shard_storage", None)) else None
    if storage is None:
        raise ValueError(f"sharded_init(placement=...): {type(placement).__name__} keeps no parameter shards "
                         "(no shard_storage); give a placement that offloads parameters, e.g. plait-offload-io's "
                         "zero_placement(OffloadConfig(device='nvme', param_device='nvme', path=...)), or drop "
                         "placement=.")
    return storage


def _construction_group(mesh: Any) -> Any:
    """The ranks that build the model together: all of ``mesh``'s, else the world."""
    if not dist.is_initialized():
        return None
    if isinstance(mesh, DeviceMesh):
        return mesh.get_group() if mesh.ndim == 1 else flat_group(mesh, mesh.mesh_dim_names)
    return mesh if mesh is not None else dist.group.WORLD


def _refuse_unsharded(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"{type(module).__name__} was built under sharded_init() and has no weights yet; call "
        "zero_shard(model, optimizer, config) on the whole model before running it."
    )
