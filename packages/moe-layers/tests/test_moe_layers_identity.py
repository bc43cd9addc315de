"""The global identity of expert parameters (``zero_global`` for plait-zero-sharding) and the ZeRO
parameter groups, checked without ZeRO: at W=4, dp=2 x ep=2 each rank's local experts map to
the rows (stacked experts) or indices (user modules) the whole model holds them at, and the
values there equal the whole model's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.testing import run_distributed
from plait.moe_layers import (
    MoE,
    MoEConfig,
    apply_expert_parallel,
    expert_global_identity,
    expert_parameters,
    make_expert_parallel_groups,
    zero_param_groups,
)

H, I, E = 8, 6, 4


class Net(nn.Module):
    """Two MoE layers: stacked gated experts, then user expert modules."""

    def __init__(self) -> None:
        super().__init__()
        self.stacked = MoE(MoEConfig(hidden_size=H, num_experts=E, intermediate_size=I))
        self.modules_ = MoE(MoEConfig(hidden_size=H, num_experts=E, intermediate_size=I),
                            experts=[nn.Linear(H, H) for _ in range(E)])
        self.head = nn.Linear(H, 2)


def _identity_worker(ep_size: int) -> dict:
    torch.manual_seed(0)
    whole = dict(Net().named_parameters())
    torch.manual_seed(0)
    model = Net()
    groups = make_expert_parallel_groups(ep_size)
    apply_expert_parallel(model, groups)
    identity = expert_global_identity(model)
    worst, seen = 0.0, {}
    for name, param in model.named_parameters():
        global_name, shape, row = identity(name, tuple(param.shape))
        seen[name] = (global_name, shape, row)
        value = whole[global_name].detach()[row:row + param.shape[0]] if shape != tuple(param.shape) else \
            whole[global_name].detach()
        assert value.shape == param.shape, name
        worst = max(worst, (value - param.detach()).abs().max().item())
    param_groups = zero_param_groups(model, groups, lr=0.1)
    expert_group = param_groups[1]
    return {"seen": seen, "worst": worst, "lr": [g["lr"] for g in param_groups],
            "experts": len(expert_group["params"]) == len(expert_parameters(model)),
            "edp": dist.get_world_size(expert_group["zero_group"]), "rank": dist.get_rank()}


def test_expert_identity_names_each_local_expert_globally() -> None:
    for result in run_distributed(_identity_worker, 4, 2, timeout=60):
        first = (result["rank"] % 2) * (E // 2)
        seen = result["seen"]
        assert result["worst"] == 0.0
        assert seen["stacked.experts.gate_up_proj"] == ("stacked.experts.gate_up_proj", (E, 2 * I, H), first)
        assert seen["stacked.experts.down_proj"] == ("stacked.experts.down_proj", (E, H, I), first)
        assert seen["modules_.experts.experts.1.weight"] == (f"modules_.experts.experts.{first + 1}.weight", (H, H), 0)
        assert seen["head.weight"] == ("head.weight", (2, H), 0)  # not an expert: itself
        assert result["lr"] == [0.1, 0.1] and result["experts"] and result["edp"] == 2


def test_expert_identity_is_trivial_without_expert_parallelism() -> None:
    for result in run_distributed(_identity_worker, 2, 1, timeout=60):
        assert result["worst"] == 0.0
        assert all(value == (name, value[1], 0) for name, value in result["seen"].items())
        assert result["edp"] == 2
