"""HF BLOOM and GPT-2 under torch's tensor parallelism (``parallelize_module``, DTensor), for the tests.

BLOOM is all ``nn.Linear``: torch's own ``ColwiseParallel`` / ``RowwiseParallel`` apply, and the
head-interleaved ``query_key_value`` (per head ``[q|k|v]``) split in contiguous row blocks gives each
rank whole heads, so its DTensor placement (``Shard(0)``) already is the right layout. The rank's
attention modules are told their local head count, and ALiBi (built by the model for every head)
is cut to the rank's heads.

GPT-2's ``Conv1D`` stores ``[in, out]`` (an ``nn.Linear`` weight transposed), which torch's styles
refuse; the package's ``plait.universal_ckpt.parallel_styles`` (``Conv1DColwiseParallel``,
``Conv1DRowwiseParallel``) apply the same hooks with transposed placements. The fused ``c_attn``
``[q|k|v]`` gives rank r ``[q_r|k_r|v_r]``, which no DTensor placement of the consolidated tensor
describes, so the checkpoint needs the style's ``checkpoint_rules`` (a ``TensorLayout`` with ``parts``).
"""

from __future__ import annotations

import torch

import plait.universal_ckpt as uc
from plait.universal_ckpt import TensorLayout

VOCAB, HIDDEN, HEADS = 64, 32, 4
HEAD_DIM = HIDDEN // HEADS
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def bloom(seed: int):
    """A tiny random HF BLOOM (tied embeddings, no dropout), biases random so misplaced pieces show."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    config = BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=HEADS, hidden_dropout=0.0,
                         attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _random_biases(BloomForCausalLM(config))


def gpt2(seed: int):
    """A tiny random HF GPT-2 (tied embeddings, no dropout), biases random."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_head=HEADS, n_layer=2, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    return _random_biases(GPT2LMHeadModel(config))


def _random_biases(model):
    with torch.no_grad():  # HF zero-initialises biases
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


def bloom_tp(model, mesh):
    """torch TP over ``mesh`` (1-D): column-parallel QKV and h->4h, row-parallel dense and 4h->h."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for index in range(len(model.transformer.h)):
        prefix = f"transformer.h.{index}"
        plan[f"{prefix}.self_attention.query_key_value"] = ColwiseParallel()
        plan[f"{prefix}.self_attention.dense"] = RowwiseParallel()
        plan[f"{prefix}.mlp.dense_h_to_4h"] = ColwiseParallel()
        plan[f"{prefix}.mlp.dense_4h_to_h"] = RowwiseParallel()
    model = parallelize_module(model, mesh, plan)
    tp, rank = mesh.size(), mesh.get_local_rank()
    for block in model.transformer.h:
        block.self_attention.num_heads = HEADS // tp
    build = model.transformer.build_alibi_tensor

    def rank_alibi(mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        alibi = build(mask, num_heads, dtype)  # [batch * heads, 1, length] for every head
        per_rank = num_heads // tp
        alibi = alibi.view(mask.shape[0], num_heads, *alibi.shape[1:])[:, rank * per_rank:(rank + 1) * per_rank]
        return alibi.reshape(-1, *alibi.shape[2:])

    model.transformer.build_alibi_tensor = rank_alibi  # instance attribute: this model only
    return model


def bloom_rules(*, as_gpt2_parts: bool = False) -> tuple:
    """BLOOM's rule: the interleaved QKV splits on whole heads (3 * head_dim rows each).
    ``as_gpt2_parts`` describes it as ``[q|k|v]`` blocks instead: the mistake a test must catch."""
    if as_gpt2_parts:
        return ((r".*query_key_value\.weight", TensorLayout(dim=0, parts=(HIDDEN,) * 3, unit=HEAD_DIM)),
                (r".*query_key_value\.bias", TensorLayout(dim=0, parts=(HIDDEN,) * 3, unit=HEAD_DIM)))
    return ((r".*query_key_value\.(weight|bias)", TensorLayout(dim=0, unit=3 * HEAD_DIM)),)


def gpt2_tp(model, mesh):
    """torch TP over ``mesh`` for GPT-2's Conv1D layers (the package's styles; fused c_attn split per
    q/k/v part), each rank's attention told its local widths and heads."""
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.universal_ckpt.parallel_styles import Conv1DColwiseParallel, Conv1DRowwiseParallel

    plan = {}
    for index in range(len(model.transformer.h)):
        prefix = f"transformer.h.{index}"
        plan[f"{prefix}.attn.c_attn"] = Conv1DColwiseParallel(parts=(HIDDEN,) * 3)
        plan[f"{prefix}.attn.c_proj"] = Conv1DRowwiseParallel()
        plan[f"{prefix}.mlp.c_fc"] = Conv1DColwiseParallel()
        plan[f"{prefix}.mlp.c_proj"] = Conv1DRowwiseParallel()
    model = parallelize_module(model, mesh, plan)
    for block in model.transformer.h:
        block.attn.split_size = HIDDEN // mesh.size()  # the local [q|k|v] widths
        block.attn.num_heads = HEADS // mesh.size()
    return model


def gpt2_rules(*, fused_as_one_block: bool = False) -> tuple:
    """GPT-2's rules: c_attn's q, k, v each split on heads, from the style's ``checkpoint_rules``.
    ``fused_as_one_block``: none (the DTensor's own Shard(1), which puts q and k columns on the
    wrong ranks)."""
    if fused_as_one_block:
        return ()
    from plait.universal_ckpt.parallel_styles import Conv1DColwiseParallel

    return Conv1DColwiseParallel(parts=(HIDDEN,) * 3).checkpoint_rules(r".*attn\.c_attn", unit=HEAD_DIM)


def tp_config(tp: int, rules: tuple) -> uc.ModelParallelConfig:
    """One TP group of ``tp`` ranks (ranks 0..tp-1), or a single process."""
    return uc.ModelParallelConfig(groups={"tp": tuple(range(tp))} if tp > 1 else {}, rules=rules if tp > 1 else ())


def consolidated(model, optimizer, tp: int) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW tensor in HF's single-process form, assembled by hand: full DTensors,
    with GPT-2's fused c_attn columns put back from ``[q_0|k_0|v_0|q_1|...]`` to ``[q|k|v]``."""
    out = {}
    for name, param in model.named_parameters():
        values = {f"model.{name}": param.detach()}
        for field, value in optimizer.state[param].items():
            values[f"optim.{field}.{name}"] = value
        for key, value in values.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
            if ".attn.c_attn." in key and tp > 1 and full.dim() > 0:
                rows = full.shape[:-1]
                full = full.reshape(*rows, tp, 3, HIDDEN // tp).transpose(-3, -2).reshape(*rows, 3 * HIDDEN)
            out[key] = full
    return out


def tokens() -> torch.Tensor:
    """Token ids for training and logits."""
    return torch.arange(2 * 12).reshape(2, 12) * 7 % VOCAB


def train(model, optimizer, steps: int) -> list[float]:
    """``steps`` AdamW steps on a fixed batch; the losses."""
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=tokens(), labels=tokens()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def logits(model) -> torch.Tensor:
    """The model's logits on ``tokens()`` (eval mode)."""
    return model.eval()(input_ids=tokens()).logits.detach().clone()
