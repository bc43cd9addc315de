"""The extension points, each exercised by a small in-test implementation: a reducer that counts
its calls, a gatherer that records phases, a placement that keeps masters and optimizer state in
a dict of its own ("another device") and runs the step there. Training must match the defaults."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import OPT, Variant, build_model, train_ranks

from plait.kernels import collectives
from plait.kernels.testing import run_distributed
from plait.zero_sharding import (
    DefaultGatherer,
    DefaultReducer,
    GradientReducer,
    LocalPlacement,
    ParamGatherer,
    StatePlacement,
    ZeroConfig,
    zero_shard,
)


class CountingReducer:
    """Synchronous (returns None), counts calls per bucket key."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def reduce_scatter(self, full: torch.Tensor, shard_out: torch.Tensor, *, group: Any, key: str) -> None:
        assert full.numel() == shard_out.numel() * dist.get_world_size(group)
        self.calls[key] += 1
        collectives.reduce_scatter_tensor(shard_out, full, group=group)

    def all_reduce(self, tensor: torch.Tensor, *, group: Any, key: str) -> None:
        self.calls["all_reduce:" + key] += 1
        collectives.all_reduce(tensor, group=group)


class PhaseGatherer:
    """Asynchronous (returns the handle), records the phase of every gather."""

    def __init__(self) -> None:
        self.phases: Counter[str] = Counter()

    def all_gather(self, shard: torch.Tensor, full_out: torch.Tensor, *, group: Any, key: str, phase: str) -> Any:
        self.phases[phase] += 1
        return collectives.all_gather_into_tensor(full_out, shard, group=group, async_op=True)


class DictPlacement:
    """Masters and optimizer state live in this object's own tensors (standing in for a CPU or NVMe
    tier); the step runs there and results are copied back."""

    def __init__(self) -> None:
        self.store: dict[str, nn.Parameter] = {}
        self.steps = 0

    def place_master(self, key: str, master: torch.Tensor) -> nn.Parameter:
        self.store[key] = nn.Parameter(master.detach().clone())
        return self.store[key]

    def make_optimizer(self, build: Any, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return build(param_groups)

    def step(self, optimizer: torch.optim.Optimizer, grads: dict[str, torch.Tensor]) -> None:
        for key, grad in grads.items():
            self.store[key].grad = grad.clone()
        optimizer.step()
        for key in grads:
            self.store[key].grad = None
        self.steps += 1

    def read_master(self, key: str, out: torch.Tensor) -> None:
        out.copy_(self.store[key])

    def masters(self) -> dict[str, nn.Parameter]:
        return self.store


def _rank_extensions_all() -> list[dict]:
    return [_rank_extensions(2), _rank_extensions(3)]


def _rank_extensions(stage: int) -> dict:
    variant = Variant(steps=4)
    config = ZeroConfig(stage=stage, param_persistence_threshold=0, reduce_bucket_elements=30_000)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
    reference = train_ranks(model, optimizer, variant)
    reducer, gatherer, placement = CountingReducer(), PhaseGatherer(), DictPlacement()
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, reducer=reducer, gatherer=gatherer,
                                  placement=placement, **OPT)
    losses = train_ranks(model, optimizer, variant)
    units = model.zero_engine.units
    return {"reference": reference, "losses": losses, "reduce_calls": dict(reducer.calls),
            "phases": dict(gatherer.phases), "placement_steps": placement.steps, "keys": [u.key for u in units],
            "resident": [u.resident for u in units], "root": len(model.zero_engine.partition.root_units),
            "state_on_placement": all(m in optimizer.inner.state for m in placement.store.values())}


def test_defaults_satisfy_protocols() -> None:
    assert isinstance(DefaultReducer(), GradientReducer)
    assert isinstance(DefaultGatherer(), ParamGatherer)
    assert isinstance(LocalPlacement(), StatePlacement)
    assert isinstance(CountingReducer(), GradientReducer)
    assert isinstance(PhaseGatherer(), ParamGatherer)
    assert isinstance(DictPlacement(), StatePlacement)


@pytest.mark.timeout(200)
def test_custom_extensions_match_defaults() -> None:
    steps = 4
    per_rank = run_distributed(_rank_extensions_all, 2, timeout=180)
    for index, stage in enumerate((2, 3)):
        for r in (rank_results[index] for rank_results in per_rank):
            assert r["losses"] == r["reference"], f"stage {stage}: custom extensions changed the arithmetic"
            assert r["reduce_calls"] == {key: steps for key in r["keys"]}, r["reduce_calls"]
            assert r["placement_steps"] == steps and r["state_on_placement"]
            units = len(r["keys"])
            if stage == 2:
                assert r["phases"] == {"step": units * steps}
            else:
                sharded_modules = units - r["root"]
                assert r["phases"] == {"forward": units * steps, "backward": sharded_modules * steps}, r
