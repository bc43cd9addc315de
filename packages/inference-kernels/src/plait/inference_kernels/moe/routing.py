"""Top-k routing and the token permutation that feeds the grouped expert GEMMs.

Two steps sit between a router's logits and the expert GEMMs:

1. :func:`topk_routing` turns logits into per-token expert ids and combine weights (softmax in
   fp32, top-k, optional renormalisation so each token's weights sum to one, as Mixtral does).
2. the token permutation, which is plait-kernels' op unit shared with training
   (:mod:`plait.kernels.ops.moe_permute`; :func:`align_tokens_to_blocks` and
   :class:`BlockAlignment` are re-exported here): the ``T * top_k`` (token, slot) pairs sorted by
   expert, each expert's run padded to the grouped GEMM's row tile without reading a value back
   to the host (vLLM's ``moe_align_block_size``).
"""

from __future__ import annotations

import torch

from plait.inference_kernels.input_checks import check_float
from plait.kernels.dispatch import TRITON, select_backend
from plait.kernels.ops.moe_permute import BlockAlignment, align_tokens_to_blocks, max_aligned_blocks

__all__ = ["BlockAlignment", "align_tokens_to_blocks", "max_aligned_blocks", "topk_routing", "topk_routing_reference"]


def topk_routing(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts and their combine weights.

    Args:
        router_logits: ``[T, E]`` router outputs, any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the kept softmax probabilities by their sum (Mixtral, Qwen-MoE);
            ``False`` keeps the raw softmax probabilities (Switch, some DeepSeek variants).

    Returns:
        ``(weights, ids)``: ``weights`` ``[T, top_k]`` float32, ``ids`` ``[T, top_k]`` int32,
        ordered by decreasing weight. Among exactly equal probabilities the Triton path picks the
        lowest expert index; torch.topk's choice is unspecified.

    Raises:
        ValueError: bad rank or dtype, or ``top_k`` outside ``[1, E]``.
    """
    check_float("router_logits", router_logits, ndim=2)
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, {num_experts}] (the number of experts).")
    if select_backend(router_logits) == TRITON:
        from plait.inference_kernels.moe.routing_triton import topk_routing_triton

        return topk_routing_triton(router_logits, top_k, renormalize)
    return topk_routing_reference(router_logits, top_k, renormalize=renormalize)


def topk_routing_reference(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`topk_routing` (the CPU path and test baseline; inputs not validated)."""
    # Softmax in fp32: bf16 logits lose the small differences that decide the ranking.
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
