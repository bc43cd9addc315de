"""``OffloadConfig(memory_budget=...)``: the knobs it chooses, what it keeps, what it refuses."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from plait.offload_io import IOConfig, OffloadConfig, OffloadedOptimizer, zero_placement
from plait.offload_io import budget as budget_module
from plait.offload_io.budget import (
    RUNTIME_BYTES,
    largest_unit_numel,
    parse_budget,
    plan_for_budget,
    required_bytes,
    smallest_budget,
)

GIB, MIB = 1 << 30, 1 << 20


class Decoder(nn.Module):
    """An ordinary decoder-shaped module: embedding, ModuleList of blocks, head."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim))
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)


def test_sizes_and_fractions_parse() -> None:
    assert parse_budget("1GiB") == GIB
    assert parse_budget("768MiB") == 768 * MIB
    assert parse_budget("2GB") == 2 * 10**9
    assert parse_budget(GIB) == GIB
    detected = budget_module.detected_memory_bytes()
    assert detected > 0
    assert parse_budget("0.5") == int(0.5 * detected) == parse_budget(0.5)
    for bad in ("lots", "1 parsec", -5, True, 0):
        with pytest.raises(ValueError, match="memory_budget"):
            parse_budget(bad)


def test_a_budget_chooses_the_knobs_and_logs_them(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="plait.offload_io"):
        config = OffloadConfig(memory_budget="1GiB", path=str(tmp_path))
    plan = config.memory_plan
    assert (config.device, config.param_device) == ("nvme", "nvme")
    assert config.sub_group_size == plan.sub_group_size == (GIB - RUNTIME_BYTES) // 8 // (3 * 16)
    assert config.io.block_size == plan.block_size == 2 * MIB and config.io.queue_depth == 4
    # the fixed part (runtime, slots, buffers) is what the formula says and leaves room for a model
    assert plan.fixed_bytes == RUNTIME_BYTES + 3 * plan.sub_group_size * 16 + 4 * 2 * MIB < 0.5 * GIB
    assert "sub_group_size=" in caplog.text and "memory_budget 1024 MiB" in caplog.text
    small = OffloadConfig(memory_budget="384MiB", path=str(tmp_path))
    assert small.sub_group_size < config.sub_group_size and small.io.block_size == MIB


def test_explicit_knobs_override_the_budget(tmp_path) -> None:
    io = IOConfig(block_size=1 << 20, queue_depth=2, workers=1)
    config = OffloadConfig(memory_budget="1GiB", path=str(tmp_path), sub_group_size=1 << 18, io=io,
                           param_device="cpu", grad_device="nvme")
    assert (config.sub_group_size, config.io, config.param_device, config.grad_device) == \
        (1 << 18, io, "cpu", "nvme")
    assert not config.budget_chooses_grad_device


def test_bad_budgets_are_refused_before_any_work(tmp_path) -> None:
    with pytest.raises(ValueError, match="needs path="):
        OffloadConfig(memory_budget="1GiB")
    with pytest.raises(ValueError, match=r"smallest budget is \d+ MiB"):
        OffloadConfig(memory_budget="200MiB", path=str(tmp_path))
    with pytest.raises(ValueError, match="memory_budget='1GiB' sizes the ZeRO placement"):
        OffloadedOptimizer([nn.Parameter(torch.zeros(4))],
                           config=OffloadConfig(memory_budget="1GiB", path=str(tmp_path)))
    smallest = plan_for_budget(264 * MIB)  # just above the smallest fixed part (263 MiB): accepted
    assert smallest.sub_group_size == budget_module.MIN_SUB_GROUP


def test_the_model_decides_gradient_placement_or_is_refused(tmp_path) -> None:
    with torch.device("meta"):
        model = Decoder(vocab=32000, dim=1024, layers=12)  # 176M parameters, embedding 32.8M the largest unit
    numel = sum(p.numel() for p in model.parameters())
    assert largest_unit_numel(model) == 32000 * 1024
    roomy = zero_placement(OffloadConfig(memory_budget="2GiB", path=str(tmp_path)))
    roomy.check_model(model, 1)  # 0.7 GiB of gradients fit beside the fixed part and the units
    assert roomy.config.grad_device == "cpu"
    tight = zero_placement(OffloadConfig(memory_budget="1GiB", path=str(tmp_path)))
    tight.check_model(model, 1)
    assert tight.config.grad_device == "nvme"
    need = required_bytes(tight.config.memory_plan, rank_numel=numel, largest_unit_numel=32000 * 1024,
                          grads_in_memory=False)
    assert need <= GIB
    least = smallest_budget(rank_numel=numel, largest_unit_numel=32000 * 1024)
    refused = zero_placement(OffloadConfig(memory_budget="600MiB", path=str(tmp_path)))
    with pytest.raises(ValueError, match=f"smallest budget that fits is {least >> 20} MiB"):
        refused.check_model(model, 1)
    zero_placement(OffloadConfig(memory_budget=least, path=str(tmp_path))).check_model(model, 1)  # it does fit
    kept = zero_placement(OffloadConfig(memory_budget="1GiB", path=str(tmp_path), grad_device="nvme"))
    kept.check_model(model, 4)
    assert kept.config.grad_device == "nvme"
