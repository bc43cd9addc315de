"""Expert parallelism: shard every MoE layer's experts over an ``ep`` group, and the groups around it.

With ``W`` ranks and expert-parallel size ``ep``, ranks ``[i * ep, (i + 1) * ep)`` form one
expert-parallel group (they split the experts and exchange tokens), and ranks with the same
position in their ep group form one expert-data-parallel (``edp``) group of ``W / ep`` ranks
holding the same experts. The layout matches ``make_mesh(dp=W // ep, ep=ep)``: ``mesh["ep"]`` is
the ep group and ``mesh["dp"]`` the edp group; on a mesh with more dimensions (``dp x sp x ep``)
the edp group spans every dimension but ``ep`` (``flat_group(mesh, complement_dims(mesh, ("ep",)))``).

Gradients (when no ZeRO engine does it): dense parameters are replicated on all ``W`` ranks and
averaged over them; an expert's gradient already holds the contributions of the whole ep group
(the all-to-all backward brings them), so it is summed over its edp group and divided by ``W`` as
well, which makes every parameter's gradient that of the mean loss over all ranks (DeepSpeed
divides expert gradients by the full data-parallel world for the same reason).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.kernels import collectives
from plait.kernels.mesh import complement_dims, flat_group
from plait.moe_layers.experts import EXPERT_ATTR
from plait.moe_layers.layer import moe_layers


@dataclasses.dataclass(frozen=True)
class ExpertParallelGroups:
    """The process groups of an expert-parallel layout.

    Attributes:
        ep_group: this rank's expert-parallel group (splits the experts, exchanges tokens).
        edp_group: this rank's expert-data-parallel group (same experts, gradients summed).
        ep_size: ranks per ep group.
        ep_rank: this rank's index in its ep group.
        world_size: all ranks (dense gradients are averaged over them).
    """

    ep_group: Any
    edp_group: Any
    ep_size: int
    ep_rank: int
    world_size: int


def make_expert_parallel_groups(ep_size: int, *, mesh: Any | None = None) -> ExpertParallelGroups:
    """Build (or read from ``mesh``) the ep and edp groups; a collective call on every rank.

    Args:
        ep_size: ranks that split the experts; must divide the world size.
        mesh: optional ``DeviceMesh`` with an ``ep`` dimension (``make_mesh(dp=-1, ep=...)``, or with
            more dimensions such as ``sp``); its ``ep`` size must equal ``ep_size``, and the edp
            group is flattened from all its other dimensions.

    Returns:
        The groups of this rank.

    Raises:
        ValueError: ``ep_size`` is not a positive int dividing the world size, or disagrees with the mesh.
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed initialised (torchrun or init_process_group).")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size!r} must be a positive int dividing the world size {world}; "
                         f"use one of {[d for d in range(1, world + 1) if world % d == 0]}.")
    if mesh is not None:
        if mesh.mesh_dim_names is None or "ep" not in mesh.mesh_dim_names or mesh["ep"].size() != ep_size:
            raise ValueError(f"mesh {mesh} must have an 'ep' dimension of size ep_size={ep_size}; "
                             "build it with make_mesh(dp=-1, ep=ep_size).")
        others = complement_dims(mesh, ("ep",))  # every non-ep dimension holds the same experts
        edp = flat_group(mesh, others) if others else None
        return ExpertParallelGroups(mesh["ep"].get_group(), edp, ep_size, mesh["ep"].get_local_rank(), world)
    ep_group = edp_group = None
    # The job's collective timeout, not torch's 30-minute default for new groups (a hung rank
    # would otherwise hold the others in a token all-to-all for half an hour).
    timeout = collectives.group_timeout()
    for start in range(0, world, ep_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(start, start + ep_size)), timeout=timeout)
        if start <= rank < start + ep_size:
            ep_group = group
    for offset in range(ep_size):
        group = dist.new_group(list(range(offset, world, ep_size)), timeout=timeout)
        if rank % ep_size == offset:
            edp_group = group
    return ExpertParallelGroups(ep_group, edp_group, ep_size, rank % ep_size, world)


def apply_expert_parallel(model: nn.Module, groups: ExpertParallelGroups) -> nn.Module:
    """Keep each MoE layer's block of experts on this rank and route tokens over the ep group.

    Call it on the full model, identically initialised on every rank, before any optimizer or
    ZeRO engine sees the parameters (the design's order: sequence parallel, then expert
    placement, then checkpointing/offload, then ZeRO). Idempotent for the same groups.

    Args:
        model: a model containing :class:`~plait.moe_layers.MoE` layers.
        groups: from :func:`make_expert_parallel_groups`.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: no MoE layer, a layer whose ``num_experts`` is not divisible by ``ep_size``, or
            a model already sharded with another ``ep_size``.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no plait MoE layer; build or convert one first.")
    for layer in layers:
        if layer.config.num_experts % groups.ep_size:
            raise ValueError(
                f"MoEConfig.num_experts={layer.config.num_experts} is not divisible by ep_size={groups.ep_size}; "
                "choose an ep_size dividing every layer's expert count."
            )
        if layer.ep_size not in (1, groups.ep_size):
            raise ValueError(f"the model is already expert-parallel with ep_size={layer.ep_size}; build it afresh.")
    paths = {id(module): path for path, module in model.named_modules()}
    for layer in layers:
        if layer.ep_size == 1 and groups.ep_size > 1:
            layer.experts.shard(groups.ep_rank, groups.ep_size)
        layer.ep_group, layer.ep_size = groups.ep_group, groups.ep_size
        layer.comm_label = f"MoE layer `{paths.get(id(layer)) or type(model).__name__}`"
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the experts (sharded over ep, replicated over edp)."""
    return [p for p in model.parameters() if getattr(p, EXPERT_ATTR, False)]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (replicated on all ranks)."""
    return [p for p in model.parameters() if not getattr(p, EXPERT_ATTR, False)]


def average_gradients(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """Average gradients the way the module docstring says (plain data + expert parallelism).

    Args:
        model: the expert-parallel model after ``loss.backward()``.
        groups: its groups.
    """
    # Dense over the world; experts over edp (None: a mesh with only "ep", i.e. ep spans the world).
    plan = ((dense_parameters(model), groups.world_size > 1, None),
            (expert_parameters(model), groups.edp_group is not None, groups.edp_group))
    for params, reduce, group in plan:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        if reduce:
            kind = "dense" if group is None else "expert"
            collectives.all_reduce(flat, group=group, name=f"MoE {kind} gradient all-reduce")
        flat.div_(groups.world_size)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
