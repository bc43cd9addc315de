"""Placements per parameter group (``param_groups[i]["zero_placement"]``): a group's masters and
optimizer state live with its own placement, bitwise the same training as one engine-wide
placement, with LR schedulers, state dicts and the refusals of what stays engine-wide."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import OPT, Variant, build_model, train_ranks

from plait.kernels.testing import run_distributed
from plait.zero_sharding import LocalPlacement, ZeroConfig, zero_shard

STEPS = 6


class HostCopy(LocalPlacement):
    """Keeps its masters in tensors of its own (as an offloading placement does), steps them there
    and copies them back into the compute shards; records the keys it was given."""

    grad_device = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.stepped: set[str] = set()

    def place_master(self, key: str, master: torch.Tensor) -> torch.Tensor:
        return super().place_master(key, torch.nn.Parameter(master.detach().clone()))

    def step(self, optimizer: torch.optim.Optimizer, grads: Any) -> None:
        self.stepped.update(grads)
        super().step(optimizer, grads)


def _groups(model: torch.nn.Module, placement: Any) -> list[dict[str, Any]]:
    first = [p for n, p in model.named_parameters() if ".0." in n]
    rest = [p for n, p in model.named_parameters() if ".0." not in n]
    second: dict[str, Any] = {"params": rest, "lr": 2e-3}
    if placement is not None:
        second["zero_placement"] = placement
    return [{"params": first}, second]


def _build(stage: int, placement: Any) -> tuple[torch.nn.Module, Any]:
    model = build_model()
    config = ZeroConfig(stage=stage, reduce_bucket_elements=20_000, reduce_dtype=torch.float32)
    return zero_shard(model, torch.optim.AdamW, config, param_groups=_groups(model, placement),
                      weight_decay=OPT["weight_decay"], lr=OPT["lr"])


def _train(stage: int, placement: Any) -> dict[str, Any]:
    """STEPS steps with an LR schedule, then 2 more; the state after STEPS is kept."""
    model, optimizer = _build(stage, placement)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    for _ in range(2):
        losses += train_ranks(model, optimizer, Variant(steps=STEPS // 2))
        schedule.step()
        schedule.step()
    # deepcopy: like torch's, the optimizer state dict references live state tensors.
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    lrs = [group["lr"] for group in optimizer.param_groups]
    more = train_ranks(model, optimizer, Variant(steps=2))
    keys = sorted(unit.key for unit in optimizer.engine.units if unit.option_index == 1)
    return {"losses": losses, "state": saved[0], "lrs": lrs, "more": more, "saved": saved, "keys": keys,
            "groups": len(optimizer.param_groups)}


def _parity(stage: int) -> dict[str, Any]:
    plain = _train(stage, None)
    host = HostCopy()
    grouped = _train(stage, host)
    # A fresh engine with the same groups loads the state saved after STEPS and continues alike.
    model, optimizer = _build(stage, HostCopy())
    model.load_state_dict(grouped["saved"][0])
    optimizer.load_state_dict(grouped["saved"][1])
    resumed = train_ranks(model, optimizer, Variant(steps=2))
    for run in (plain, grouped):
        del run["saved"]
    return {"plain": plain, "grouped": grouped, "stepped": sorted(host.stepped), "resumed": resumed}


def _rank_parity(stages: list[int]) -> list[dict[str, Any]]:
    return [_parity(stage) for stage in stages]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_group_placement_trains_bitwise_like_one_placement(stage: int) -> None:
    results = run_distributed(_rank_parity, 2, [stage], timeout=240)
    for rank_result in results:
        got = rank_result[0]
        plain, grouped = got["plain"], got["grouped"]
        assert grouped["losses"] == plain["losses"] and grouped["more"] == plain["more"]
        assert plain["state"].keys() == grouped["state"].keys()
        for name, value in grouped["state"].items():
            assert torch.equal(value, plain["state"][name]), name
        # The user's group order, and the scheduler reached both groups.
        assert grouped["lrs"] == plain["lrs"] == [OPT["lr"] / 4, 2e-3 / 4]
        assert grouped["groups"] == 2
        assert got["stepped"] == grouped["keys"] and grouped["keys"]  # the group's placement: its units only
        assert got["resumed"] == grouped["more"]  # optimizer state_dict round trip


class WithStorage(LocalPlacement):
    """A placement that would keep parameter shards in a storage (engine-wide only)."""

    def shard_storage(self) -> object:
        return object()


def _refusals() -> list[str]:
    messages = []
    for placement in (object(), WithStorage()):
        model = build_model()
        try:
            zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), param_groups=_groups(model, placement))
        except ValueError as exc:
            messages.append(str(exc))
    model, optimizer = _build(2, HostCopy())
    try:
        optimizer.load_state_dict({**optimizer.state_dict(), "inner": {"optimizers": []}})
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_group_placement_refusals_name_the_group() -> None:
    messages, = run_distributed(_refusals, 1, timeout=120)
    assert len(messages) == 3, messages
    assert "param_groups[1]['zero_placement'] is a object without" in messages[0]
    assert "param_groups[1]'s placement offers shard_storage()" in messages[1]
    assert "composes 2 placements' optimizers; the state dict holds 0" in messages[2]
