"""ZeRO over tensor-parallel parameters: DTensors made by ``parallelize_module`` on a ``tp`` mesh.

Torch's tensor parallelism (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``...)
turns parameters into DTensors whose local tensor is this rank's TP shard. ZeRO then shards that
local tensor over the data-parallel group only, as FSDP2 does in torchtitan:

* A unit's flat buffer holds local tensors (``param._local_tensor``), so gathers and
  reduce-scatters run on ``dp`` and move local-shard bytes; optimizer state is 1/dp of each TP
  shard.
* The parameter object stays a DTensor (mesh, placements and global shape unchanged): only its
  local tensor is pointed at a view of the unit's buffer, the way FSDP2 re-points a sharded
  DTensor's ``_local_tensor``. Torch's TP forward and its DTensor autograd run untouched.
* A gradient whose placement differs from its parameter's is brought to it first. The case that
  occurs is ``Partial`` on ``tp`` for a ``Replicate`` parameter fed by sequence-sharded
  activations (``SequenceParallel`` norms): it is all-reduced over that mesh dimension through
  the counted collective layer. Plain TP styles already give ``Replicate`` parameters a
  ``Replicate`` gradient (DTensor autograd reduced it), so nothing more is sent for them.
* The global gradient norm counts a TP-sharded element once per TP shard and a replicated one
  once in all (see :func:`slot_norm_weight`).
* Checkpoints name every piece by its place in the global tensor (boxes of it for a TP shard), and
  the whole-tensor paths assemble TP shards through DTensor (:mod:`.tensor_parallel_state`), so a
  checkpoint saved at ``(dp, tp)`` loads at any other layout, or into an unsharded model.

* ZeRO++ (qwZ, qgZ, hpZ) and state placements (CPU / NVMe offload of optimizer state and of
  parameter shards) act on the units' flat buffers over the data-parallel group only, so they
  apply to the local TP shards unchanged.

Anything else (``Partial`` or ``_StridedShard`` parameters, a DTensor already sharded over the
data-parallel ranks by ``fully_shard``, a hand-built ``reducer=``/``gatherer=``, whole-tensor
optimizers) is refused by :func:`check_tensor_parallel` before any work starts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from plait.kernels import collectives
from plait.zero_sharding.grad_norm import shard_sumsq


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a tensor-parallel parameter or gradient)."""
    return isinstance(tensor, DTensor)


def local_value(param: torch.Tensor) -> torch.Tensor:
    """The values this rank holds: a DTensor's local shard, else the tensor itself (detached)."""
    return param._local_tensor.detach() if is_dtensor(param) else param.detach()


def local_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of what this rank holds of ``param`` (its TP shard for a DTensor)."""
    return tuple(param._local_tensor.shape) if is_dtensor(param) else tuple(param.shape)


def local_numel(param: torch.Tensor) -> int:
    """Number of elements this rank holds of ``param``."""
    return param._local_tensor.numel() if is_dtensor(param) else param.numel()


def point_local(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param``'s values live in ``view`` (a slice of its unit's flat buffer).

    A DTensor parameter keeps its identity, mesh, placements and global shape; only its local
    tensor changes (FSDP2 re-points ``_local_tensor`` the same way). Autograd and optimizers that
    hold the parameter object see the same object.

    Args:
        param: a plain or DTensor parameter.
        view: a tensor of the parameter's local shape and dtype.
    """
    if is_dtensor(param):
        param._local_tensor = view
    else:
        param.data = view


def local_grad(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as this rank's local tensor, laid out like ``param``'s local shard.

    A DTensor gradient with ``Partial`` where the parameter is ``Replicate`` (sequence-parallel
    norms) is summed over that mesh dimension with the counted all-reduce; any other difference
    of placements is redistributed by DTensor itself.

    Args:
        param: the parameter the gradient belongs to.
        grad: its gradient (plain tensor or DTensor).

    Returns:
        A plain tensor of ``param``'s local shape.
    """
    if not is_dtensor(grad):
        return grad
    mesh, wanted = param.device_mesh, tuple(param.placements)
    placements = list(grad.placements)
    local = grad._local_tensor
    for dim, (have, want) in enumerate(zip(placements, wanted)):
        if isinstance(have, Partial) and isinstance(want, Replicate):
            local = local.clone()  # the reduction is written in place: never into autograd's tensor
            collectives.all_reduce(local, group=mesh.get_group(dim),
                                   name=f"ZeRO tensor-parallel gradient all-reduce over `{_dim_name(mesh, dim)}`")
            if have.reduce_op == "avg":
                local.div_(mesh.size(dim))
            placements[dim] = want
    if tuple(placements) != wanted:
        local = DTensor.from_local(local, mesh, placements, run_check=False, shape=grad.shape,
                                   stride=grad.stride()).redistribute(mesh, wanted)._local_tensor
    return local


def _dim_name(mesh: Any, dim: int) -> str:
    names = mesh.mesh_dim_names
    return names[dim] if names else str(dim)


def slot_norm_weight(param: nn.Parameter, replicas: int) -> float:
    """What one element's squared gradient counts in the global norm's world all-reduce.

    The all-reduce sums over every rank; a unit's ``replicas`` copies outside the data-parallel
    group (the ``tp`` ranks here) would count each element ``replicas`` times. A TP-sharded
    parameter holds a different part of the tensor on each ``Shard`` rank, so only the remaining
    copies divide.

    Args:
        param: the parameter.
        replicas: ranks outside the sharding group holding the same unit (world / dp).

    Returns:
        The weight (``1 / replicas`` for a plain or fully replicated parameter).
    """
    if not is_dtensor(param):
        return 1.0 / replicas
    distinct = 1
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            distinct *= param.device_mesh.size(dim)
    return distinct / replicas


def weighted_sumsq(unit: Any, grad: torch.Tensor, copies: int | None = None) -> torch.Tensor:
    """This rank's contribution to the global squared gradient norm for ``unit`` (float64).

    Args:
        unit: a :class:`~plait.zero_sharding.units.FlatUnit` holding DTensor parameters.
        grad: its fp32 averaged gradient shard.
        copies: ranks holding the same unit (``ZeroEngine.norm_copies``, which leaves out other
            pipeline stages); ``None``: ``unit.replicas``.

    Returns:
        A float64 scalar: each parameter's piece of the shard, squared, times its
        :func:`slot_norm_weight` (padding never counts).
    """
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for slot, _param_range, (lo, hi) in unit.local_pieces():
        piece = shard_sumsq(grad[lo:hi])
        total += piece * slot_norm_weight(slot.param, unit.replicas if copies is None else copies)
    return total


def check_tensor_parallel(model: nn.Module, group: Any, replicate: Any, *, compute_dtype: torch.dtype, reducer: Any,
                          gatherer: Any, whole_tensor: bool) -> bool:
    """Refuse DTensor parameters ZeRO cannot shard, before any work (see the module docstring).

    Args:
        model: the model about to be sharded.
        group: the data-parallel process group ZeRO shards over.
        replicate: the HSDP replicate group, or ``None``.
        compute_dtype: ``ZeroConfig.compute_dtype``; DTensor parameters must already have it (a
            DTensor's dtype is fixed, so ZeRO cannot cast it the way it casts a plain parameter).
        reducer, gatherer: what ``zero_shard`` was given (``None`` when unset); ``ZeroConfig.zeropp``
            builds its own after this check, and is supported.
        whole_tensor: the optimizer runs whole tensors on one rank each (Muon, LAMB...).

    Returns:
        Whether the model has DTensor parameters.

    Raises:
        ValueError: naming the parameter or option, and the fix.
    """
    dtensors = [(name, p) for name, p in model.named_parameters() if is_dtensor(p)]
    if not dtensors:
        return False
    world, size = dist.get_world_size(), dist.get_world_size(group)
    if world % size:
        raise ValueError(f"zero_shard: the data-parallel mesh has {size} ranks, which does not divide the world of "
                         f"{world}; build the mesh with init_device_mesh(device, (dp, tp)) where dp * tp == world "
                         "and pass mesh['dp'].")
    dp_ranks = set(dist.get_process_group_ranks(group))
    for name, param in dtensors:
        _check_param(name, param, dp_ranks)
        if param.dtype != compute_dtype:
            raise ValueError(f"zero_shard: tensor-parallel parameter {name!r} is {param.dtype} but "
                             f"ZeroConfig.compute_dtype is {compute_dtype}; a DTensor keeps its dtype, so convert the "
                             f"model first (model.to({compute_dtype})) before parallelize_module, or set compute_dtype "
                             f"to {param.dtype}.")
    if replicate is not None:
        raise ValueError("zero_shard: the mesh has dimensions ZeRO would replicate over (HSDP) and the model has "
                         "tensor-parallel (DTensor) parameters; pass only the data-parallel dimension, "
                         "mesh=mesh['dp'].")
    # ZeRO++ (qwZ, qgZ, hpZ) and state placements (CPU / NVMe offload) act on the units' flat
    # local buffers over the data-parallel group, which hold local TP shards here: they compose as is.
    unsupported = [label for label, given in (("reducer=", reducer is not None), ("gatherer=", gatherer is not None),
                                              ("a whole-tensor optimizer (Muon, LAMB...)", whole_tensor))
                   if given]
    if unsupported:
        raise ValueError(f"zero_shard: {', '.join(unsupported)} is not supported with tensor-parallel (DTensor) "
                         f"parameters yet (first: {dtensors[0][0]!r}); with tensor parallelism plait supports ZeRO "
                         "stages 1, 2, 3 with the default gatherer and reducer or ZeRO++ (ZeroConfig.zeropp), "
                         "in-memory or offloaded state (placement=), elementwise optimizers (AdamW, Adam, SGD...) "
                         "and gradient clipping.")
    return True


def _check_param(name: str, param: nn.Parameter, dp_ranks: set[int]) -> None:
    mesh, me = param.device_mesh, dist.get_rank()
    if param.is_meta or param._local_tensor.is_meta:
        raise ValueError(f"zero_shard: tensor-parallel parameter {name!r} is on the meta device; materialise the "
                         "model (to_empty + init, or load weights) before parallelize_module and zero_shard.")
    for dim, placement in enumerate(param.placements):
        ranks = set(dist.get_process_group_ranks(mesh.get_group(dim)))
        if len(ranks & dp_ranks - {me}):
            raise ValueError(_over_data_parallel(name, _dim_name(mesh, dim), placement))
        if type(placement) not in (Shard, Replicate):
            raise ValueError(f"zero_shard: parameter {name!r} has placement {placement} on mesh dimension "
                             f"{_dim_name(mesh, dim)!r}; ZeRO shards DTensor parameters placed with Shard(d) or "
                             "Replicate() only (not Partial or _StridedShard); redistribute it to one of those "
                             "or leave it out of the tensor-parallel plan.")



def _over_data_parallel(name: str, dim: str, placement: Any) -> str:
    """The refusal of a DTensor parameter laid out over data-parallel ranks, naming its likely cause."""
    if isinstance(placement, Replicate):  # a style (or distribute_module) given the dp x tp mesh
        return (f"zero_shard: parameter {name!r} is a DTensor over mesh dimension {dim!r} (placement {placement}), "
                "which shares ranks with the data-parallel group ZeRO shards over: its tensor-parallel style "
                "distributed it over the whole (dp, tp) mesh. Give the style only the tensor-parallel dimension, "
                "parallelize_module(model, mesh['tp'], plan), then zero_shard(..., mesh=mesh['dp']).")
    return (f"zero_shard: parameter {name!r} is a DTensor over mesh dimension {dim!r} (placement {placement}), "
            "which shares ranks with the data-parallel group ZeRO shards over: it is sharded over the "
            "data-parallel ranks already (fully_shard applied first?). Apply only parallelize_module on the tp "
            "mesh, then zero_shard(..., mesh=mesh['dp']) instead of fully_shard.")
