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
from collections.abc import Callable, Mapping
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
    """

    groups: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    replicas: tuple[int, ...] | None = None
    rules: tuple[tuple[str, TensorLayout], ...] = ()
    name_map: Callable[[str], str] | None = None

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
            return _Described(name, shape, boxes, tuple(sorted(base | replicas)), None, None)
        layout = layout or TensorLayout()
        local = tuple(_local(tensor).shape)
        index, size = self.config.coordinate(layout.group)
        shape = layouts.global_shape(layout, local, size, name=name)
        boxes = layouts.pieces(layout, shape, index, size, name=name)
        # Ranks of every other group hold the same boxes; those of the group a tensor is split
        # over (or owned per rank of) do not.
        divided = layout.dim is not None or layout.owned
        others = {r for g, ranks in self.config.groups.items() if g != layout.group or not divided for r in ranks}
        return _Described(name, shape, boxes, tuple(sorted(base | others)), layout.to_json(),
                          layouts.padding_box(layout, shape, index, size))

    def _tensors(self) -> list[tuple[str, torch.Tensor, str]]:
        params = {name for name, _ in self.module.named_parameters()}
        return [(name, value, "parameter" if name in params else "buffer")
                for name, value in self.module.state_dict(keep_vars=True).items()]

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """Every parameter, buffer and optimizer-state tensor as consolidated boxes."""
        out: dict[str, ShardedTensor] = {}
        for local_name, tensor, kind in self._tensors():
            described = self._describe(local_name, tensor)
            _add(out, f"model.{described.name}", kind, _local(tensor), described)
            for field, value in self._optimizer_state(tensor).items():
                name = f"optim.{field}.{described.name}"
                if tuple(value.shape) == tuple(tensor.shape):
                    _add(out, name, "optimizer_state", _local(value), described)
                else:  # step counters: one scalar per parameter, held whole by every holder
                    _add_whole(out, name, _local(value), described.replicas)
        return out

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
