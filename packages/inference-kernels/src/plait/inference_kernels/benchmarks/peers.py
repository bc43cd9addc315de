"""plait's own plain-torch copies of Hugging Face's eager code (not transformers' code).

The benchmark's HF peers are transformers' own modules (:mod:`.hf_peers`). These copies are kept
as a labelled extra row (the MoE loop: the older HF Mixtral layout, separate ``w1``/``w3``/``w2``
linears per expert) and as test oracles; they import nothing from transformers:

* :class:`EagerMixtralMoE` - Mixtral's sparse MoE block: a router, softmax/top-k/renormalise,
  then a Python loop over experts, each with separate ``w1`` (gate), ``w3`` (up) and ``w2``
  (down) linears, gathering its tokens with ``torch.where`` and scattering with ``index_add_``.
* :func:`dense_sdpa_on_gathered_cache` - decode attention the dense way: gather each sequence's
  blocks into a padded ``[B, L, Hkv, D]`` tensor, repeat kv heads for GQA (HF's ``repeat_kv``)
  and call ``scaled_dot_product_attention`` with a length mask.
* :func:`eager_rotary_then_cache_write` - HF's ``apply_rotary_pos_emb`` (``rotate_half``) on k
  and q, then an ``index_copy_`` of k and v into the flattened cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EagerMixtralMoE(nn.Module):
    """Mixtral-style eager MoE block over ``[T, H]`` tokens (plait's copy of the older HF loop).

    Args:
        hidden_size, intermediate_size, num_experts, top_k: the block's shape.
        dtype, device: parameter placement.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w1 = nn.ModuleList(nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
                                for _ in range(num_experts))
        self.w3 = nn.ModuleList(nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
                                for _ in range(num_experts))
        self.w2 = nn.ModuleList(nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
                                for _ in range(num_experts))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Route and run ``[T, H]`` tokens; returns ``[T, H]``."""
        probs = torch.softmax(self.gate(hidden).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(hidden.dtype)
        out = torch.zeros_like(hidden)
        expert_mask = F.one_hot(ids, num_classes=len(self.w1)).permute(2, 1, 0)  # [E, k, T]
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        for expert in hit:
            slot, token = torch.where(expert_mask[expert])
            x = hidden[token]
            y = self.w2[expert](F.silu(self.w1[expert](x)) * self.w3[expert](x))
            out.index_add_(0, token, y * weights[token, slot, None])
        return out

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same experts in the fused layout: ``(w_gate_up [E, 2I, H], w_down [E, H, I])``."""
        w_gate_up = torch.stack([torch.cat((g.weight, u.weight)) for g, u in zip(self.w1, self.w3, strict=True)])
        w_down = torch.stack([d.weight for d in self.w2])
        return w_gate_up.detach(), w_down.detach()


def dense_sdpa_on_gathered_cache(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Decode attention by gathering a dense padded cache and running eager SDPA (a test oracle).

    Args and Returns: as :func:`plait.inference_kernels.paged_decode_attention`.
    """
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    max_tokens = block_tables.shape[1] * block_size
    tables = block_tables.long().clamp(0, num_blocks - 1)
    k = k_cache[tables].reshape(batch, max_tokens, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[tables].reshape(batch, max_tokens, kv_heads, head_dim).transpose(1, 2)
    k = k.repeat_interleave(q_heads // kv_heads, dim=1)  # HF repeat_kv
    v = v.repeat_interleave(q_heads // kv_heads, dim=1)
    mask = torch.arange(max_tokens, device=q.device) < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out[:, :, 0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_rotary_then_cache_write(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q):
    """HF-style RoPE (full rotary, NeoX layout) on q and k, then ``index_copy_`` into the cache (a test oracle).

    Returns:
        The rotated q.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1)[:, None].to(k.dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None].to(k.dtype)
    k_rot = k * cos + _rotate_half(k) * sin
    q_rot = q * cos + _rotate_half(q) * sin
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k_rot)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q_rot
