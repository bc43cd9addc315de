"""A DeepSpeed script whose config names a 1-bit optimizer runs on plait's shim: plait-onebit-optim
registers DeepSpeed's ``OneBitAdam``/``OneBitLamb``/``ZeroOneAdam`` types (``plait.deepspeed_keys``),
and ``deepspeed.initialize`` then builds the 1-bit optimizer composed with ZeRO, bit for bit what
``zero_shard`` with the same optimizer and settings gives (W=2, gloo, past the freeze step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("plait.onebit_optim")
from plait.kernels.testing import run_distributed
from plait.zero_sharding.deepspeed.config import translate

STEPS = 6
BLOCKS = {
    "OneBitAdam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "freeze_step": 2,
                   "cuda_aware": False, "comm_backend_name": "nccl"},
    "ZeroOneAdam": {"lr": 1e-3, "var_freeze_step": 3, "var_update_scaler": 1, "local_step_scaler": 2,
                    "local_step_clipper": 2, "cuda_aware": False, "comm_backend_name": "nccl"},
    "OneBitLamb": {"lr": 1e-3, "freeze_step": 2, "cuda_aware": False, "comm_backend_name": "nccl"},
}


def _config(kind: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
            "optimizer": {"type": kind, "params": dict(BLOCKS[kind])}}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _losses(step_fn, model) -> list[float]:
    rank = torch.distributed.get_rank()
    generator, losses = torch.Generator().manual_seed(100 + rank), []
    for _ in range(STEPS):
        x, y = torch.randn(4, 16, generator=generator), torch.randint(0, 4, (4,), generator=generator)
        loss = F.cross_entropy(model(x), y)
        step_fn(loss)
        losses.append(loss.item())
    return losses


def _shim_and_direct(kind: str) -> tuple[list[float], list[float]]:
    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding.deepspeed import initialize

    net = _net()
    engine, _, _, _ = initialize(model=net, model_parameters=net.parameters(), config=_config(kind))

    def engine_step(loss):
        engine.backward(loss)
        engine.step()

    shim = _losses(engine_step, engine)
    plan = translate(_config(kind), world_size=2)
    model, zero_opt = zero_shard(_net(), plan.optimizer.cls, ZeroConfig(stage=2), **plan.optimizer.kwargs)

    def direct_step(loss):
        loss.backward()
        zero_opt.step()
        zero_opt.zero_grad()

    return shim, _losses(direct_step, model)


def _every_kind() -> dict[str, tuple[list[float], list[float]]]:
    return {kind: _shim_and_direct(kind) for kind in BLOCKS}


def test_deepspeed_onebit_blocks_run_the_onebit_optimizers_under_zero() -> None:
    for kind, name in (("OneBitAdam", "OnebitAdam"), ("OneBitLamb", "OnebitLamb"), ("ZeroOneAdam", "ZeroOneAdam")):
        assert translate(_config(kind), world_size=2).optimizer.cls.__name__ == name
    for rank, runs in enumerate(run_distributed(_every_kind, 2, timeout=240)):
        for kind, (shim, direct) in runs.items():
            assert shim == direct, (kind, rank)
            assert all(torch.isfinite(torch.tensor(shim))), (kind, rank)


def test_transport_settings_plait_does_not_have_are_refused_by_name() -> None:
    config = _config("OneBitAdam")
    config["optimizer"]["params"]["cuda_aware"] = True
    with pytest.raises(ValueError, match="optimizer.params.cuda_aware=true"):
        translate(config, world_size=2)
    config["optimizer"]["params"].update(cuda_aware=False, comm_backend_name="mpi")
    with pytest.raises(ValueError, match="comm_backend_name='mpi'"):
        translate(config, world_size=2)
    config["optimizer"]["params"].update(comm_backend_name="nccl", freeze_stpe=3)
    with pytest.raises(ValueError, match=r"optimizer.params \(OneBitAdam\).*freeze_stpe"):
        translate(config, world_size=2)
