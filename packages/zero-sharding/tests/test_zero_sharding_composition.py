"""The engine under what the packages built on it do: ``model.zero_grad()`` (the HF Trainer),
ranks that use different parameters (MoE experts), expert gradients beside dense ones, meshes with
more than one dimension. Each case is compared against a single-process reference on gloo."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import build_model

from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

STAGES = (1, 2, 3)


def _zero_grad_paths() -> dict[int, float]:
    """Max weight difference after 3 SGD steps between ``model.zero_grad()`` and
    ``optimizer.zero_grad()``, per stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in STAGES:
        finals = []
        for through_model in (False, True):
            config = ZeroConfig(stage=stage, param_persistence_threshold=0, reduce_bucket_elements=20_000)
            model, optimizer = zero_shard(build_model(), torch.optim.SGD, config, lr=0.1)
            for step in range(3):
                model(**rank_slice(global_batch(step, 8, 16), rank, world)).loss.backward()
                optimizer.step()
                (model if through_model else optimizer).zero_grad()
            finals.append(model.state_dict())
        out[stage] = max((finals[0][k] - finals[1][k]).abs().max().item() for k in finals[0])
    return out


def test_model_zero_grad_equals_optimizer_zero_grad():
    for per_stage in run_distributed(_zero_grad_paths, 2, timeout=120):
        assert per_stage == {stage: 0.0 for stage in STAGES}
