"""tiny-llama-MoE (the project's benchmark model, ``plait.kernels.testing``) with plait MoE layers.

tiny-llama's ``MoEMLP`` is the reference form of a Mixtral-style MLP: a router, softmax, top-k,
renormalisation and one SwiGLU module per expert run in a loop. :func:`convert_tiny_llama_moe`
replaces each with a plait :class:`~plait.moe_layers.layer.MoE` holding the same weights (copied
into the stacked ``gate_up_proj``/``down_proj`` layout), so the converted model computes the same
logits and can then be given expert parallelism, ZeRO or GRIN routing through ``overrides``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.moe_layers.config import MoEConfig
from plait.moe_layers.layer import MoE


def from_loop_moe(mlp: nn.Module, **overrides: Any) -> MoE:
    """A plait layer with the weights of one tiny-llama ``MoEMLP`` (softmax, top-k, renormalise).

    Args:
        mlp: a ``plait.kernels.testing.tiny_llama.MoEMLP``.
        **overrides: :class:`MoEConfig` fields to change, e.g. ``router_gradient="grin"``.

    Returns:
        The new layer, in ``mlp``'s train/eval mode.
    """
    experts = mlp.experts
    hidden, inter = experts[0].gate_proj.in_features, experts[0].gate_proj.out_features
    layer = MoE(MoEConfig(**{"hidden_size": hidden, "num_experts": len(experts), "intermediate_size": inter,
                             "top_k": mlp.top_k, **overrides}))
    with torch.no_grad():
        layer.router.weight.copy_(mlp.router.weight)
        for index, expert in enumerate(experts):
            layer.experts.gate_up_proj[index].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
            layer.experts.down_proj[index].copy_(expert.down_proj.weight)
    return layer.train(mlp.training)


def convert_tiny_llama_moe(model: nn.Module, **overrides: Any) -> int:
    """Replace every ``MoEMLP`` of a tiny-llama-MoE model (``block.mlp``) by :func:`from_loop_moe`.

    Args:
        model: a ``plait.kernels.testing.TinyLlama`` built with ``num_experts > 0``.
        **overrides: :class:`MoEConfig` fields for every converted layer.

    Returns:
        How many layers were converted.

    Raises:
        ValueError: the model has no loop MoE MLP.
    """
    from plait.kernels.testing.tiny_llama import MoEMLP

    blocks = [block for block in getattr(model, "layers", []) if isinstance(getattr(block, "mlp", None), MoEMLP)]
    if not blocks:
        raise ValueError(f"convert_tiny_llama_moe found no MoEMLP in {type(model).__name__}.layers; build the "
                         "model with tiny_llama_moe(...) (num_experts > 0).")
    for block in blocks:
        block.mlp = from_loop_moe(block.mlp, **overrides)
    return len(blocks)
