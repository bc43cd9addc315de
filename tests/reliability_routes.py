"""The chaos campaign's routes beyond the seven ZeRO strategy setups: 1-bit Adam, Ulysses
(``sp_size``) and expert parallelism (``ep_size``), each a tiny model at two ranks.

``reliability_restart_job.py`` takes a route name (a key of :data:`ROUTES`) where it takes a ZeRO
variant, and trains, checkpoints, resumes and preempts exactly as for those; only the model, its
optimizer and its training step come from here:

* ``1bit``: tiny-llama under ZeRO-2 with :class:`~plait.onebit_optim.OnebitAdam` (warm-up of
  :data:`FREEZE` steps, then compressed steps whose error feedback lives in the checkpoint);
* ``sp2``: a tiny Hugging Face Llama under Ulysses at ``sp_size=2`` (dp=1) and ZeRO-3;
* ``ep2``: tiny-llama with four experts at ``ep_size=2`` under ZeRO-2.

Each step's data depends only on the step, so a resumed run sees what the uninterrupted one saw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.testing import global_batch, rank_slice

BATCH, SEQ, FREEZE = 8, 16, 3
LR = 1e-3
HF_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)
MOE = dict(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=48, vocab_size=300, num_experts=4)

Step = Callable[[int], float]  # step index -> this rank's loss, after the optimizer step


def _plain_step(model: torch.nn.Module, optimizer: Any) -> Step:
    """A data-parallel step: this rank's slice of the step's global batch."""

    def step(index: int) -> float:
        batch = rank_slice(global_batch(index, BATCH, SEQ), dist.get_rank(), dist.get_world_size())
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    return step


def onebit() -> tuple[torch.nn.Module, Any, Step]:
    """1-bit Adam under ZeRO-2 on tiny-llama."""
    from plait.kernels.testing import tiny_llama
    from plait.onebit_optim import OnebitAdam, OnebitAdamConfig
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    model = tiny_llama(num_layers=2, hidden_size=64, num_heads=2)
    model, optimizer = zero_shard(model, OnebitAdam, ZeroConfig(stage=2), lr=LR,
                                  onebit_config=OnebitAdamConfig(freeze_step=FREEZE))
    return model, optimizer, _plain_step(model, optimizer)


def ulysses() -> tuple[torch.nn.Module, Any, Step]:
    """A tiny HF Llama under Ulysses sp=2 (all ranks one sequence-parallel group) and ZeRO-3."""
    import transformers

    from plait.kernels.mesh import make_mesh
    from plait.ulysses_sp import shard_batch, sp_cross_entropy
    from plait.ulysses_sp.hf import apply_ulysses
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**HF_LLAMA)
    config._attn_implementation = "sdpa"
    mesh = make_mesh(dp=1, sp=dist.get_world_size())
    model = apply_ulysses(transformers.AutoModelForCausalLM.from_config(config), mesh)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh, lr=LR)
    model.train()

    def step(index: int) -> float:
        ids = torch.randint(0, HF_LLAMA["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(index))
        local = shard_batch({"input_ids": ids, "labels": ids}, mesh)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        # ZeRO averages gradients over all ranks; each holds a share of one sequence's loss.
        share = sp_cross_entropy(logits, local["shift_labels"], mesh, scale=dist.get_world_size())
        share.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(share.detach())

    return model, optimizer, step


def experts() -> tuple[torch.nn.Module, Any, Step]:
    """Tiny-llama with four experts, expert parallel at ep_size=2, under ZeRO-2."""
    from plait.kernels.testing import tiny_llama_moe
    from plait.moe_layers import apply_expert_parallel, make_expert_parallel_groups, zero_param_groups
    from plait.moe_layers.tiny_llama import convert_tiny_llama_moe
    from plait.zero_sharding import ZeroConfig, zero_shard

    torch.manual_seed(0)
    model = tiny_llama_moe(**MOE)
    convert_tiny_llama_moe(model)
    groups = make_expert_parallel_groups(2)
    apply_expert_parallel(model, groups)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=2), lr=LR,
                                  param_groups=zero_param_groups(model, groups))
    return model, optimizer, _plain_step(model, optimizer)


ROUTES: dict[str, Callable[[], tuple[torch.nn.Module, Any, Step]]] = {
    "1bit": onebit, "sp2": ulysses, "ep2": experts,
}
