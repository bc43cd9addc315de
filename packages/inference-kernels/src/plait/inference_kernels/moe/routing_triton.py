"""Triton path of top-k routing: softmax, top-k and renormalisation in one launch.

Grid: one program per ``BLOCK_T`` tokens. A program loads its ``[BLOCK_T, E]`` logits once (E is
padded to a power of two; padding columns get probability -1 so they can never be picked),
takes the softmax in fp32, then extracts the top-k by ``top_k`` rounds of row-max: each round
finds the largest probability, the lowest column holding it (torch.topk's choice among equal
values is unspecified; lowest-index is deterministic), records both in a ``[BLOCK_T, K]``
register tile and knocks that column out. The optional renormalisation divides the tile by the
sum of the kept values before the single store. At decode sizes this replaces five torch
launches (softmax, topk, sum, divide, cast) with one.

Constants: ``BLOCK_T * BLOCK_E`` is capped at 4096 fp32 values (16 KiB of registers across a
4-warp program), so a 256-expert router still takes 16 tokens per program. ``top_k`` is a
compile-time constant because the rounds are unrolled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.inference_kernels.input_checks import next_power_of_two
from plait.kernels.dispatch import check_triton_launch_mode


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts,
    s_lt, s_le, s_wt, s_wk, s_it, s_ik,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,  # noqa: N803
    RENORMALIZE: tl.constexpr,  # noqa: N803
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < num_experts
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * s_lt + cols[None, :] * s_le,
                     mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
    top = tl.max(logits, axis=1)
    top = tl.where(row_ok, top, 0.0)  # fully masked rows: avoid -inf - -inf
    probs = tl.exp(logits - top[:, None])
    probs = probs / tl.where(row_ok, tl.sum(probs, axis=1), 1.0)[:, None]
    probs = tl.where(col_ok[None, :], probs, -1.0)

    kcols = tl.arange(0, K_PAD)
    kept_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    kept_i = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        index = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        kept_w = tl.where(kcols[None, :] == j, best[:, None], kept_w)
        kept_i = tl.where(kcols[None, :] == j, index[:, None], kept_i)
        total += best
        probs = tl.where(cols[None, :] == index[:, None], -1.0, probs)
    if RENORMALIZE:
        kept_w = kept_w / tl.where(total > 0.0, total, 1.0)[:, None]
    out_mask = row_ok[:, None] & (kcols < TOP_K)[None, :]
    tl.store(weights_ptr + rows[:, None] * s_wt + kcols[None, :] * s_wk, kept_w, mask=out_mask)
    tl.store(ids_ptr + rows[:, None] * s_it + kcols[None, :] * s_ik, kept_i, mask=out_mask)


def topk_routing_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the routing kernel (inputs already validated).

    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int32)`` ordered by decreasing weight.

    Raises:
        RuntimeError: the kernel was jitted for the other mode (interpreter vs GPU) than the
            tensor's device needs.
    """
    check_triton_launch_mode(_topk_softmax_kernel, router_logits, op="top-k routing")
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = max(16, next_power_of_two(num_experts))
    block_t = max(1, min(16, 4096 // block_e))
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, num_experts,
        *router_logits.stride(), *weights.stride(), *ids.stride(),
        TOP_K=top_k, K_PAD=max(2, next_power_of_two(top_k)), BLOCK_T=block_t, BLOCK_E=block_e,
        RENORMALIZE=renormalize, num_warps=4,
    )
    return weights, ids
