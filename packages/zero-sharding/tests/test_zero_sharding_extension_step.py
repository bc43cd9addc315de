"""Extensions that know the engine and the step: per-group reducers and gatherers, ``bind``,
step and skipped-step notifications, extension tensors in the sharded state dict."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.sharded_state import ShardedTensor, ShardSpec
from plait.kernels.testing import run_distributed
from plait.zero_sharding import DefaultGatherer, DefaultReducer, ZeroConfig, zero_shard


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return sum(e(h) for e in self.experts).square().mean()


class Watching(DefaultReducer):
    """A reducer that keeps per-unit state (the sum of its reduced shards), hears about steps and
    saves its state with the model, as a 1-bit optimizer's error feedback would."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.keys: list[str] = []
        self.steps: list[tuple[str, int]] = []
        self.totals: dict[str, torch.Tensor] = {}
        self.loaded: list[str] = []

    def bind(self, engine: Any) -> None:
        self.engine = engine
        self.totals = {u.key: torch.zeros(u.shard_numel) for u in engine.units if u.reducer is self}

    def reduce_scatter(self, full: torch.Tensor, shard_out: torch.Tensor, *, group: Any, key: str) -> None:
        self.keys.append(key)
        collectives.reduce_scatter_tensor(shard_out, full, group=group)
        self.totals[key] += shard_out

    def on_step(self, step: int) -> None:
        self.steps.append(("step", step))

    def on_skipped_step(self, step: int) -> None:
        self.steps.append(("skipped", step))

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        out = {}
        for unit in self.engine.units:
            if unit.reducer is self:
                for slot, (plo, phi), (slo, shi) in unit.local_pieces():
                    name = f"ext.totals.{slot.name}"
                    spec = ShardSpec(name=name, kind="optimizer_state", dtype=torch.float32, global_shape=slot.shape,
                                     flat_range=(plo, phi), replica_ranks=(dist.get_rank(),))
                    out[name] = ShardedTensor(spec, self.totals[unit.key][slo:shi])
        return out

    def load_sharded_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        self.loaded = sorted(state)


class CountingGatherer(DefaultGatherer):
    def __init__(self) -> None:
        self.keys: list[str] = []

    def all_gather(self, shard: torch.Tensor, full_out: torch.Tensor, *, group: Any, key: str, phase: str) -> Any:
        self.keys.append(key)
        return super().all_gather(shard, full_out, group=group, key=key, phase=phase)


def _per_group_extensions() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Experts()
    reducer, gatherer = Watching(), CountingGatherer()
    experts = list(model.experts.parameters())
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    groups = [{"params": dense}, {"params": experts, "zero_reducer": reducer, "zero_gatherer": gatherer}]
    model, optimizer = zero_shard(model, torch.optim.SGD, ZeroConfig(stage=3, param_persistence_threshold=0), lr=0.1,
                                  param_groups=groups)
    expert_keys = {u.key for u in model.zero_engine.units if u.option_index == 1}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        loss = model(x)
        (loss * float("inf") if step == 1 else loss).backward()  # step 1 overflows: every rank skips
        optimizer.step()
        optimizer.zero_grad()
    state = model.sharded_state_dict()
    model.load_sharded_state_dict(state)
    return {"bound": reducer.engine is model.zero_engine, "steps": reducer.steps,
            "reduced": set(reducer.keys), "gathered": set(gatherer.keys), "expert_keys": expert_keys,
            "ext_pieces": sorted(n for n in state if n.startswith("ext.")), "loaded": reducer.loaded}


def test_per_group_extensions_bind_hear_steps_and_save_state():
    for result in run_distributed(_per_group_extensions, 2, timeout=90):
        assert result["bound"]
        assert result["steps"] == [("step", 1), ("skipped", 1), ("step", 2)]
        assert result["reduced"] == result["expert_keys"] and result["gathered"] == result["expert_keys"]
        assert result["ext_pieces"] and all(n.startswith("ext.totals.experts.") for n in result["ext_pieces"])
        assert result["loaded"] == result["ext_pieces"]
