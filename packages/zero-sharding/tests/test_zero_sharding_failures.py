"""Failure tests: R10 (a non-finite gradient on one rank: every rank skips together, state untouched,
fp16 scale backs off and regrows, the skip is counted), R12 (one flipped bit in a replica is caught
within one step), R11-style bad input (each error names the field and the fix, before anything is
allocated), mismatched configs across ranks, using a model before sharding."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import BATCH, MODEL, OPT, SEQ, build_model

from plait.kernels.testing import global_batch, rank_slice, run_distributed, state_digest, tiny_llama
from plait.zero_sharding import ConstructedParameter, ReplicaMismatchError, ZeroConfig, sharded_init, zero_shard


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    tensors = {}
    for unit in model.zero_engine.units:
        tensors[f"master.{unit.key}"] = unit.master.detach()
        tensors[f"shard.{unit.key}"] = unit.shard.detach()
        for name, value in optimizer.inner.state.get(unit.master, {}).items():
            tensors[f"{name}.{unit.key}"] = value.reshape(-1)  # tensor_digest refuses 0-d tensors
    return state_digest(tensors)


def _rank_r10_all(jobs: list[tuple[int, torch.dtype]]) -> list[dict]:
    return [_rank_r10(stage, dtype) for stage, dtype in jobs]


def _rank_r10(stage: int, dtype: torch.dtype) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ZeroConfig(stage=stage, compute_dtype=dtype, param_persistence_threshold=0, hysteresis=1,
                        loss_scale_window=2, initial_scale_power=8)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
    victim = model.layers[0].mlp.up_proj.weight
    scales, skipped_flags, norms = [], [], []
    before = after = None
    for step in range(5):
        batch = rank_slice(global_batch(step, BATCH, SEQ), rank, world)
        hook = None
        if step == 2 and rank == world - 1:  # only the last rank sees the bad gradient
            hook = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        model(**batch).loss.backward()
        if hook is not None:
            hook.remove()
        if step == 2:
            before = _local_state(model, optimizer)
        skipped = optimizer.skipped_steps
        optimizer.step()
        if step == 2:
            after = _local_state(model, optimizer)
        optimizer.zero_grad()
        skipped_flags.append(optimizer.skipped_steps - skipped)
        scales.append(optimizer.loss_scale)
        norms.append(optimizer.last_grad_norm)
    return {"scales": scales, "skipped": skipped_flags, "untouched": before == after, "norms": norms}


@pytest.mark.timeout(200)
def test_r10_nonfinite_gradient_on_one_rank_skips_everywhere() -> None:
    jobs = [(2, torch.float16), (3, torch.float16), (3, torch.float32)]
    per_rank = run_distributed(_rank_r10_all, 2, jobs, timeout=180)
    for index, (stage, dtype) in enumerate(jobs):
        results = [rank_results[index] for rank_results in per_rank]
        for r in results:
            assert r["skipped"] == [0, 0, 1, 0, 0], (stage, dtype, r)
            assert r["untouched"], f"stage {stage} {dtype}: state changed on a skipped step"
            assert math.isnan(r["norms"][2]) and all(math.isfinite(n) for i, n in enumerate(r["norms"]) if i != 2)
            if dtype == torch.float16:
                # 256, grows after 2 good steps, backs off on the overflow (hysteresis 1), regrows after 2.
                assert r["scales"] == [256.0, 512.0, 256.0, 256.0, 512.0], r["scales"]
        assert repr(results[0]) == repr(results[1])  # repr: nan != nan


def _rank_fp16_unscaled(stage: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype in (torch.float32, torch.float16):
        config = ZeroConfig(stage=stage, compute_dtype=dtype, reduce_dtype=torch.float32, initial_scale_power=10)
        model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
        model(**rank_slice(global_batch(0, BATCH, SEQ), rank, world)).loss.backward()
        optimizer.step()
        out.append(optimizer.last_grad_norm)
    return out[1] / out[0]


@pytest.mark.timeout(120)
def test_fp16_loss_scaling_is_undone_before_the_step() -> None:
    ratios = run_distributed(_rank_fp16_unscaled, 2, 3, timeout=100)
    assert all(abs(r - 1) < 1e-2 for r in ratios), ratios  # the norm seen by clipping/step is unscaled


def _rank_r12_all() -> list[str]:
    return [_rank_r12(3), _rank_r12(2), _rank_r12(1)]


def _rank_r12(stage: int) -> str:
    rank = dist.get_rank()
    config = ZeroConfig(stage=stage, check_replicas_every=1, param_persistence_threshold=100)
    model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
    batch = rank_slice(global_batch(0, BATCH, SEQ), rank, dist.get_world_size())
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == dist.get_world_size() - 1:
        resident = next(u for u in model.zero_engine.units if u.resident)
        resident.full.view(torch.int16)[7] ^= 1  # one bit of one replica
    model(**batch).loss.backward()
    try:
        optimizer.step()
    except ReplicaMismatchError as exc:
        return str(exc)
    return "not caught"


@pytest.mark.timeout(120)
def test_r12_flipped_bit_in_a_replica_is_caught() -> None:
    # Two ranks cannot say which copy flipped; three can (a strict majority).
    for message in sum(run_distributed(_rank_r12_all, 2, timeout=100), []):
        assert "ranks [0, 1] disagree and no majority" in message and "Restart from the last" in message, message
    for message in sum(run_distributed(_rank_r12_all, 3, timeout=100), []):
        assert "rank(s) [2] disagree with the others" in message and "Restart from the last" in message, message


def _rank_mismatch() -> str:
    stage = 2 if dist.get_rank() == 0 else 3
    model = build_model()
    try:
        zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage), **OPT)
    except ValueError as exc:
        assert not hasattr(model, "zero_engine")  # refused before anything was built
        return str(exc)
    return "accepted"


@pytest.mark.timeout(120)
def test_mismatched_configs_across_ranks_are_refused() -> None:
    for message in run_distributed(_rank_mismatch, 2, timeout=100):
        assert "ZeroConfig.stage is 2 on rank 0 but 3 on rank 1" in message, message


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"stage": 4}, "stage"), ({"stage": "3"}, "stage"), ({"reduce_bucket_elements": 0}, "reduce_bucket_elements"),
    ({"reduce_bucket_elements": -5}, "reduce_bucket_elements"),
    ({"reduce_bucket_elements": 2.5}, "reduce_bucket_elements"),
    ({"prefetch": -1}, "prefetch"), ({"compute_dtype": torch.int8}, "compute_dtype"),
    ({"reduce_dtype": "fp8"}, "reduce_dtype"), ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"backoff_factor": 1.5}, "backoff_factor"), ({"hysteresis": 0}, "hysteresis"),
    ({"stage": 2, "unit_classes": ("Block",)}, "unit_classes"),
    ({"elementwise_optimizer": False}, "elementwise_optimizer"),
])
def test_bad_config_names_field_and_fix(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"ZeroConfig\.{field}=") as info:
        ZeroConfig(**kwargs)
    assert any(word in str(info.value) for word in ("use", "must", "remove", "e.g.")), str(info.value)


def test_config_accepts_dtype_strings() -> None:
    config = ZeroConfig(compute_dtype="bf16", reduce_dtype="fp32")
    assert config.compute_dtype is torch.bfloat16 and config.effective_reduce_dtype is torch.float32
    with pytest.raises(dataclasses_error()):
        config.stage = 1  # type: ignore[misc]


def dataclasses_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_unsupported_optimizer_is_refused_before_allocation() -> None:
    with sharded_init():
        model = tiny_llama(**MODEL)
    for optimizer in (torch.optim.LBFGS, torch.optim.SparseAdam):
        with pytest.raises(ValueError, match="not known to be elementwise.*elementwise_optimizer=True"):
            zero_shard(model, optimizer, ZeroConfig(stage=3), lr=1.0)
    assert all(isinstance(p, ConstructedParameter) for p in model.parameters())  # nothing was gathered


@pytest.mark.parametrize("init", ["construct", "meta"])
def test_using_the_model_before_sharding_is_refused(init: str) -> None:
    with sharded_init(init=init):
        model = tiny_llama(**MODEL)
    if init == "meta":
        assert all(p.is_meta for p in model.parameters())
    else:
        assert all(isinstance(p, ConstructedParameter) for p in model.parameters())
    assert not model.rope_cos.is_meta  # buffers stay real
    with pytest.raises(RuntimeError, match=r"call zero_shard\(model, optimizer, config\)"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_wrong_types_are_refused() -> None:
    with pytest.raises(TypeError, match="ZeroConfig"):
        zero_shard(build_model(), torch.optim.AdamW, {"stage": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module"):
        zero_shard("model", torch.optim.AdamW, ZeroConfig())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="init_process_group"):
        zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(), lr=1e-3)
