"""Masters and optimizer state below fp32 (ZeroConfig.master_dtype / optimizer_state_dtype).

* ZeRO-2/3 at W=2 equals, bit for bit, one process running the same LowPrecisionOptimizer on the
  same averaged gradients (the reference adds the two ranks' half-batch gradients and halves them,
  as the reduce-scatter does), for int8 states, bf16 masters (compensated and stochastic) and bf16
  states. int8 runs keep one parameter per unit (stage 2: one bucket per parameter; stage 3: every
  leaf module a unit), so the int8 blocks are the parameter's own, as in the reference.
* The memory ledger's model-state bytes per rank equal the formula exactly for each setting.
* bf16 masters with compensation track fp32 AdamW; refusals name the field and the fix.

All distributed jobs run in one set of processes (spawning ranks costs seconds)."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import build_model

from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.zero_sharding import (
    ConstructedParameter,
    LocalPlacement,
    ZeroConfig,
    model_state_bytes,
    sharded_init,
    zero_shard,
)
from plait.zero_sharding.low_precision import STATE_KINDS, LowPrecisionOptimizer, TensorPrecision
from plait.zero_sharding.muon import MuonWithAdamW, muon_param_groups
from plait.zero_sharding.state_quant import (
    LEVELS,
    dequantize_blockwise,
    element_noise,
    quantize_blockwise,
    stochastic_round_bf16,
)

BATCH, SEQ, STEPS, WORLD = 4, 16, 2, 2  # two steps: the second reads the stored compact states
ADAMW = dict(lr=1e-3, weight_decay=0.1)
LEAVES = ("Linear", "Embedding", "RMSNorm")  # stage 3: one parameter per unit

# name -> (ZeroConfig options, compute dtype)
SETTINGS: dict[str, dict[str, Any]] = {
    "int8-s2": dict(stage=2, reduce_bucket_elements=1, optimizer_state_dtype="int8"),
    "int8-s3": dict(stage=3, unit_classes=LEAVES, optimizer_state_dtype="int8"),
    "bf16-comp-s3": dict(stage=3, compute_dtype="bf16", master_dtype="bf16", optimizer_state_dtype="bf16"),
    "bf16-sr-int8-s2": dict(stage=2, reduce_bucket_elements=1, compute_dtype="bf16", master_dtype="bf16",
                            master_rounding="stochastic", optimizer_state_dtype="int8", stochastic_seed=7),
}


def _config(name: str) -> ZeroConfig:
    return ZeroConfig(reduce_dtype=torch.float32, param_persistence_threshold=0, **SETTINGS[name])


def _rank_jobs(names: list[str]) -> list[dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for name in names:
        config = _config(name)
        model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **ADAMW)
        assert isinstance(optimizer.inner, LowPrecisionOptimizer)
        for step in range(STEPS):
            model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if name == "int8-s2":
            with pytest.raises(ValueError, match="compact optimizer state.*sharded checkpoint"):
                model.sharded_state_dict()
        state = model.state_dict()
        out.append({k: v.clone() for k, v in state.items()} if rank == 0 else {})
    out.append(_ledger_jobs())
    return out


def _reference(name: str) -> dict[str, torch.Tensor]:
    """One process: the plain model (in the compute dtype, its parameters the masters) with the same
    wrapper; each rank's half batch backward separately, gradients summed in fp32 and halved."""
    config = _config(name)
    model = build_model().to(config.compute_dtype)
    params = dict(model.named_parameters())
    precision = TensorPrecision(state_dtype=config.optimizer_state_dtype, master_rounding=config.master_rounding
                                or "compensated", block_size=config.state_block_size, seed=config.stochastic_seed)
    optimizer = LowPrecisionOptimizer(torch.optim.AdamW(params.values(), **ADAMW), precision,
                                      names={p: n for n, p in params.items()})
    for step in range(STEPS):
        batch = global_batch(step, BATCH, SEQ)
        total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
        for rank in range(WORLD):
            model(**rank_slice(batch, rank, WORLD)).loss.backward()
            for n, p in params.items():
                total[n].add_(p.grad.float())
                p.grad = None
        for n, p in params.items():
            p.grad_dtype = None  # an fp32 average on a bf16 parameter, as ZeRO gives its bf16 masters
            p.grad = total[n] * (1.0 / WORLD)
        optimizer.step()
        optimizer.zero_grad()
        for p in params.values():
            p.grad_dtype = p.dtype  # the next backward produces gradients in the parameter's dtype again
    return {n: p.detach().clone() for n, p in params.items()}


# ---- memory: bytes per parameter per rank, exact ------------------------------------------------
LEDGER = {  # name -> (ZeroConfig options, bytes per parameter at world size N: numerator of k / N)
    "fp32 AdamW": (dict(), 16),
    "bf16 compute, fp32 masters and states": (dict(compute_dtype="bf16"), 16),
    "bf16 masters (compensated), bf16 states": (dict(compute_dtype="bf16", master_dtype="bf16",
                                                     optimizer_state_dtype="bf16"), 10),
    "bf16 masters (stochastic), bf16 states": (dict(compute_dtype="bf16", master_dtype="bf16",
                                                    master_rounding="stochastic", optimizer_state_dtype="bf16"), 8),
    "fp32 masters, int8 states": (dict(compute_dtype="bf16", optimizer_state_dtype="int8"), 10 + 8 / 256),
    "bf16 masters (stochastic), int8 states": (dict(compute_dtype="bf16", master_dtype="bf16",
                                                    master_rounding="stochastic", optimizer_state_dtype="int8"),
                                               6 + 8 / 256),
}


def _ledger_model() -> nn.Module:
    torch.manual_seed(0)  # every size a multiple of world x block: no padding, so the formula is k Psi / N
    return nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 128, bias=False), nn.Tanh(),
                         nn.Linear(128, 64, bias=False))


def _ledger_jobs() -> dict[str, Any]:
    """Model-state bytes per rank (stage 3, after backward, state allocated) for each setting."""
    out = {}
    for name, (options, _k) in LEDGER.items():
        model = _ledger_model()
        psi = sum(p.numel() for p in model.parameters())
        config = ZeroConfig(stage=3, unit_classes=("Linear",), param_persistence_threshold=0, **options)
        model, optimizer = zero_shard(model, torch.optim.AdamW, config, lr=1e-3)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(dist.get_rank())).to(config.compute_dtype)
        for step in range(2):
            model(x).square().mean().backward()
            if step == 1:
                measured = model_state_bytes(model)
            optimizer.step()
            optimizer.zero_grad()
        out[name] = {"bytes": measured["total"], "psi": psi, "tensors": len(model.zero_engine.units)}
    out["per-group"] = _per_group_job()
    out["per-group-master"] = _per_group_master_job()
    return out


def _per_group_job() -> dict[str, Any]:
    """fp32 AdamW with the first linear's states in int8 (its group's zero_state_dtype)."""
    model = _ledger_model()
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3, unit_classes=("Linear",),
                                                                       param_persistence_threshold=0), lr=1e-3,
                                  param_groups=[{"params": first, "zero_state_dtype": "int8"}, {"params": rest}])
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(2):
        model(x).square().mean().backward()
        if step == 1:
            measured = model_state_bytes(model)["total"]
        optimizer.step()
        optimizer.zero_grad()
    dtypes = [str(optimizer.state[unit.master]["exp_avg"].dtype) for unit in model.zero_engine.units]
    return {"bytes": measured, "int8": sum(p.numel() for p in first), "fp32": sum(p.numel() for p in rest),
            "dtypes": dtypes}


MASTER_GROUPS = dict(stage=3, compute_dtype="bf16", reduce_dtype=torch.float32, param_persistence_threshold=0)


def _bf16_master_names(model: nn.Module) -> set[str]:
    """The tensors a per-group test keeps in bf16 masters: the 2-D weights (the rest stay fp32)."""
    return {n for n, p in model.named_parameters() if p.ndim == 2}


def _master_groups(model: nn.Module) -> list[dict[str, Any]]:
    low = _bf16_master_names(model)
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in low], "zero_master_dtype": "bf16"},
            {"params": [p for n, p in named if n not in low]}]


def _per_group_master_job() -> dict[str, Any]:
    """bf16 compute, fp32 masters except a group with ``zero_master_dtype='bf16'``: the trained
    weights (compared with one process) and the ledger's bytes (on the padding-free model)."""
    rank = dist.get_rank()
    model = build_model()
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(**MASTER_GROUPS),
                                  param_groups=_master_groups(model), **ADAMW)
    for step in range(STEPS):
        model(**rank_slice(global_batch(step, BATCH, SEQ), rank, WORLD)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()  # a collective: every rank gathers
    weights = {k: v.clone() for k, v in state.items()} if rank == 0 else {}
    masters = sorted(str(unit.master.dtype) for unit in model.zero_engine.units)
    small = _ledger_model()
    first = list(small[0].parameters())
    rest = [p for p in small.parameters() if all(p is not q for q in first)]
    small, optimizer = zero_shard(small, torch.optim.AdamW, ZeroConfig(stage=3, unit_classes=("Linear",),
                                                                       param_persistence_threshold=0,
                                                                       compute_dtype="bf16"), lr=1e-3,
                                  param_groups=[{"params": first, "zero_master_dtype": "bf16"}, {"params": rest}])
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    for step in range(2):
        small(x).float().square().mean().backward()
        if step == 1:
            measured = model_state_bytes(small)["total"]
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": weights, "masters": masters, "bytes": measured, "bf16": sum(p.numel() for p in first),
            "fp32": sum(p.numel() for p in rest)}


def _per_group_master_reference() -> dict[str, torch.Tensor]:
    """One process: bf16 model; the bf16-master group steps its bf16 parameters (compensated), the
    rest fp32 copies made before the cast, copied into the bf16 parameters after each step."""
    model = build_model()
    low = _bf16_master_names(model)
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters() if n not in low}
    model.to(torch.bfloat16)
    params = dict(model.named_parameters())
    masters = {n: fp32[n].requires_grad_(True) if n in fp32 else p for n, p in params.items()}
    optimizer = LowPrecisionOptimizer(torch.optim.AdamW(masters.values(), **ADAMW), TensorPrecision(),
                                      names={m: n for n, m in masters.items()})
    for step in range(STEPS):
        batch = global_batch(step, BATCH, SEQ)
        total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
        for rank in range(WORLD):
            model(**rank_slice(batch, rank, WORLD)).loss.backward()
            for n, p in params.items():
                total[n].add_(p.grad.float())
                p.grad = None
        for n, m in masters.items():
            m.grad_dtype = None
            m.grad = total[n] * (1.0 / WORLD)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for n, p in params.items():
                p.grad_dtype = p.dtype
                if n in fp32:
                    p.copy_(fp32[n])
    return {n: p.detach().clone() for n, p in params.items()}


def test_low_precision_state_matches_one_process_bitwise_and_ledger_is_exact() -> None:
    names = list(SETTINGS)
    results = run_distributed(_rank_jobs, WORLD, names, timeout=240.0)[0]
    for name, params in zip(names, results):
        reference = _reference(name)
        for pname, ref in reference.items():
            got = params[pname]
            assert torch.equal(got.to(ref.dtype), ref), f"{name}: {pname} differs from one process by " \
                f"{(got.float() - ref.float()).abs().max().item():.3g}"
        moved = max((reference[n].float() - v.float()).abs().max().item() for n, v in build_model().named_parameters())
        assert moved > 1e-4, f"{name} did not train"
    mixed = results[-1].pop("per-group")
    by_group = results[-1].pop("per-group-master")
    assert by_group["masters"].count("torch.bfloat16") and by_group["masters"].count("torch.float32")
    for pname, ref in _per_group_master_reference().items():
        got = by_group["weights"][pname]
        assert torch.equal(got, ref), f"per-group master: {pname} differs by {(got.float() - ref.float()).abs().max()}"
    # bf16 parameter and gradient shards (4) everywhere, fp32 moments (8); an fp32 master (4) for
    # the fp32 group, a bf16 compensation buffer (2) for the bf16-master group.
    assert by_group["bytes"] == (14 * by_group["bf16"] + 16 * by_group["fp32"]) / WORLD + 4 * 3
    assert mixed["dtypes"] == ["torch.uint8", "torch.float32", "torch.float32"]
    # fp32 parameter and gradient shards (8) everywhere; states int8 (2 + 8/256) for the first linear.
    assert mixed["bytes"] == (8 * (mixed["int8"] + mixed["fp32"]) + (2 + 8 / 256) * mixed["int8"]
                              + 8 * mixed["fp32"]) / WORLD + 4 * 3
    for name, found in results[-1].items():
        k = LEDGER[name][1]
        # Per parameter per rank: k / N; plus AdamW's step counter, one fp32 scalar per tensor stepped.
        expected = k * found["psi"] / WORLD + 4 * found["tensors"]
        assert found["bytes"] == expected, (name, found, expected)


# ---- one process: quality, formats, state dicts, refusals ----------------------------------------
def _regression() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    return x, torch.tanh(x @ torch.randn(32, 1, generator=g))


def _train(optimizer_of: Any, dtype: torch.dtype, steps: int = 50) -> list[float]:
    """A small MLP regression (cheap enough for 50 steps per setting in CI)."""
    x, y = _regression()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(dtype)
    optimizer = optimizer_of(model)
    losses = []
    for _ in range(steps):
        loss = (model(x.to(dtype)).float() - y).square().mean()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _wrapped(rounding: str, states: str) -> Any:
    def make(model: nn.Module) -> LowPrecisionOptimizer:
        named = dict(model.named_parameters())
        return LowPrecisionOptimizer(torch.optim.AdamW(named.values(), **ADAMW),
                                     TensorPrecision(state_dtype=states, master_rounding=rounding),
                                     names={p: n for n, p in named.items()})
    return make


def test_bf16_compensated_adamw_tracks_fp32_adamw() -> None:
    """50 steps: bf16 masters (compensated) and bf16 states stay within 0.5% of fp32 AdamW's loss at
    every step; bf16 AdamW without the wrapper (masters rounded to nearest) drifts past 1%."""
    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), **ADAMW)

    reference = _train(adamw, torch.float32)
    assert reference[-1] < 0.5 * reference[0]  # it trained
    compensated = _train(_wrapped("compensated", "bf16"), torch.bfloat16)
    gap = max(abs(a - r) / r for a, r in zip(compensated, reference))
    assert gap < 0.005, gap
    plain = _train(adamw, torch.bfloat16)
    assert max(abs(a - r) / r for a, r in zip(plain, reference)) > 0.01


def test_compensation_keeps_updates_smaller_than_bf16_spacing() -> None:
    """A weight of 1.0 moved by 1e-4 per step: bf16 rounding to nearest never moves it (spacing
    2**-7 near 1); the compensated master accumulates every step, stochastic rounding on average."""
    def run(rounding: str) -> float:
        w = nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-4), TensorPrecision(master_rounding=rounding))
        for _ in range(200):
            w.grad = torch.full_like(w, -1.0)
            optimizer.step()
        value = w.float()
        if rounding == "compensated":  # the master is its bf16 value plus the kept residual
            value = value + optimizer.state[w]["master_compensation"].float()
        return value.mean().item()

    plain = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    sgd = torch.optim.SGD([plain], lr=1e-4)
    for _ in range(200):
        plain.grad = torch.full_like(plain, -1.0)
        sgd.step()
    assert plain.float().mean().item() == 1.0
    assert abs(run("compensated") - 1.02) < 1e-3  # the residual itself is kept in bf16: ~3% of the 0.02 moved
    assert abs(run("stochastic") - 1.02) < 1e-3  # the mean of 4096 independently rounded weights


def test_int8_blockwise_round_trip_and_noise_is_layout_independent() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 700) * torch.logspace(-5, 0, 700)
    codes, absmax = quantize_blockwise(x, "signed", 256)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and absmax.numel() == 9
    back = dequantize_blockwise(codes, absmax, "signed", 256)
    blocks = torch.nn.functional.pad(x.reshape(-1), (0, 204)).view(-1, 256).abs().amax(1)
    big = x.reshape(-1).abs() > 1e-6 * blocks.repeat_interleave(256)[:x.numel()]
    rel = ((back - x).abs() / x.abs()).reshape(-1)[big]
    assert rel.max() < 0.07  # neighbouring levels differ by 10**(7/126): half of that, plus rounding
    v = x.square()
    codes, absmax = quantize_blockwise(v, "unsigned", 256)
    back = dequantize_blockwise(codes, absmax, "unsigned", 256)
    assert (back >= 0).all() and LEVELS["unsigned"].numel() == 256 and LEVELS["signed"].numel() == 255
    # Noise of elements 100..299 of "w": the same whether the tensor is whole or split into two pieces.
    whole = element_noise(300, [("w", 0, 300, 0)], seed=3, step=5, device=torch.device("cpu"))
    split = torch.cat([element_noise(150, [("w", 100, 50, 100)], seed=3, step=5, device=torch.device("cpu"))[100:],
                       element_noise(150, [("w", 150, 150, 0)], seed=3, step=5, device=torch.device("cpu"))])
    assert torch.equal(whole[100:], split)
    assert not torch.equal(whole, element_noise(300, [("w", 0, 300, 0)], seed=3, step=6,
                                                device=torch.device("cpu")))
    value = torch.full((300,), 1.0 + 2 ** -9)  # a quarter of the way to the next bf16 value
    rounded = stochastic_round_bf16(value, whole).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2 ** -7} and 0.15 < (rounded > 1).float().mean() < 0.35


def test_state_dict_round_trip_is_exact() -> None:
    """A saved compact state (int8 codes and scales, bf16 compensation), written and read back as a
    file would be, resumes bit for bit."""
    x, y = _regression()
    make = _wrapped("compensated", "int8")

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 1)).to(torch.bfloat16)

    def step(m: nn.Module, opt: Any) -> None:
        (m(x.to(torch.bfloat16)).float() - y).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model = build()
    optimizer = make(model)
    for _ in range(2):
        step(model, optimizer)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    first = saved["inner"]["state"][0]
    assert first["exp_avg"].dtype == torch.uint8 and first["master_compensation"].dtype == torch.bfloat16
    twin = build()
    twin.load_state_dict(model.state_dict())
    twin_opt = make(twin)
    twin_opt.load_state_dict(saved)
    assert twin_opt.state[next(twin.parameters())]["exp_avg"].dtype == torch.uint8
    for _ in range(2):
        step(model, optimizer)
        step(twin, twin_opt)
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n


def test_bad_low_precision_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="master_dtype='bf16' needs compute_dtype='bf16'"):
        ZeroConfig(master_dtype="bf16")
    with pytest.raises(ValueError, match="master_rounding='stochastic' applies to bf16 masters only"):
        ZeroConfig(master_rounding="stochastic")
    with pytest.raises(ValueError, match="optimizer_state_dtype='fp8'.*'fp32', 'bf16' or 'int8'"):
        ZeroConfig(optimizer_state_dtype="fp8")
    with pytest.raises(ValueError, match="state_block_size=0"):
        ZeroConfig(state_block_size=0)
    with sharded_init():
        model = build_model()
    with pytest.raises(ValueError, match="state_dtype=.int8. cannot be applied to optimizer SGD.*Adam, AdamW"):
        zero_shard(model, torch.optim.SGD, ZeroConfig(optimizer_state_dtype="int8"), lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['zero_state_dtype'\]='bf16' cannot be applied to "
                                         "optimizer NAdam"):
        zero_shard(model, torch.optim.NAdam, ZeroConfig(), param_groups=[
            {"params": list(model.parameters()), "zero_state_dtype": "bf16"}])
    with pytest.raises(ValueError, match="MuonWithAdamW is a whole-tensor optimizer.*Keep them at 'fp32'"):
        zero_shard(model, MuonWithAdamW, ZeroConfig(compute_dtype="bf16", master_dtype="bf16"),
                   param_groups=muon_param_groups(model))
    groups = [{"params": list(model.parameters()), "zero_master_dtype": "fp16"}]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['zero_master_dtype'\]='fp16' .*use 'fp32' or 'bf16'"):
        zero_shard(model, torch.optim.AdamW, ZeroConfig(compute_dtype="bf16"), param_groups=groups)
    groups = [{"params": list(model.parameters())[:1]}, {"params": list(model.parameters())[1:],
                                                         "zero_master_dtype": "bf16"}]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['zero_master_dtype'\]='bf16' needs "
                                         r"ZeroConfig\(compute_dtype='bf16'\)"):
        zero_shard(model, torch.optim.AdamW, ZeroConfig(), param_groups=groups)
    groups = [{**g, "zero_master_dtype": "bf16"} for g in muon_param_groups(model)]
    with pytest.raises(ValueError, match="MuonWithAdamW is a whole-tensor optimizer.*Keep them at 'fp32'"):
        zero_shard(model, MuonWithAdamW, ZeroConfig(compute_dtype="bf16"), param_groups=groups)
    with pytest.raises(ValueError, match="custom placement.*Drop the placement"):
        zero_shard(model, torch.optim.AdamW, ZeroConfig(optimizer_state_dtype="bf16"), placement=LocalPlacement())
    assert all(isinstance(p, ConstructedParameter) for p in model.parameters())  # refused before any work
    assert set(STATE_KINDS["AdamW"]) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
