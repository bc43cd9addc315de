"""``ZeroOptimizer.step_then_zero_grad`` (what the DeepSpeed shim's ``engine.step()`` calls) averages and
clips the reduced gradient shards in place; its fp32 master shards, moments and gradient norms must be bit for bit
those of ``step(); zero_grad()``, with clipping active, at W=2 (so the averaging factor is not 1), and
also after ``clip_grad_norm_`` (whose cached gradients are copies). Its benchmark:
``plait bench deepspeed-shim``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.kernels.testing import global_batch, rank_slice, run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import build_model

STEPS = 4


CASES = [(stage, dtype, how) for stage, dtype in ((2, "float32"), (3, "float32"), (2, "bfloat16"))
         for how in ("plain", "spent", "clip-first")]


def _train(stage: int, dtype: str, how: str) -> dict[str, object]:
    from plait.zero_sharding import ZeroConfig, zero_shard

    config = ZeroConfig(stage=stage, compute_dtype=getattr(torch, dtype), max_grad_norm=0.05)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, lr=1e-2)
    norms, spent = [], 0
    for step in range(STEPS):
        batch = rank_slice(global_batch(step, 8, 16), dist.get_rank(), dist.get_world_size())
        model(**batch).loss.backward()
        if how == "clip-first":
            optimizer.clip_grad_norm_(0.05)
        if how == "plain":
            optimizer.step()
            optimizer.zero_grad()
        else:
            optimizer.step_then_zero_grad()
        spent += sum(unit.grad_shard is not None for unit in model.zero_engine.units)
        norms.append(optimizer.last_grad_norm)
    moments = [state["exp_avg"].clone() for state in optimizer.state.values()]
    masters = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
    return {"params": masters, "moments": moments, "norms": norms,
            "held": spent}


def _all_cases() -> dict[tuple[int, str, str], dict[str, object]]:
    torch.set_num_threads(1)
    return {case: _train(*case) for case in CASES}


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[int, str, str], dict[str, object]]]:
    return run_distributed(_all_cases, 2, timeout=300)  # one launch for every case: start-up dominates


@pytest.mark.parametrize(("stage", "dtype"), [(2, "float32"), (3, "float32"), (2, "bfloat16")])
def test_spent_step_is_bitwise_step_then_zero_grad(results: list, stage: int, dtype: str) -> None:
    for per_rank in results:
        plain = per_rank[(stage, dtype, "plain")]
        assert plain["norms"][0] > 0.05  # clipping is active
        for how in ("spent", "clip-first"):
            other = per_rank[(stage, dtype, how)]
            assert other["held"] == 0  # the gradients are gone after the step, as after zero_grad()
            assert other["norms"] == plain["norms"]
            for a, b in zip(other["params"] + other["moments"], plain["params"] + plain["moments"], strict=True):
                assert torch.equal(a, b)
