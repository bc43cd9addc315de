"""The Hugging Face peers of the CPU benchmarks: the installed transformers' own modules and functions.

Each peer is transformers' code, instantiated from a tiny config, not a re-implementation:

* :func:`mixtral_block` - transformers' ``MixtralSparseMoeBlock`` (its ``MixtralTopKRouter`` and
  ``MixtralExperts``), with the experts implementation named (``"eager"``: the per-expert loop;
  ``"grouped_mm"`` / ``"batched_mm"`` where this torch runs them).
* :func:`sdpa_on_gathered_cache` - decode attention the dense way HF runs it: each sequence's
  blocks gathered into ``[B, Hkv, L, D]`` and transformers' ``sdpa_attention_forward`` (its
  ``repeat_kv`` for GQA) with a boolean length mask.
* :func:`rotary_then_cache_write` - transformers' Llama ``apply_rotary_pos_emb`` on q and k, then
  an ``index_copy_`` of k and v into the flattened cache (HF keeps no paged cache: the write is
  the cheapest one torch has).

transformers is imported inside each function, so importing this module costs nothing.
"""

from __future__ import annotations

import torch


def transformers_version() -> str | None:
    """The installed transformers' version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def mixtral_block(hidden: int, intermediate: int, experts: int, top_k: int, *,
                  experts_implementation: str = "eager", seed: int = 0) -> torch.nn.Module:
    """transformers' ``MixtralSparseMoeBlock`` at the given shape, weights drawn N(0, 0.02), eval mode.

    Its expert weights are already in plait's fused layout: ``block.experts.gate_up_proj``
    ``[E, 2I, H]`` (gate rows first) and ``block.experts.down_proj`` ``[E, H, I]``; the router is
    ``F.linear(x, block.gate.weight)``.

    Raises:
        ValueError: transformers does not know ``experts_implementation``.
    """
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                           num_experts_per_tok=top_k, router_jitter_noise=0.0)
    config._experts_implementation = experts_implementation
    block = MixtralSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return block


def router_logits(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's router logits for ``[T, H]`` tokens (what plait's ``fused_moe`` takes)."""
    return torch.nn.functional.linear(x, block.gate.weight)


class _AttentionShape(torch.nn.Module):
    """The attributes transformers' attention functions read from the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = False
        self.layer_idx = 0
        self.training = False


def sdpa_on_gathered_cache(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Decode attention through transformers' ``sdpa_attention_forward`` on the gathered dense cache.

    Args and Returns: as :func:`plait.inference_kernels.paged_decode_attention`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    max_tokens = block_tables.shape[1] * block_size
    tables = block_tables.long().clamp(0, num_blocks - 1)
    k = k_cache[tables].reshape(batch, max_tokens, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[tables].reshape(batch, max_tokens, kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(max_tokens, device=q.device) < seq_lens[:, None])[:, None, None, :]
    out, _ = sdpa_attention_forward(_AttentionShape(q_heads // kv_heads), q[:, :, None], k, v, mask,
                                    scaling=scale, is_causal=False)
    return out[:, 0]  # HF returns [B, S=1, H, D]


def rotary_then_cache_write(k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q):
    """transformers' Llama ``apply_rotary_pos_emb`` on q and k, then ``index_copy_`` into the cache.

    cos/sin are looked up from the same ``[max_pos, D]`` table plait's op takes (``cat(freqs,
    freqs)`` as HF's rotary embedding builds them).

    Returns:
        The rotated q.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).to(k.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(k.dtype)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # q/k [T, H, D], cos [T, D]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k_rot)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q_rot
