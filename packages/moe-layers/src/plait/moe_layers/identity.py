"""Global identity of expert parameters, and the ZeRO parameter groups of an expert-parallel model.

Under expert parallelism rank ``r`` of an ep group holds experts ``[r * E/ep, (r + 1) * E/ep)``
of every MoE layer, under local parameters: stacked ``experts.gate_up_proj`` of shape
``[E/ep, 2I, H]`` (:class:`~plait.moe_layers.GatedExperts`), or ``experts.experts.0`` ... for
user modules (:class:`~plait.moe_layers.ModuleExperts`). A checkpoint that another ep size can
read must name them as the whole model does: rows ``[first, first + E/ep)`` of the ``[E, 2I, H]``
tensor, or ``experts.experts.<first + i>``. :func:`expert_global_identity` is that mapping, in the
form plait-zero-sharding's parameter groups take (``zero_global(name, shape) -> (global name,
global shape, dim-0 row offset)``), so ``state_dict()``, ``export_full_weights``, the sharded
state dict and plait-universal-ckpt hold every expert under its global name and shape, and an
``ep=2`` checkpoint loads at ``ep=1`` or ``ep=4``.

This module imports nothing from plait-zero-sharding: it only builds the dictionaries
``zero_shard(param_groups=...)`` reads.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from plait.moe_layers.experts import GatedExperts, ModuleExperts
from plait.moe_layers.parallel import ExpertParallelGroups, dense_parameters, expert_parameters


class ExpertGlobalIdentity:
    """``(name, shape) -> (global name, global shape, dim-0 row offset)`` for a model's expert
    parameters, read from where :func:`~plait.moe_layers.apply_expert_parallel` left each layer's
    experts (``first_expert``); any other name maps to itself.

    Args:
        model: the model after ``apply_expert_parallel`` (or a model without expert parallelism,
            whose identity is the trivial one), named as it will be given to ``zero_shard``.
    """

    def __init__(self, model: nn.Module) -> None:
        names = {id(p): name for name, p in model.named_parameters()}  # first names, as zero_shard sees them
        self.table: dict[str, tuple[str, tuple[int, ...], int]] = {}
        for path, module in model.named_modules():
            if isinstance(module, GatedExperts):
                for param in (module.gate_up_proj, module.down_proj):
                    name = names[id(param)]
                    self.table[name] = (name, (module.num_experts, *param.shape[1:]), module.first_expert)
            elif isinstance(module, ModuleExperts):
                prefix = f"{path}.experts." if path else "experts."
                for index, expert in enumerate(module.experts):
                    for sub, param in expert.named_parameters():
                        self.table[names[id(param)]] = (f"{prefix}{module.first_expert + index}.{sub}",
                                                        tuple(param.shape), 0)

    def __call__(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
        """The global identity of parameter ``name`` (itself when it is not an expert's)."""
        return self.table.get(name, (name, tuple(shape), 0))

    def __repr__(self) -> str:
        return f"ExpertGlobalIdentity({len(self.table)} expert parameters)"


def expert_global_identity(model: nn.Module) -> ExpertGlobalIdentity:
    """The ``zero_global`` of a model's expert parameter group (see the module docstring).

    Call it after :func:`~plait.moe_layers.apply_expert_parallel` and before ``zero_shard``.

    Args:
        model: the expert-parallel model.

    Returns:
        A callable ``(name, shape) -> (global name, global shape, dim-0 row offset)``.
    """
    return ExpertGlobalIdentity(model)


def zero_param_groups(model: nn.Module, groups: ExpertParallelGroups, **options: Any) -> list[dict[str, Any]]:
    """The parameter groups for ``zero_shard(param_groups=...)`` of an expert-parallel model: dense
    parameters sharded over the data-parallel ranks, experts over their expert-data-parallel group
    with their global identity (so checkpoints reshard across ep sizes). A collective call on every
    rank when ``groups`` has no edp group (ep spanning the world: each rank then shards its experts
    over itself, and every rank creates every one-rank group).

    Args:
        model: the model after ``apply_expert_parallel(model, groups)``.
        groups: from :func:`~plait.moe_layers.make_expert_parallel_groups`.
        **options: optimizer options for both groups (``lr``, ``weight_decay``...).

    Returns:
        ``[dense group, expert group]`` (the expert group omitted when the model has no experts).
    """
    edp = groups.edp_group
    if edp is None:
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
        edp = singles[dist.get_rank()]
    out: list[dict[str, Any]] = [{"params": dense_parameters(model), **options}]
    experts = expert_parameters(model)
    if experts:
        out.append({"params": experts, "zero_group": edp, "zero_global": expert_global_identity(model), **options})
    return out
