"""Bad input fails early and names the fix; masks; 0/1 Adam's schedule and every optimizer's bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives as C
from plait.kernels.testing import run_distributed
from plait.onebit_optim import (
    OnebitAdam,
    OnebitAdamConfig,
    OnebitLamb,
    OnebitLambConfig,
    ZeroOneAdam,
    ZeroOneAdamConfig,
    config_from_dict,
)
from plait.onebit_optim.exchange.compressed import CompressedExchange


@pytest.mark.parametrize(("build", "match"), [
    (lambda: OnebitAdamConfig(freeze_step=-1), "freeze_step"),
    (lambda: OnebitAdamConfig(freeze_step=0), "freeze_step"),
    (lambda: OnebitLambConfig(min_coeff=2.0, max_coeff=1.0), "min_coeff"),
    (lambda: OnebitLambConfig(coeff_beta=1.0), "coeff_beta"),
    (lambda: OnebitLambConfig(factor_threshold=0), "factor_threshold"),
    (lambda: ZeroOneAdamConfig(local_step_clipper=0), "local_step_clipper"),
    (lambda: ZeroOneAdamConfig(var_freeze_step=1.5), "var_freeze_step"),
    (lambda: config_from_dict("OnebitAdam", {"freeze_step": 4, "cuda_aware": False}), "cuda_aware"),
    (lambda: config_from_dict("OneBitAdam", {}), "OnebitAdam"),
    (lambda: OnebitAdam([torch.nn.Parameter(torch.zeros(2))], lr=-1.0), "lr"),
    (lambda: OnebitAdam([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0)), "betas"),
    (lambda: OnebitAdam([torch.nn.Parameter(torch.zeros(2))], config=OnebitLambConfig()), "OnebitAdamConfig"),
])
def test_bad_settings_are_refused_with_the_field_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_unknown_keyword_is_refused():
    with pytest.raises(TypeError, match="freeze_steps"):
        OnebitAdamConfig(freeze_steps=3)


def test_config_from_dict_translates_deepspeed_keys():
    assert config_from_dict("ZeroOneAdam", {"var_freeze_step": 7, "local_step_clipper": 8}) == ZeroOneAdamConfig(
        var_freeze_step=7, local_step_clipper=8)


def test_masks_of_the_wrong_shape_or_owner_are_refused():
    p, other = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="momentum_masks.*shape"):
        OnebitAdam([p], momentum_masks={p: torch.ones(4, 3)})
    with pytest.raises(ValueError, match="momentum_masks.*not one of"):
        OnebitAdam([p], momentum_masks={other: torch.ones(3, 4)})


def test_plain_torch_state_is_refused_not_half_loaded():
    p = torch.nn.Parameter(torch.ones(4))
    adamw = torch.optim.AdamW([p])
    p.grad = torch.ones(4)
    adamw.step()
    with pytest.raises(ValueError, match="no OnebitAdam part"):
        OnebitAdam([p]).load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="found: OnebitAdam"):
        OnebitLamb([p]).load_state_dict(OnebitAdam([p]).state_dict())


def test_error_feedback_of_another_world_size_is_refused():
    ex = CompressedExchange([10, 3], group=None, device=torch.device("cpu"))
    state = ex.state_dict()
    state["world"] = 2
    with pytest.raises(ValueError, match="each rank holds its own errors"):
        ex.load_state_dict(state)


def _masked(use_mask: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 6, padding_idx=0)  # row 0 never gets a gradient
    head = torch.nn.Linear(6, 2)
    mask = torch.ones(10, 6)
    mask[0] = 0
    masks = {embed.weight: mask} if use_mask else None
    params = [*embed.parameters(), *head.parameters()]
    opt = OnebitAdam(params, lr=1e-2, config=OnebitAdamConfig(freeze_step=2), momentum_masks=masks)
    start = embed.weight[0].detach().clone()
    for step in range(8):
        ids = torch.randint(1, 10, (4, 5), generator=torch.Generator().manual_seed(step * world + rank))
        head(embed(ids)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"moved": (embed.weight[0] - start).abs().max().item(),
            "momentum": opt.state[embed.weight]["exp_avg"][0].abs().max().item()}


def test_momentum_masks_keep_never_updated_rows_exactly_still():
    masked = run_distributed(_masked, 2, True, timeout=60)[0]
    assert masked == {"moved": 0.0, "momentum": 0.0}
    unmasked = run_distributed(_masked, 2, False, timeout=60)[0]
    assert unmasked["moved"] > 0  # what the mask is for: one bit cannot say zero


def _schedule() -> list[str]:
    model = torch.nn.Linear(5, 3)
    opt = ZeroOneAdam(model.parameters(), lr=1e-3, config=ZeroOneAdamConfig(
        var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4))
    kinds = []
    for step in range(20):
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).sum().backward()
        with C.ByteLedger() as ledger:
            opt.step()
        opt.zero_grad()
        ops = ledger.by_op()
        kinds.append("C" if "all_to_all" in ops else "A" if "all_reduce" in ops else "-")
    return kinds


def test_zero_one_adam_schedule_of_variance_and_local_steps():
    # Variance steps (A: full-precision all-reduce) every step, then every 2 after 2 of them, then
    # every 4; other steps exchange the gradient in 1 bit (C). After step 10, local steps (-) with a
    # synchronisation (C) every 1, 2, then 4 steps (doubling every 2 steps, clipped at 4).
    expected = list("AACACACACCCC-C-C---C")
    assert run_distributed(_schedule, 2, timeout=60)[0] == expected


def _bytes(freeze: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 257), torch.nn.LayerNorm(257))
    opt = OnebitAdam(model.parameters(), lr=1e-3, config=OnebitAdamConfig(freeze_step=freeze))
    per_step = []
    with C.ByteLedger() as whole:
        for step in range(steps):
            ids = torch.randint(0, 1000, (4, 8), generator=torch.Generator().manual_seed(step))
            model(ids).pow(2).mean().backward()
            with C.ByteLedger() as ledger:
                opt.step()
            opt.zero_grad()
            per_step.append((ledger.total(), ledger.volume()))
    return {"per_step": per_step, "volume": whole.volume(), "numel": sum(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters()))}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_after_warmup_are_the_formula_and_under_a_twentieth(world):
    freeze, steps = 3, 20
    out = run_distributed(_bytes, world, freeze, steps, timeout=60)[0]
    n, tensors = out["numel"], out["tensors"]
    fp32_allreduce = 4 * n  # logical bytes; its volume (RS + AG) is twice that
    compressed = C.compressed_allreduce_nbytes(C.compressed_numel(n, world), world) + 4 * tensors
    assert out["per_step"][:freeze] == [(fp32_allreduce, 2 * fp32_allreduce)] * freeze
    for total, volume in out["per_step"][freeze:]:
        assert total == compressed
        assert volume == compressed + 4 * tensors  # the RMS all-reduce counts twice in volume
        assert volume <= 2 * fp32_allreduce / 20
    # The whole run with a 15% warm-up moves at least 5x less than DDP would.
    assert out["volume"] * 5 <= steps * 2 * fp32_allreduce
