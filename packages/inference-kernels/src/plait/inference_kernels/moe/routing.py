"""Top-k routing and the token permutation that feeds the grouped expert GEMMs.

Two steps sit between a router's logits and the expert GEMMs:

1. :func:`topk_routing` turns logits into per-token expert ids and combine weights (softmax in
   fp32, top-k, optional renormalisation so each token's weights sum to one, as Mixtral does).
2. :func:`align_tokens_to_blocks` sorts the ``T * top_k`` (token, slot) pairs by expert and pads
   each expert's run to a multiple of the GEMM's row tile ``block_m``, so that every row tile of
   the grouped GEMM belongs to exactly one expert. The padding rows hold an out-of-range sentinel
   the kernel masks. This is the idea known from vLLM's ``moe_align_block_size``; this version is
   written with torch ops that never read a value back to the host, so the launch stays free of
   device syncs (and capturable in a CUDA graph): buffers are sized by an upper bound and the
   kernel reads the true padded length from device memory.
"""

from __future__ import annotations

import dataclasses

import torch

from plait.inference_kernels.input_checks import check_float, check_index
from plait.kernels.dispatch import TRITON, select_backend


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


@dataclasses.dataclass(frozen=True)
class BlockAlignment:
    """The sorted, block-padded row order of a grouped expert GEMM.

    Attributes:
        sorted_ids: ``[num_blocks * block_m]`` int32; entry ``i`` is the flat (token, slot) index
            ``t * top_k + j`` processed at sorted row ``i``, or ``num_rows`` for a padding row.
        block_experts: ``[num_blocks]`` int32, the expert of each row tile (tiles past the
            padded length repeat the last expert and are skipped by the kernel).
        num_padded: ``[1]`` int32 on the device, the true padded length (a multiple of block_m).
        num_rows: ``T * top_k``.
        block_m: the row-tile size the padding was made for.
    """

    sorted_ids: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    num_rows: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        """Row tiles in the buffers (an upper bound on the tiles holding real rows)."""
        return self.block_experts.numel()


def max_aligned_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on row tiles after padding: each expert that gets rows wastes < one tile.

    At most ``min(num_experts, num_rows)`` experts receive rows, and each pads by at most
    ``block_m - 1``; the bound is what lets the buffers be sized without reading counts back.
    """
    padded = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-padded // block_m)


def align_tokens_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Sort (token, slot) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Args:
        topk_ids: ``[T, top_k]`` int32/int64 expert ids in ``[0, num_experts)``.
        num_experts: E.
        block_m: the grouped GEMM's row tile (a power of two).

    Returns:
        The :class:`BlockAlignment`; rows of one expert keep their original order (stable sort),
        which keeps the kernel's reads of the hidden states as sequential as the routing allows.

    Raises:
        ValueError: bad ``topk_ids`` rank or dtype, or ``block_m < 1``.
    """
    check_index("topk_ids", topk_ids, ndim=2)
    if block_m < 1:
        raise ValueError(f"block_m={block_m} must be >= 1.")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    # index_add_ instead of bincount: bincount sizes its output from the data (a host sync on CUDA).
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, dim=0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, dim=0) - counts

    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_rows, device=device) - count_start[sorted_experts]
    destination = padded_start[sorted_experts] + rank_in_expert

    num_blocks = max_aligned_blocks(num_rows, num_experts, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_ids[destination] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return BlockAlignment(
        sorted_ids=sorted_ids,
        block_experts=block_experts.to(torch.int32),
        num_padded=padded_end[-1:].to(torch.int32),
        num_rows=num_rows,
        block_m=block_m,
    )
