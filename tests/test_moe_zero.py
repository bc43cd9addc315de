"""MoE expert parallelism composed with ZeRO (cross-package: plait-moe-layers + plait-zero-sharding).

tiny-llama-MoE with its per-expert-loop MoE MLPs converted to plait MoE layers (weights kept), on
``dp=2 x ep=2`` (4 gloo ranks): experts sharded over ep, then ZeRO stages 1/2/3 with the dense
parameters sharded over all 4 ranks and the experts over their expert-data-parallel group (2
ranks), expert gradients divided by the data-parallel world like dense ones (B6). The reference
is one process holding every expert: per step, the mean of the 4 ranks' batch-slice losses and
one AdamW step on its gradient. Every rank's loss must equal the reference's loss on its slice,
step by step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("plait.zero_sharding")

from plait.kernels.testing import global_batch, rank_slice, run_distributed, tiny_llama_moe, train_losses
from plait.kernels.tolerances import tolerance
from plait.moe_layers import (
    apply_expert_parallel,
    dense_parameters,
    expert_parameters,
    make_expert_parallel_groups,
    moe_layers,
)
from plait.moe_layers.tiny_llama import convert_tiny_llama_moe
from plait.zero_sharding import ZeroConfig, zero_shard

STEPS, BATCH, SEQ, LR = 4, 8, 16, 1e-2
MODEL = dict(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=48, vocab_size=300, num_experts=4)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_llama_moe(**MODEL)
    convert_tiny_llama_moe(model)
    return model


def _reference_losses(world: int) -> list[list[float]]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        batch = global_batch(step, BATCH, SEQ)
        losses = [model(**rank_slice(batch, rank, world)).loss for rank in range(world)]
        (sum(losses) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append([loss.item() for loss in losses])
    return out


def _zero_ep_worker(stage: int, ep_size: int) -> list[float]:
    model = _model()
    groups = make_expert_parallel_groups(ep_size)
    apply_expert_parallel(model, groups)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage), lr=LR, param_groups=[
        {"params": dense_parameters(model)},
        {"params": expert_parameters(model), "zero_group": groups.edp_group},
    ])
    assert all(layer.ep_size == ep_size for layer in moe_layers(model))
    return train_losses(model, optimizer, STEPS, batch=BATCH, seq=SEQ)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_expert_parallel_equals_one_process(stage: int) -> None:
    world, ep_size = 4, 2
    results = run_distributed(_zero_ep_worker, world, stage, ep_size, timeout=180)
    reference = _reference_losses(world)
    tol = tolerance("moe_expert_parallel", torch.float32)
    assert reference[-1] != reference[0] and len(set(reference[0])) == world  # training moves; slices differ
    for step in range(STEPS):
        got = torch.tensor([results[rank][step] for rank in range(world)])
        torch.testing.assert_close(got, torch.tensor(reference[step]), atol=tol.atol, rtol=tol.rtol,
                                   msg=lambda m, s=step: f"stage {stage} step {s}: {m}")
