"""Fused Mixture-of-Experts inference: routing, token permutation, grouped expert GEMMs, combine."""

from plait.inference_kernels.moe.fused_moe import (
    ACTIVATIONS,
    fused_experts,
    fused_experts_reference,
    fused_moe,
)
from plait.inference_kernels.moe.layer import FusedMoE, FusedMoEConfig
from plait.inference_kernels.moe.routing import (
    BlockAlignment,
    align_tokens_to_blocks,
    topk_routing,
    topk_routing_reference,
)

__all__ = [
    "ACTIVATIONS",
    "BlockAlignment",
    "FusedMoE",
    "FusedMoEConfig",
    "align_tokens_to_blocks",
    "fused_experts",
    "fused_experts_reference",
    "fused_moe",
    "topk_routing",
    "topk_routing_reference",
]
