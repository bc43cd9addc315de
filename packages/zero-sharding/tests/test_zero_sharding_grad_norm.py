"""The global gradient norm (clipping, ``last_grad_norm``) is accumulated in float64.

torch's CPU ``vector_norm`` of a large fp32 tensor accumulates in fp32 and is off by about 1e-4
relative on a million elements; DeepSpeed takes its per-tensor norms in float64. A clip
coefficient that far off moved plait's losses away from DeepSpeed's by 1e-5 over 20 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard
from plait.zero_sharding.grad_norm import NORM_CHUNK, shard_sumsq


def test_shard_sumsq_is_the_float64_sum_of_squares() -> None:
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(2 * NORM_CHUNK + 4096, generator=gen) * 1e-3
    grad[:1000] *= 50  # a few large entries, as in an embedding or head gradient
    exact = grad.double().square().sum().item()
    assert shard_sumsq(grad).dtype == torch.float64
    assert shard_sumsq(grad).item() == pytest.approx(exact, rel=1e-12)
    # what the fp32 accumulation gave: far outside that
    assert abs(torch.linalg.vector_norm(grad).double().square().item() - exact) / exact > 1e-6
    assert shard_sumsq(grad.reshape(-1, 64)).item() == shard_sumsq(grad).item()  # any shape, same pieces
    assert shard_sumsq(torch.empty(0)).item() == 0.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 2048), nn.Tanh(), nn.Linear(2048, 512))  # 1.6M parameters


def _rank_norms(stage: int) -> tuple[float, float]:
    """plait's norm of one step's averaged gradient, and the float64 norm of that same average
    computed from every rank's local gradient (a plain copy of the model, the same batch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    inputs = torch.randn(8, 256)[rank::world]
    plain = _model()
    plain(inputs).square().mean().backward()
    local = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    every = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(every, local)
    average = torch.stack(every).sum(0) * (1.0 / world)  # the reduce-scatter's sum, then the mean
    expected = average.double().square().sum().sqrt().item()
    model, optimizer = zero_shard(copy.deepcopy(_model()), torch.optim.AdamW,
                                  ZeroConfig(stage=stage, max_grad_norm=1e-3), lr=1e-3)
    model(inputs).square().mean().backward()
    optimizer.step()
    return optimizer.last_grad_norm, expected


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_norm_equals_the_float64_norm_of_the_averaged_gradient(stage: int) -> None:
    for got, expected in run_distributed(_rank_norms, 2, stage, timeout=120):
        assert got == pytest.approx(expected, rel=1e-12)
