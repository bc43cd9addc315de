"""plait-moe-layers: Mixture-of-Experts layers for plain torch, with expert parallelism.

- :class:`MoE` / :class:`MoEConfig`: top-k router (softmax before or after top-k, renormalisation,
  jitter or Gumbel noise), capacity with drop-by-position or drop-by-probability, dropless mode,
  the Switch load-balancing loss and the router z-loss, stacked gated-MLP experts run as grouped
  GEMMs or user expert modules, Residual MoE.
- :func:`make_expert_parallel_groups`, :func:`apply_expert_parallel`: experts sharded over an
  ``ep`` group, tokens exchanged by uneven all-to-alls (counted by plait's byte ledger).
- :func:`zero_param_groups`, :func:`expert_global_identity`: the ZeRO parameter groups of an
  expert-parallel model, experts named by their global index so checkpoints reshard across ep.
- :func:`convert_hf_moe` / :func:`restore_hf_moe`: HF Mixtral, Qwen2-MoE and Qwen3-MoE sparse
  blocks to plait MoE layers and back (weights kept).
- :mod:`plait.moe_layers.deepspeed`: ``deepspeed.moe.layer.MoE``'s constructor, return value and
  state-dict names on plait's layer, routing as DeepSpeed routes.
"""

from plait.moe_layers.config import MoEConfig
from plait.moe_layers.dispatch import all_to_all_rows, dispatch_combine
from plait.moe_layers.experts import GatedExperts, ModuleExperts
from plait.moe_layers.identity import ExpertGlobalIdentity, expert_global_identity, zero_param_groups
from plait.moe_layers.layer import MoE, collect_losses, moe_layers
from plait.moe_layers.parallel import (
    ExpertParallelGroups,
    apply_expert_parallel,
    average_gradients,
    dense_parameters,
    expert_parameters,
    make_expert_parallel_groups,
)
from plait.moe_layers.router import MoELosses, Router, Routing, capacity_keep, load_balancing_loss, router_z_loss

__all__ = [
    "ExpertGlobalIdentity", "ExpertParallelGroups", "GatedExperts",
    "MoE", "MoEConfig", "MoELosses", "ModuleExperts", "Router", "Routing",
    "all_to_all_rows", "apply_expert_parallel", "average_gradients", "capacity_keep", "collect_losses",
    "dense_parameters", "dispatch_combine", "expert_global_identity", "expert_parameters", "load_balancing_loss",
    "make_expert_parallel_groups", "moe_layers", "router_z_loss", "zero_param_groups",
]
