"""Model-parallel modules as sharded state: tensor, pipeline, expert and sequence layouts.

:func:`model_parallel` wraps a rank's module (and optionally its torch optimizer) as a
:class:`~plait.kernels.sharded_state.ShardedStateful` whose tensors are named in their
consolidated, single-process form (``model.<global name>``, ``optim.<field>.<global name>``, the
names plait.zero_sharding uses, so a tensor-parallel checkpoint loads into a ZeRO run and back).
Each tensor's pieces come from one of two sources:

* a DTensor parameter (``torch.distributed.tensor.parallel.parallelize_module``, FSDP2, or both
  on a 2-D mesh) describes itself: its placements give the box this rank holds and the ranks
  holding the same box;
* otherwise a :class:`~plait.universal_ckpt.layouts.TensorLayout` rule (first regex that
  matches the stage-local name) says how the local tensor divides over a named group
  (Megatron-style modules holding local shards, fused QKV, padded vocabularies, expert stacks);
  a tensor no rule matches is replicated. A rule also overrides a DTensor's placements, which is
  how a fused ``[q|k|v]`` weight split by ``ColwiseParallel`` is described correctly.

Pipeline parallelism is naming: ``name_map`` turns a stage's local names into global ones
(:func:`layer_offset` for stages that renumber their layers from 0), so each stage saves only
its own tensors and any other stage split, or a single process, loads them. Sequence
parallelism shards activations, not state: its ranks are replicas (put them in ``replicas``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.sharded_state import ShardedTensor, ShardSpec, piece_key
from plait.universal_ckpt import layouts
from plait.universal_ckpt.layouts import TensorLayout


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelParallelConfig:
    """How this rank's module relates to the consolidated model.

    Attributes:
        groups: mesh dimension name -> global ranks of this rank's group along it, in group
            order, this rank included (``{"tp": (0, 1)}``); a layout's ``group`` missing here
            has size 1. Not needed for DTensor parameters without a rule.
        replicas: global ranks holding exactly this rank's state (data- or sequence-parallel
            peers), this rank included; None: this rank alone. The lowest writes.
        rules: ``(regex, TensorLayout)`` pairs; the first whose regex fully matches a
            parameter's stage-local name gives its layout.
        name_map: stage-local name -> global (consolidated) name; None keeps names.
        stage: this rank's pipeline stage, recorded with each tensor it saves (the manifest
            pattern's ``stages``, ``pp:stageN`` in ``plait ckpt inspect``): where each module
            lived. Informational: any other split, or none, loads the checkpoint. None: not
            recorded.
    """

    groups: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    replicas: tuple[int, ...] | None = None
    rules: tuple[tuple[str, TensorLayout], ...] = ()
    name_map: Callable[[str], str] | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        for group, ranks in self.groups.items():
            if rank not in tuple(ranks):
                raise ValueError(f"ModelParallelConfig.groups[{group!r}]={tuple(ranks)} must contain this "
                                 f"rank ({rank}); give the ranks of this rank's own {group} group.")
        if self.replicas is not None and rank not in tuple(self.replicas):
            raise ValueError(f"ModelParallelConfig.replicas={self.replicas} must contain this rank ({rank}).")
        for pattern, layout in self.rules:
            if not isinstance(layout, TensorLayout):
                raise ValueError(f"ModelParallelConfig.rules: {pattern!r} maps to {layout!r}; use a TensorLayout.")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"ModelParallelConfig.rules: {pattern!r} is not a regex ({exc}).") from exc
        if self.name_map is not None and not callable(self.name_map):
            raise ValueError("ModelParallelConfig.name_map must be a callable local name -> global name.")
        if self.stage is not None and (not isinstance(self.stage, int) or isinstance(self.stage, bool)
                                       or self.stage < 0):
            raise ValueError(f"ModelParallelConfig.stage={self.stage!r} must be this rank's pipeline stage "
                             "(an int >= 0) or None.")

    def coordinate(self, group: str) -> tuple[int, int]:
        """(this rank's index, size) in ``group``; (0, 1) when the group is not configured."""
        ranks = tuple(self.groups.get(group, ()))
        if not ranks:
            return 0, 1
        return ranks.index(dist.get_rank() if dist.is_initialized() else 0), len(ranks)


def layer_offset(prefix: str, offset: int) -> Callable[[str], str]:
    """A ``name_map`` for a pipeline stage that numbers its layers from 0: ``prefix<i>.`` ->
    ``prefix<i + offset>.`` (``layer_offset("layers.", 4)`` maps ``layers.0.w`` to ``layers.4.w``)."""
    if offset < 0:
        raise ValueError(f"layer_offset: offset={offset} must be >= 0 (the stage's first global layer).")
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)(\.|$)")
    return lambda name: pattern.sub(lambda m: f"{prefix}{int(m.group(1)) + offset}{m.group(2)}", name, count=1)


@dataclasses.dataclass
class _Described:
    """One local tensor and the consolidated boxes it holds."""

    name: str
    global_shape: tuple[int, ...]
    boxes: list[tuple[layouts.Box, layouts.Box]]
    replicas: tuple[int, ...]
    pattern: dict | None
    padding: layouts.Box | None


class ModelParallelState:
    """A rank's module (and optimizer) as sharded state; see :func:`model_parallel`."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: ModelParallelConfig) -> None:
        self.module = module
        self.optimizer = optimizer
        self.config = config

    def checkpoint_layout(self) -> dict:
        """Mesh sizes for the manifest's informational layout: the groups, ``dp`` (the replicas)
        and ``pp`` (whatever factor of the world is left: the stages)."""
        mesh = {g: len(r) for g, r in self.config.groups.items() if len(r) > 1}
        if self.config.replicas is not None and len(self.config.replicas) > 1:
            mesh["dp"] = len(self.config.replicas)
        world = dist.get_world_size() if dist.is_initialized() else 1
        used = math.prod(mesh.values())
        if world % used:
            return {}
        if world // used > 1:
            mesh["pp"] = world // used
        layout: dict = {"mesh": mesh} if mesh else {}
        if "ep" in mesh:
            layout["expert_parallel_size"] = mesh["ep"]
        return layout

    def _layout_of(self, local_name: str) -> TensorLayout | None:
        for pattern, layout in self.config.rules:
            if re.fullmatch(pattern, local_name):
                return layout
        return None

    def _describe(self, local_name: str, tensor: torch.Tensor) -> _Described:
        name = self.config.name_map(local_name) if self.config.name_map else local_name
        layout = self._layout_of(local_name)
        rank = dist.get_rank() if dist.is_initialized() else 0
        base = set(self.config.replicas or (rank,))
        if layout is None and _is_dtensor(tensor):
            shape, boxes, replicas = _dtensor_boxes(tensor)
            return _Described(name, shape, boxes, tuple(sorted(base | replicas)),
                              self._with_stage(_dtensor_pattern(tensor)), None)
        layout = layout or TensorLayout(group=next(iter(self.config.groups), "tp"))  # replicated over every group
        local = tuple(_local(tensor).shape)
        index, size = self.config.coordinate(layout.group)
        shape = layouts.global_shape(layout, local, size, name=name)
        boxes = layouts.pieces(layout, shape, index, size, name=name)
        # Ranks of every other group hold the same boxes; those of the group a tensor is split
        # over (or owned per rank of) do not.
        divided = layout.dim is not None or layout.owned
        others = {r for g, ranks in self.config.groups.items() if g != layout.group or not divided for r in ranks}
        return _Described(name, shape, boxes, tuple(sorted(base | others)), self._with_stage(layout.to_json()),
                          layouts.padding_box(layout, shape, index, size))

    def _with_stage(self, pattern: dict) -> dict:
        return pattern if self.config.stage is None else {**pattern, "stages": [self.config.stage]}

    def _tensors(self) -> list[tuple[str, torch.Tensor, str]]:
        params = {name for name, _ in self.module.named_parameters()}
        return [(name, value, "parameter" if name in params else "buffer")
                for name, value in self.module.state_dict(keep_vars=True).items()]

    def sharded_state_dict(self, values: Mapping[str, torch.Tensor] | None = None) -> dict[str, ShardedTensor]:
        """Every parameter, buffer and optimizer-state tensor as consolidated boxes.

        Args:
            values: checkpoint name (``model.<p>``, ``optim.<field>.<p>``) -> a local tensor to save
                in place of the live one (the averaged replicas of :meth:`save_sharded_state_dict`).
        """
        values = values or {}
        out: dict[str, ShardedTensor] = {}
        for local_name, tensor, kind in self._tensors():
            described = self._describe(local_name, tensor)
            name = f"model.{described.name}"
            _add(out, name, kind, values.get(name, _local(tensor)), described)
            for field, value in self._optimizer_state(tensor).items():
                name = f"optim.{field}.{described.name}"
                if tuple(value.shape) == tuple(tensor.shape):
                    _add(out, name, "optimizer_state", values.get(name, _local(value)), described)
                else:  # step counters: one scalar per parameter, held whole by every holder
                    _add_whole(out, name, _local(value), described.replicas)
        return out

    def save_sharded_state_dict(self, gather: Callable[[Any], list[Any]]) -> dict[str, ShardedTensor]:
        """What a save writes: :meth:`sharded_state_dict`, each ``TensorLayout(average=True)``
        tensor (and its same-shaped optimizer state) replaced by the mean of its group's copies.

        The live tensors are not changed (the run goes on with its own copies; a load gives every
        rank the mean). A collective: every rank of the save calls it (the saver does).

        Args:
            gather: every saving rank's picklable argument, in rank order (the save's group).
        """
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        for local_name, tensor, _ in self._tensors():
            layout = self._layout_of(local_name)
            if layout is None or not layout.average:
                continue
            name = self._describe(local_name, tensor).name
            copies = {f"model.{name}": _local(tensor).detach().clone()}
            copies.update({f"optim.{field}.{name}": _local(value).detach().clone()
                           for field, value in self._optimizer_state(tensor).items()
                           if value.shape == tensor.shape and value.is_floating_point()})
            mine[name] = (layout.group, copies)
        everyone = dict(gather((rank, mine)))  # every rank takes part, with or without averaged tensors
        averaged: dict[str, torch.Tensor] = {}
        for name, (group, copies) in mine.items():
            ranks = tuple(self.config.groups.get(group, ())) or (rank,)
            if any(name not in everyone.get(r, {}) for r in ranks):
                raise ValueError(f"{name}: TensorLayout(average=True) over {group} ranks {ranks}, but not every "
                                 "one of them holds it; give every rank of the group the same rules.")
            for key in copies:
                held = [everyone[r][name][1][key] for r in ranks]  # group order: the same sum on every rank
                averaged[key] = sum(held) / len(held)  # DeepSpeed's ds_to_universal: sum(slices) / len(slices)
        return self.sharded_state_dict(averaged)

    def _optimizer_state(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.optimizer is None or not isinstance(tensor, nn.Parameter):
            return {}
        state = self.optimizer.state.get(tensor, {})
        return {field: value for field, value in sorted(state.items()) if isinstance(value, torch.Tensor)}

    def prepare_load(self, saved: Mapping[str, Any]) -> None:
        """Allocate the optimizer state a fresh optimizer lacks, for every field the checkpoint
        holds (``saved``: this key's manifest entries by name), so loading can fill it."""
        if self.optimizer is None:
            return
        for local_name, tensor, kind in self._tensors():
            if kind != "parameter":
                continue
            name = self._describe(local_name, tensor).name
            state = self.optimizer.state[tensor]
            for entry_name, entry in saved.items():
                field, _, rest = entry_name.removeprefix("optim.").partition(".")
                if not entry_name.startswith("optim.") or rest != name or field in state:
                    continue
                if entry.global_shape == self._describe(local_name, tensor).global_shape:
                    state[field] = torch.zeros_like(tensor, dtype=entry.torch_dtype)
                else:
                    state[field] = torch.zeros(entry.global_shape, dtype=entry.torch_dtype)

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """Re-pad: zero the vocabulary-padding rows of every padded tensor (never saved)."""
        with torch.no_grad():
            for local_name, tensor, _ in self._tensors():
                padding = self._describe(local_name, tensor).padding
                if padding is None:
                    continue
                for value in (tensor, *self._optimizer_state(tensor).values()):
                    if value.shape == tensor.shape:
                        _local(value)[tuple(slice(a, b) for a, b in padding)].zero_()


# (local name, local shape) -> (global name, global shape, dim-0 row offset): zero_sharding's zero_global form
_GlobalIdentity = Callable[[str, tuple[int, ...]], tuple[str, tuple[int, ...], int]]


def global_identity_config(module: nn.Module, params: Iterable[nn.Parameter], identity: _GlobalIdentity, *,
                           group: str, ranks: tuple[int, ...], replicas: tuple[int, ...] | None = None
                           ) -> ModelParallelConfig:
    """A config from the global identity of some of the module's parameters, in the form of
    plait.zero_sharding's ``zero_global`` param-group key: ``(local name, local shape) -> (global
    name, global shape, dim-0 row offset)``. For plait-moe-layers' experts:
    ``global_identity_config(model, expert_parameters(model), expert_global_identity(model),
    group="ep", ranks=ep_ranks)``.

    Each of ``params`` either holds rows of a larger tensor, split on dim 0 over ``group``
    (``TensorLayout(dim=0, group=group)``: stacked expert weights), or is a whole tensor this rank
    of ``group`` owns under its global name (``owned``: a ModuleList's experts, renamed); every
    other parameter is replicated over ``group``.

    Args:
        module: this rank's module.
        params: the parameters ``identity`` describes (the expert param group).
        identity: the mapping above.
        group: the mesh dimension the rows or owned tensors are divided over (``"ep"``).
        ranks: global ranks of this rank's ``group``, in group order.
        replicas: this rank's data-parallel peers (see :class:`ModelParallelConfig`).

    Raises:
        ValueError: rows that are not this rank's contiguous block of the group's split (names the
            tensor).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    index, size = tuple(ranks).index(rank) if rank in tuple(ranks) else 0, len(tuple(ranks))
    described = {id(p) for p in params}
    rules: list[tuple[str, TensorLayout]] = []
    renamed: dict[str, str] = {}
    for name, param in module.named_parameters():
        if id(param) not in described:
            continue
        global_name, shape, offset = identity(name, tuple(param.shape))
        if tuple(shape) == tuple(param.shape):
            rules.append((re.escape(name), TensorLayout(group=group, owned=True)))
            renamed[name] = global_name
            continue
        rows = param.shape[0]
        if tuple(shape) != (rows * size, *param.shape[1:]) or offset != index * rows:
            raise ValueError(f"{name}: global shape {list(shape)} at row {offset} is not block {index} of an even "
                             f"dim-0 split of {list(param.shape)} over {size} {group} ranks; fix the identity or "
                             "describe the tensor with a TensorLayout rule.")
        rules.append((re.escape(name), TensorLayout(dim=0, group=group)))
    return ModelParallelConfig(groups={group: tuple(ranks)}, replicas=replicas, rules=tuple(rules),
                               name_map=lambda local: renamed.get(local, local))


def model_parallel(module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   config: ModelParallelConfig | None = None) -> ModelParallelState:
    """Describe a model-parallel rank's module (and torch optimizer) for :func:`plait.universal_ckpt.save`.

    Args:
        module: this rank's module: DTensor parameters (``parallelize_module``, FSDP2) or local
            shards (Megatron-style), or a pipeline stage's submodule.
        optimizer: the torch optimizer over ``module``'s parameters (its tensor state follows
            each parameter's layout; hyperparameters are the caller's to rebuild).
        config: groups, replicas, layout rules and the stage's name map.

    Returns:
        A ShardedStateful to put in the state dict (``{"model": model_parallel(m, opt, config=c)}``).

    Raises:
        ValueError: a rule that does not fit a tensor or its group size (names both and the fix).
    """
    state = ModelParallelState(module, optimizer, config or ModelParallelConfig())
    state.sharded_state_dict()  # every layout checked now, before any save or load starts
    return state


def _add(out: dict[str, ShardedTensor], name: str, kind: str, local: torch.Tensor, described: _Described) -> None:
    for index, (global_box, local_box) in enumerate(described.boxes):
        piece = local[tuple(slice(a, b) for a, b in local_box)]
        spec = ShardSpec(name=name, kind=kind, global_shape=described.global_shape, dtype=local.dtype,
                         slices=global_box, replica_ranks=described.replicas, pattern=described.pattern)
        out[piece_key(name, index)] = ShardedTensor(spec, piece.detach())


def _add_whole(out: dict[str, ShardedTensor], name: str, value: torch.Tensor, replicas: tuple[int, ...]) -> None:
    spec = ShardSpec.full(name, value, kind="optimizer_state", replica_ranks=replicas)
    out[name] = ShardedTensor(spec, value.detach().view(-1))


def _dtensor_pattern(tensor: Any) -> dict:
    """The manifest pattern of a DTensor: its placements by mesh dimension name."""
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or tuple(f"mesh{i}" for i in range(mesh.ndim))
    return {"placements": [[name, repr(placement)] for name, placement in zip(names, tensor.placements)]}


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" or type(getattr(tensor, "data", None)).__name__ == "DTensor"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage (a DTensor's local shard; a plain tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _dtensor_boxes(tensor: Any) -> tuple[tuple[int, ...], list, set[int]]:
    """A DTensor's consolidated shape, its one (global box, local box) and the ranks holding the same box."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(tensor.shape)
    mesh, placements = tensor.device_mesh, tensor.placements
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard | Replicate) and not _strided_box(placements, mesh, mesh_dim):
            raise ValueError(f"a DTensor with placements {placements} cannot be saved (its {placement} piece is "
                             "not one box of the tensor); redistribute it to Shard or Replicate first.")
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(local_shape) != tuple(_local(tensor).shape):  # the offsets describe another piece than held
        raise ValueError(f"a DTensor with placements {placements} holds a local shape {list(_local(tensor).shape)}, "
                         f"its placements say {list(local_shape)}; redistribute it to Shard or Replicate first.")
    global_box = tuple((o, o + n) for o, n in zip(offset, local_shape))
    local_box = tuple((0, n) for n in local_shape)
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if isinstance(p, Replicate) else coord[d] for d, p in enumerate(placements))
    replicas = {int(r) for r in mesh.mesh[index].reshape(-1).tolist()}
    return shape, [(global_box, local_box)], replicas


def _strided_box(placements: tuple, mesh: Any, mesh_dim: int) -> bool:
    """Whether ``placements[mesh_dim]`` is a ``_StridedShard`` whose pieces are boxes: FSDP2 over TP
    (``(_StridedShard(d, sf), Shard(d))``) shards each TP-local block further, which holds when the
    later mesh dimensions that ``Shard`` the same tensor dim multiply to the split factor. Alone,
    a strided shard holds ``split_factor`` separate runs, which no box describes."""
    from torch.distributed.tensor import Shard

    placement = placements[mesh_dim]
    if type(placement).__name__ != "_StridedShard":
        return False
    later = [mesh.size(j) for j in range(mesh_dim + 1, len(placements))
             if isinstance(placements[j], Shard) and placements[j].dim == placement.dim]
    return bool(later) and math.prod(later) == placement.split_factor
