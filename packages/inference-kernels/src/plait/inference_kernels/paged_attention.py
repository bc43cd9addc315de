"""Decode attention over a paged (block-table) KV cache, with grouped-query attention.

The cache layout is vLLM's flash-attention layout: ``k_cache``/``v_cache`` are
``[num_blocks, block_size, Hkv, D]``; sequence ``b`` owns the blocks listed in
``block_tables[b]`` and its token ``t`` lives in block ``block_tables[b, t // block_size]`` at
slot ``t % block_size``. Entries of a block table past a sequence's last block are never read, so
they may hold anything (engines pad with 0 or -1).

The reference path gathers every listed block into a dense ``[B, L, Hkv, D]`` tensor and runs
``scaled_dot_product_attention`` with the group's query heads as the query axis (so GQA needs no
repeated k/v) and a length mask. The Triton path is the online-softmax kernel of
:mod:`~plait.inference_kernels.paged_attention_triton`, which reads each cached token once per
kv head. The kernel has no backward (decode attention has no training use); if autograd needs
gradients anyway, the reference runs, which is differentiable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from plait.inference_kernels.input_checks import (
    check_float,
    check_index,
    check_ranges,
    check_same,
    is_power_of_two,
)
from plait.kernels.dispatch import TRITON, select_backend

SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 128, 256)
"""Head sizes the kernels are built and tested for (the ones of Llama, Mistral, Qwen, Phi, Gemma)."""


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a paged cache pair and return ``(num_blocks, block_size, Hkv, D)``.

    Raises:
        ValueError: not 4-D, unsupported dtype, k/v mismatch, block size not a power of two or a
            head size outside :data:`SUPPORTED_HEAD_SIZES`.
    """
    check_float("k_cache", k_cache, ndim=4)
    check_float("v_cache", v_cache, ndim=4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape "
            f"[num_blocks, block_size, num_kv_heads, head_size]."
        )
    check_same("dtype", k_cache=k_cache, v_cache=v_cache)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if not is_power_of_two(block_size):
        raise ValueError(
            f"block_size={block_size} (k_cache.shape[1]) must be a power of two (8, 16, 32, ...): the "
            f"kernels split a token index into block and slot with a shift and a mask."
        )
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head size {head_dim} (k_cache.shape[3]) is not supported; supported head sizes are "
            f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}."
        )
    return num_blocks, block_size, kv_heads, head_dim


def _validate(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, check_bounds) -> float:
    num_blocks, block_size, kv_heads, head_dim = check_cache(k_cache, v_cache)
    check_float("q", q, ndim=3)
    check_index("block_tables", block_tables, ndim=2)
    check_index("seq_lens", seq_lens, ndim=1)
    check_same("dtype", q=q, k_cache=k_cache)
    check_same("device", q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    batch, q_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"q has head size {q_dim} but the cache has {head_dim}; they must match.")
    if q_heads % kv_heads:
        raise ValueError(
            f"q has {q_heads} heads, not a multiple of the cache's {kv_heads} kv heads; grouped-query "
            f"attention needs num_q_heads % num_kv_heads == 0."
        )
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
            f"one row per sequence of q (B={batch})."
        )
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r} must be None (automatic) or an int >= 1.")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive finite float (usually 1/sqrt(head_size)).")
    if check_bounds:
        max_blocks = block_tables.shape[1]
        # Only the entries a sequence actually uses must be valid block numbers.
        used = torch.arange(max_blocks, device=seq_lens.device) * block_size < seq_lens[:, None]
        check_ranges(
            ("seq_lens", seq_lens, 0, max_blocks * block_size + 1,
             f"a sequence can hold at most max_blocks * block_size = {max_blocks * block_size} tokens."),
            ("block_tables (used entries)", torch.where(used, block_tables, 0), 0, num_blocks,
             f"block numbers index the {num_blocks} blocks of the cache."),
        )
    return float(scale)


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Dense attention on the gathered cache (the CPU path; inputs not validated).

    Args and Returns: as :func:`paged_decode_attention` (``scale`` must be a float here).
    """
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    max_tokens = block_tables.shape[1] * block_size
    # Unused table entries may be garbage: clamp them to a valid block, the mask hides them.
    tables = block_tables.long().clamp(0, max(num_blocks - 1, 0))
    compute = torch.float32 if q.dtype != torch.float64 else q.dtype
    k = k_cache[tables].reshape(batch, max_tokens, kv_heads, head_dim).transpose(1, 2).to(compute)
    v = v_cache[tables].reshape(batch, max_tokens, kv_heads, head_dim).transpose(1, 2).to(compute)
    # The group's query heads act as the query axis: [B, Hkv, G, D] against [B, Hkv, L, D].
    queries = q.reshape(batch, kv_heads, group, head_dim).to(compute)
    valid = torch.arange(max_tokens, device=q.device) < seq_lens[:, None].long()
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    # A sequence with no tokens has an all-masked row (NaN from softmax): define its output as 0.
    out = torch.where((seq_lens > 0)[:, None, None, None], out, torch.zeros_like(out))
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    check_bounds: bool = True,
) -> torch.Tensor:
    """One decode step of attention for a batch of sequences whose keys and values are paged.

    Args:
        q: ``[B, Hq, D]`` the new token's (already rotated) queries.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same dtype as ``q``; block_size a
            power of two; D in :data:`SUPPORTED_HEAD_SIZES`; ``Hq % Hkv == 0``.
        block_tables: ``[B, max_blocks]`` int32/int64 block numbers of each sequence.
        seq_lens: ``[B]`` int32/int64 tokens in each sequence's cache (including the new one);
            a sequence of length 0 gets a zero output.
        scale: softmax scale, default ``1 / sqrt(D)``.
        num_splits: Triton path only: split each sequence into this many token ranges
            (flash-decoding); ``None`` picks from the batch size and the GPU's SM count.
        check_bounds: verify ``seq_lens`` fit the block table and used block numbers exist (a
            small device-to-host read on CUDA; skipped during CUDA-graph capture).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``.

    Raises:
        ValueError: unsupported dtype, head size or block size, inconsistent shapes, dtypes or
            devices, bad scale or num_splits, out-of-range lengths or block numbers.
    """
    scale = _validate(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, check_bounds)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache))
    # The kernel has no backward: when autograd needs gradients the (differentiable) reference runs.
    if select_backend(q, k_cache, v_cache) == TRITON and not needs_grad:
        from plait.inference_kernels.paged_attention_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
