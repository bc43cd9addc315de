"""The shared benchmark model of shared/benchmarks.md, in plain torch (no transformers import).

``tiny-llama``: vocab 4096, hidden 256, 8 layers, 4 heads of 64, SwiGLU 688, RMSNorm, RoPE,
untied head, about 8.4M parameters. The MoE variant swaps every other MLP for 8 experts, top-2.
Plain torch on purpose: it is the common ground that plait and every peer (DDP, FSDP2,
DeepSpeed) run unchanged, so nothing in it may depend on plait's own kernels.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyLlamaConfig:
    """Shape of the model.

    Attributes:
        vocab_size: embedding rows (the byte tokenizer uses the first 259).
        hidden_size: model width.
        num_layers: transformer blocks.
        num_heads: attention heads (``hidden_size`` must divide by it).
        intermediate_size: SwiGLU width.
        max_seq_len: longest sequence the RoPE table covers.
        rope_base: RoPE frequency base.
        norm_eps: RMSNorm epsilon.
        num_experts: 0 for the dense model; otherwise every other MLP (odd layers) becomes MoE.
        top_k: experts per token in MoE layers.
    """

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    intermediate_size: int = 688
    max_seq_len: int = 1024
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    num_experts: int = 0
    top_k: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyLlamaConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyLlamaConfig.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "choose num_heads dividing hidden_size."
            )
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"TinyLlamaConfig.top_k={self.top_k} must be in [1, num_experts={self.num_experts}].")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


@dataclasses.dataclass
class CausalLMOutput:
    """What the model returns: logits, and the mean next-token loss when labels were given."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[seq_len, head_dim]`` for the NeoX (rotate-half) layout."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the per-position angles (rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head attention with RoPE (q, k, v, o projections without bias)."""

    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: ``[batch, seq, hidden]``."""
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., hidden]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEMLP(nn.Module):
    """Top-k softmax-routed experts, computed with a plain per-expert loop (the reference form)."""

    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[batch, seq, hidden]``; each token goes to its top-k experts, weights renormalised."""
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: TinyLlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        moe = cfg.num_experts > 0 and layer % 2 == 1
        self.mlp = MoEMLP(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: ``[batch, seq, hidden]``."""
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class TinyLlama(nn.Module):
    """The benchmark model. ``model(input_ids, labels=None).loss`` as in the user stories."""

    def __init__(self, cfg: TinyLlamaConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or TinyLlamaConfig()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_base)
        # Non-persistent: derived from the config, so never saved and never sharded.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights and unit norms, deterministic under ``torch.manual_seed``."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids, labels: ``[batch, seq]``; labels equal to -100 are ignored."""
        seq = input_ids.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds TinyLlamaConfig.max_seq_len={self.config.max_seq_len}.")
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding. Recomputes the prefix each token: the model is tiny and samples short,
        so a KV cache would add code without changing what a user sees."""
        out = input_ids
        for _ in range(max_new_tokens):
            window = out[:, -self.config.max_seq_len:]
            next_token = self(window).logits[:, -1].argmax(dim=-1, keepdim=True)
            out = torch.cat([out, next_token], dim=1)
        return out


def tiny_llama(**overrides: object) -> TinyLlama:
    """Build tiny-llama with optional config overrides, e.g. ``tiny_llama(num_layers=2)``."""
    return TinyLlama(TinyLlamaConfig(**overrides))


def tiny_llama_moe(**overrides: object) -> TinyLlama:
    """The MoE variant: every other MLP is 8 experts, top-2."""
    return TinyLlama(TinyLlamaConfig(**{"num_experts": 8, "top_k": 2, **overrides}))
