"""The model of ``plait bench parallel-3d``: a small BLOOM-shaped decoder, split into pipeline stages
and tensor-parallel as Megatron and BLOOM split theirs.

BLOOM's shape: word embedding, pre-LayerNorm blocks with one fused ``query_key_value`` Linear whose
output is laid out head by head (``[q_h | k_h | v_h]`` for each head ``h``), a dense output
projection, a 4x GELU MLP, a final LayerNorm and a vocabulary head. The fused layout is what lets
``ColwiseParallel`` split the fused weight by rows and hand each TP rank whole heads (q, k and v of
each), with no re-layout. Positions are RoPE (computed from positions on the fly: no buffers), which
needs no per-head state, so a TP rank's heads need not know their global index (ALiBi's slopes
would). The head is not tied to the embedding: the two live on different pipeline stages.

TP plan (Megatron's): ``query_key_value`` and ``mlp.up`` column-parallel, ``dense`` and ``mlp.down``
row-parallel; LayerNorms, the embedding and the head stay plain replicated parameters.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """Sizes of the decoder.

    Attributes:
        vocab: vocabulary size.
        hidden: model width.
        heads: attention heads (divisible by the TP size).
        layers: decoder blocks (divisible by the pipeline size).
        seq: sequence length.
    """

    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 16


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` shaped ``(batch, heads, seq, head_dim)`` (half-split form)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., : dim // 2], x[..., dim // 2:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with BLOOM's fused, head-major ``query_key_value``; under
    column-parallel QKV each TP rank runs its own heads (the count follows from the local width)."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.head_dim = shape.hidden // shape.heads
        self.query_key_value = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.dense = nn.Linear(shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        fused = self.query_key_value(x).view(b, s, -1, 3, self.head_dim)  # (b, s, local heads, q|k|v, d)
        q, k, v = (fused[:, :, :, i].transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """BLOOM's 4x GELU MLP."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.up = nn.Linear(shape.hidden, 4 * shape.hidden)
        self.down = nn.Linear(4 * shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-LayerNorm decoder block."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(shape.hidden)
        self.attn = Attention(shape)
        self.post_attention_layernorm = nn.LayerNorm(shape.hidden)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Stage(nn.Module):
    """A run of the decoder: the embedding (first stage), some blocks, the final norm and head
    (last stage). The whole decoder is the one stage that has all of them."""

    def __init__(self, blocks: list[Block], embed: nn.Embedding | None, ln_f: nn.LayerNorm | None,
                 head: nn.Linear | None) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = ln_f
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def build_stage(shape: DecoderShape, pp_rank: int = 0, pp_size: int = 1, seed: int = 0) -> Stage:
    """Stage ``pp_rank`` of ``pp_size`` of the decoder (the whole decoder when ``pp_size == 1``);
    every stage of one seed is cut from the same whole decoder, so the weights agree with one process."""
    torch.manual_seed(seed)
    embed = nn.Embedding(shape.vocab, shape.hidden)
    blocks = [Block(shape) for _ in range(shape.layers)]
    ln_f, head = nn.LayerNorm(shape.hidden), nn.Linear(shape.hidden, shape.vocab)
    per = shape.layers // pp_size
    last = pp_rank == pp_size - 1
    return Stage(blocks[pp_rank * per:(pp_rank + 1) * per], embed if pp_rank == 0 else None,
                 ln_f if last else None, head if last else None)


def tensor_parallel(stage: Stage, tp_mesh: object) -> Stage:
    """Apply the Megatron plan to ``stage``'s blocks on ``tp_mesh`` (in place; returns ``stage``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(stage.blocks)):
        plan |= {f"blocks.{i}.attn.query_key_value": ColwiseParallel(), f"blocks.{i}.attn.dense": RowwiseParallel(),
                 f"blocks.{i}.mlp.up": ColwiseParallel(), f"blocks.{i}.mlp.down": RowwiseParallel()}
    parallelize_module(stage, tp_mesh, plan)
    return stage


def tp_split_numel(stage: Stage) -> tuple[int, int]:
    """``(replicated, split)`` parameter counts of an unparallelized stage under :func:`tensor_parallel`'s plan."""
    split = sum(p.numel() for n, p in stage.named_parameters()
                if any(k in n for k in ("query_key_value", "attn.dense.weight", "mlp.up", "mlp.down.weight")))
    return sum(p.numel() for p in stage.parameters()) - split, split
