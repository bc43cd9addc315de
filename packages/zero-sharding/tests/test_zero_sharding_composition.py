"""The engine under what the packages built on it do: ``model.zero_grad()`` (the HF Trainer),
ranks that use different parameters (MoE experts), expert gradients beside dense ones, meshes with
more than one dimension. Each case is compared against a single-process reference on gloo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import build_model

from plait.kernels.collectives import ByteLedger
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


class Routed(torch.nn.Module):
    """A dense trunk around a ``ModuleList`` of experts; ``forward`` runs only the experts named
    (an MoE layer whose other experts got no tokens on this rank)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
            for _ in range(experts))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use: list[int]) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + sum(self.experts[e](h) for e in use)).square().mean()


def _routed_batch(step: int, rank: int) -> tuple[torch.Tensor, list[int]]:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank)), []


def _experts_of(step: int, rank: int, world: int) -> list[int]:
    """Rank r uses expert (r + step) % world, rank 0 also the next one: usage differs by rank and
    by step, and every expert is used somewhere."""
    first = (rank + step) % world
    return [first, (first + 1) % world] if rank == 0 else [first]


def _routed_reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Routed(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        loss = sum(model(_routed_batch(step, r)[0], _experts_of(step, r, world)) for r in range(world)) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _routed_ranks(steps: int) -> dict[int, float]:
    """Max difference to the single-process reference of a run where each rank uses its own
    experts, at every stage (stage 2 with one bucket per expert)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _routed_reference(world, steps)
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        config = ZeroConfig(stage=stage, param_persistence_threshold=0, reduce_bucket_elements=2_000)
        model, optimizer = zero_shard(Routed(world), torch.optim.AdamW, config, lr=1e-2, weight_decay=0.1)
        for step in range(steps):
            with ByteLedger() as ledger:
                model(_routed_batch(step, rank)[0], _experts_of(step, rank, world)).backward()
                optimizer.step()
            optimizer.zero_grad()
        # Whatever this rank used, every unit is reduced once and, at stage 3, gathered once in
        # forward and once in backward (the root once: it stays gathered through backward).
        engine = model.zero_engine
        gathers = sum(u.padded_numel * (1 if u.resident or u in engine.partition.root_units else 2)
                      for u in engine.units)
        expected = {"reduce_scatter": 4 * sum(u.padded_numel for u in engine.units),
                    "all_gather": 4 * gathers, "all_reduce": 16}
        assert ledger.by_op() == expected, (stage, ledger.by_op(), expected)
        final = model.state_dict()
        out[stage] = max((final[k] - reference[k]).abs().max().item() for k in reference)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_rank_divergent_experts_match_single_process(world):
    for per_stage in run_distributed(_routed_ranks, world, 3, timeout=120):
        assert all(diff < 1e-5 for diff in per_stage.values()), per_stage


def _expert_parallel_model(world: int, rank: int) -> Routed:
    """This rank's part of ``Routed(world)``: the dense trunk and expert ``rank`` only."""
    torch.manual_seed(0)
    whole = Routed(world)
    local = Routed(1)
    local.load_state_dict({k: v for k, v in whole.state_dict().items() if not k.startswith("experts.")}, strict=False)
    local.experts[0].load_state_dict(whole.experts[rank].state_dict())
    return local


def _expert_gradient_scale(stage: int, steps: int) -> float:
    """Max difference to the single-process reference when each rank holds one expert of its own,
    sharded over a group of one (expert parallelism over the whole world): SGD sees the gradient's
    scale directly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Routed(world)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(steps):
        (sum(reference(_routed_batch(step, r)[0], [r]) for r in range(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    singles = [dist.new_group([r]) for r in range(world)]  # new_group is collective: every rank, every group
    model = _expert_parallel_model(world, rank)
    experts = list(model.experts.parameters())
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    config = ZeroConfig(stage=stage, param_persistence_threshold=0)
    model, optimizer = zero_shard(model, torch.optim.SGD, config, lr=0.5, param_groups=[
        {"params": dense}, {"params": experts, "zero_group": singles[rank]}])
    for step in range(steps):
        model(_routed_batch(step, rank)[0], [0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    final = model.state_dict()
    expected = {k: v for k, v in reference.state_dict().items() if not k.startswith("experts.")}
    expected.update({f"experts.0.{k}": v for k, v in reference.experts[rank].state_dict().items()})
    return max((final[k] - expected[k]).abs().max().item() for k in expected)


@pytest.mark.parametrize("stage", STAGES)
def test_expert_and_dense_gradients_scaled_as_single_process(stage):
    assert max(run_distributed(_expert_gradient_scale, 2, stage, 3, timeout=90)) < 1e-5


def _refuses_bad_divisor() -> str:
    model = Routed(1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['zero_grad_divisor'\]=0 must be a positive") as info:
        zero_shard(model, torch.optim.SGD, ZeroConfig(stage=2), lr=0.1,
                   param_groups=[{"params": list(model.parameters()), "zero_grad_divisor": 0}])
    return str(info.value)


def test_bad_gradient_divisor_is_refused_naming_the_group():
    assert "data-parallel world" in run_distributed(_refuses_bad_divisor, 1, timeout=60)[0]


def _class_identity() -> tuple[str, str, bool, bool]:
    from plait.zero_sharding import ZeroModule

    model, _ = zero_shard(Routed(2), torch.optim.SGD, ZeroConfig(stage=3), lr=0.1)
    return type(model).__name__, model.zero_base_class.__name__, isinstance(model, Routed), \
        isinstance(model, ZeroModule)


def test_sharded_model_keeps_its_class_name_and_exposes_the_base_class():
    # Libraries read __class__.__name__ as the architecture (HF's config.json "architectures").
    assert run_distributed(_class_identity, 1, timeout=60) == [("Routed", "Routed", True, True)]
