"""torchao's low-bit optimizers as ZeRO's inner optimizer (skipped without torchao).

At W=2, ZeRO-1 (AdamW8bit) and ZeRO-2 (AdamW4bit) with one parameter per unit give, bit for bit,
the weights of one process running the same torchao optimizer over the parameters on the same
averaged gradients: shards are padded to whole quantisation blocks, so each parameter's blocks are
its own. The large weight's states are quantized on both sides (its shard has >= 4096 elements);
the bias's stay fp32 on both (torchao's threshold). A bad block_size is refused naming the option."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

torchao_optim = pytest.importorskip("torchao.optim")

WORLD, STEPS = 2, 2
OPTIONS = dict(lr=1e-3, weight_decay=0.1)
# torchao compiles its step per tensor shape in every process (most of this test's time), so each
# optimizer runs once: 8-bit under ZeRO-1, 4-bit under ZeRO-2 (both also pass at the other stage).
JOBS = [("AdamW8bit", 1), ("AdamW4bit", 2)]


def _model() -> nn.Module:
    torch.manual_seed(0)  # 128 x 128 weights: 8192 elements per shard, 32 whole blocks of 256
    return nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128, bias=False))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(8, 128, generator=torch.Generator().manual_seed(rank))


def _rank_jobs(jobs: list[tuple[str, int]]) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    out = []
    for name, stage in jobs:
        config = ZeroConfig(stage=stage, reduce_bucket_elements=1, reduce_dtype=torch.float32)
        model, optimizer = zero_shard(_model(), getattr(torchao_optim, name), config, **OPTIONS)
        for _ in range(STEPS):
            model(_batch(rank)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        block = getattr(torchao_optim, name)([nn.Parameter(torch.zeros(1))]).block_size
        shards = [unit.shard_numel for unit in model.zero_engine.units]
        kinds = sorted({type(state["exp_avg"]).__name__ for state in optimizer.inner.state.values()})
        state = model.state_dict()
        out.append({"weights": {k: v.clone() for k, v in state.items()} if rank == 0 else {},
                    "aligned": all(n % block == 0 for n in shards), "kinds": kinds})
    return out


def _reference(name: str) -> dict[str, torch.Tensor]:
    """One process over the parameters: each rank's batch backward separately, gradients summed
    and halved, as the reduce-scatter does."""
    model = _model()
    optimizer = getattr(torchao_optim, name)(model.parameters(), **OPTIONS)
    params = list(model.parameters())
    for _ in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(WORLD):
            model(_batch(rank)).square().mean().backward()
            for acc, p in zip(total, params):
                acc.add_(p.grad)
                p.grad = None
        for acc, p in zip(total, params):
            p.grad = acc * (1.0 / WORLD)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_torchao_lowbit_optimizers_match_one_process_bitwise() -> None:
    results = run_distributed(_rank_jobs, WORLD, JOBS, timeout=600.0)[0]
    initial = dict(_model().named_parameters())
    for (name, stage), found in zip(JOBS, results):
        assert found["aligned"], (name, stage)
        assert found["kinds"] == sorted({"Tensor", "OptimState" + name.removeprefix("AdamW")}), found["kinds"]
        for pname, ref in _reference(name).items():
            got = found["weights"][pname]
            assert torch.equal(got, ref), f"{name} stage {stage}: {pname} differs by {(got - ref).abs().max():.3g}"
            assert not torch.equal(ref, initial[pname]), f"{name}: {pname} did not train"


def test_bad_block_size_is_refused_naming_the_option() -> None:
    from plait.zero_sharding.lowbit import is_lowbit, lowbit_block_size

    assert is_lowbit(torchao_optim.AdamW8bit) and not is_lowbit(torch.optim.AdamW)
    assert lowbit_block_size(torchao_optim.AdamW8bit, torchao_optim.AdamW8bit, {}) == 256
    assert lowbit_block_size(torchao_optim.AdamW4bit, torchao_optim.AdamW4bit, {}) == 128
    with pytest.raises(ValueError, match=r"AdamW8bit\(block_size=0\).*positive integer"):
        lowbit_block_size(torchao_optim.AdamW8bit, torchao_optim.AdamW8bit, {"block_size": 0})
