"""Model-parallel fixtures for the tests: a Megatron-style tensor-parallel GPT-2 built from HF's.

The tensor-parallel model keeps HF ``GPT2LMHeadModel``'s module tree and names but holds local
shards (fused ``c_attn`` split per q/k/v part, row-parallel projections, a vocabulary-parallel
embedding and LM head with padding); its forward is written here with explicit collectives, so
its logits equal HF's only when every shard is the right piece. The slicing below is written out
by hand (not through plait.universal_ckpt.layouts), so it is an independent oracle.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import plait.universal_ckpt as uc
from plait.kernels import collectives
from plait.universal_ckpt import TensorLayout

VOCAB, HIDDEN, HEADS, POSITIONS = 50, 32, 4, 16


def gpt2(seed: int, layers: int = 2):
    """A tiny random HF GPT-2 (untied LM head, eval mode), built offline."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_head=HEADS, n_layer=layers, n_positions=POSITIONS,
                        tie_word_embeddings=False, attn_implementation="eager", bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF zero-initialises biases; random ones make misplaced pieces visible
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


def padded_vocab(tp: int) -> int:
    """Megatron-style padding: a multiple of 4 * tp (so TP=2 and TP=4 pad differently)."""
    return math.ceil(VOCAB / (4 * tp)) * 4 * tp


def rules(tp: int, *, fused_as_one_block: bool = False) -> tuple:
    """The layout rules of the tensor-parallel GPT-2 (``fused_as_one_block``: the classic mistake)."""
    head = HIDDEN // HEADS
    parts = None if fused_as_one_block else (HIDDEN,) * 3
    vocab = TensorLayout(dim=0, padded_size=padded_vocab(tp), vocab_size=VOCAB)
    return (
        (r"transformer\.wte\.weight", vocab), (r"lm_head\.weight", vocab),
        (r".*attn\.c_attn\.weight", TensorLayout(dim=1, parts=parts, unit=head)),
        (r".*attn\.c_attn\.bias", TensorLayout(dim=0, parts=parts, unit=head)),
        (r".*attn\.c_proj\.weight", TensorLayout(dim=0, unit=head)),
        (r".*mlp\.c_fc\.weight", TensorLayout(dim=1)), (r".*mlp\.c_fc\.bias", TensorLayout(dim=0)),
        (r".*mlp\.c_proj\.weight", TensorLayout(dim=0)),
    )


def shard(full: torch.Tensor, name: str, rank: int, tp: int) -> torch.Tensor:
    """This rank's piece of a consolidated HF GPT-2 tensor, sliced by hand."""
    if name in ("transformer.wte.weight", "lm_head.weight"):
        return F.pad(full, (0, 0, 0, padded_vocab(tp) - VOCAB)).chunk(tp, 0)[rank].clone()
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        dim = full.dim() - 1
        return torch.cat([part.chunk(tp, dim)[rank] for part in full.split(HIDDEN, dim)], dim).clone()
    if name.endswith("mlp.c_fc.weight"):
        return full.chunk(tp, 1)[rank].clone()
    if name.endswith("mlp.c_fc.bias") or name.endswith("c_proj.weight"):
        return full.chunk(tp, 0)[rank].clone()
    return full.clone()


def tensor_parallel(model, rank: int, tp: int):
    """Turn an HF GPT-2 into this rank's tensor-parallel shard (in place) and return it."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.data = shard(param.data, name, rank, tp)
    return model


def config(tp: int, **kwargs) -> uc.ModelParallelConfig:
    """The rank's ModelParallelConfig: one TP group of the whole world (or a single process)."""
    group = tuple(range(tp)) if tp > 1 else ()
    return uc.ModelParallelConfig(groups={"tp": group} if group else {}, rules=rules(tp, **kwargs))


def _reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp > 1:
        collectives.all_reduce(x)
    return x


@torch.no_grad()
def tp_logits(model, ids: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Forward of the tensor-parallel GPT-2: the full ``[B, T, VOCAB]`` logits on every rank."""
    t = model.transformer
    rows = padded_vocab(tp) // tp
    local_ids = ids - rank * rows
    inside = (local_ids >= 0) & (local_ids < rows)
    x = F.embedding(local_ids.clamp(0, rows - 1), t.wte.weight) * inside.unsqueeze(-1)
    x = _reduce(x, tp) + t.wpe.weight[: ids.shape[1]]
    heads, head = HEADS // tp, HIDDEN // HEADS
    for block in t.h:
        a = F.layer_norm(x, (HIDDEN,), block.ln_1.weight, block.ln_1.bias, 1e-5)
        q, k, v = (a @ block.attn.c_attn.weight + block.attn.c_attn.bias).split(heads * head, -1)
        q, k, v = (z.unflatten(-1, (heads, head)).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        x = x + _reduce(o @ block.attn.c_proj.weight, tp) + block.attn.c_proj.bias
        m = F.layer_norm(x, (HIDDEN,), block.ln_2.weight, block.ln_2.bias, 1e-5)
        f = F.gelu(m @ block.mlp.c_fc.weight + block.mlp.c_fc.bias, approximate="tanh")
        x = x + _reduce(f @ block.mlp.c_proj.weight, tp) + block.mlp.c_proj.bias
    x = F.layer_norm(x, (HIDDEN,), t.ln_f.weight, t.ln_f.bias, 1e-5)
    local = x @ model.lm_head.weight.T
    if tp > 1:
        gathered = [torch.empty_like(local) for _ in range(tp)]
        collectives.all_gather(gathered, local.contiguous())
        local = torch.cat(gathered, -1)
    return local[..., :VOCAB]


def tokens() -> torch.Tensor:
    """A fixed batch of token ids covering the vocabulary's last rows (the padded rank's)."""
    return torch.arange(2 * 12).reshape(2, 12) * 7 % VOCAB


def llama(seed: int):
    """A tiny random HF Llama (4 heads, 4 KV heads so TP=4 divides them), eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                         attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def torch_tp(model, mesh):
    """torch's own tensor parallelism on a Llama: column-parallel q/k/v/gate/up, row-parallel o/down."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for index in range(len(model.model.layers)):
        prefix = f"model.layers.{index}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def llama_batch() -> torch.Tensor:
    """Token ids for the Llama runs."""
    return torch.arange(2 * 10).reshape(2, 10) * 5 % 64


def train(model, optimizer, steps: int) -> list[float]:
    """``steps`` AdamW steps on a fixed batch; the losses."""
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(llama_batch(), labels=llama_batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def torch_tp_sp(model, mesh):
    """torch TP with sequence parallelism on a Llama (torchtitan's plan): norms under ``SequenceParallel``
    (Replicate parameters, sequence-sharded activations), embedding and row-parallel outputs
    ``Shard(1)`` over the sequence, q/k/v/gate/up column-parallel, the LM head gathering."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # DTensor outputs between layers (use_local_output=False): HF builds positions and masks from
    # the hidden states' shape, which must stay the global sequence length.
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for index in range(len(model.model.layers)):
        prefix = f"model.layers.{index}"
        plan.update({
            f"{prefix}.input_layernorm": SequenceParallel(), f"{prefix}.post_attention_layernorm": SequenceParallel(),
            f"{prefix}.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                      desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            f"{prefix}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{prefix}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{prefix}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
    return parallelize_module(model, mesh, plan)
