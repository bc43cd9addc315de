"""1-bit LAMB under ZeRO-1/2 without the post-step parameter all-gather:
``OnebitLambConfig(zero_param_sync="update")`` (:mod:`plait.onebit_optim.under_zero.replicated_lamb`).

Checked on tiny-llama, gloo, ZeRO-2 at W=2 and ZeRO-1 at W=4 (warm-up, then 3 compressed steps),
with weight decay (so the per-tensor norms of the preliminary update and the update are taken) and
the default variance floor:

* parameters, masters and losses bit for bit those of ``zero_param_sync="gather"`` (ZeRO's exact
  all-gather, the per-tensor maxima and norms all-reduced);
* bytes of a compressed step, by the ledger: the 1-bit exchange and the engine's 16-byte norm
  all-reduce only (no parameter all-gather, no per-tensor all-reduces); the first compressed step
  adds the once-only all-gathers of the momentum, the frozen and the fresh variance (``4 P`` each)
  and the floor's per-tensor sums;
* a checkpoint saved after warm-up resumes bit for bit (the variances are gathered again);
* refused, naming the fix: a bad value, bf16 compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("plait.zero_sharding")

from plait import universal_ckpt
from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import run_distributed, tiny_llama, train_losses
from plait.onebit_optim import OnebitLamb, OnebitLambConfig
from plait.onebit_optim.under_zero.layout import exchange_nbytes
from plait.zero_sharding import ZeroConfig, zero_shard

BATCH, SEQ, FREEZE = 8, 32, 3
BUCKET = 150_000  # several ZeRO units on tiny-llama, some tensors cut between two shards


def _zero(stage: int, sync: str, compute_dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = tiny_llama(num_layers=2, hidden_size=64, num_heads=2)
    cfg = ZeroConfig(stage=stage, reduce_bucket_elements=BUCKET, compute_dtype=compute_dtype)
    return zero_shard(model, OnebitLamb, cfg, lr=1e-2, weight_decay=0.01,
                      onebit_config=OnebitLambConfig(freeze_step=FREEZE, zero_param_sync=sync))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [unit.full.detach().clone() for unit in model.zero_engine.units]


def _steps_with_ledgers(model: nn.Module, opt: object) -> tuple[list[float], list[ByteLedger]]:
    """Warm-up, then 3 compressed steps, each under its own ledger."""
    losses = train_losses(model, opt, FREEZE, batch=BATCH, seq=SEQ)
    ledgers = []
    for step in range(FREEZE, FREEZE + 3):
        with ByteLedger() as ledger:
            losses += train_losses(model, opt, 1, batch=BATCH, seq=SEQ, start=step)
        ledgers.append(ledger)
    return losses, ledgers


def _formulas(model: nn.Module) -> tuple[int, int]:
    """Bytes per rank of a compressed step, and of the first one (see the module docstring)."""
    units = model.zero_engine.units
    exchange = exchange_nbytes([(u.shard_numel, len(u.slots)) for u in units], dist.get_world_size())
    later = exchange + 16  # + the engine's [sum of squares, overflow] float64 all-reduce
    once = sum(3 * 4 * u.padded_numel for u in units)  # momentum, frozen and fresh variance, gathered once
    floor = sum(8 * len(u.slots) for u in units)  # the variance floor's per-tensor sums, at the freeze
    return later, later + once + floor


def _against_gather(stage: int) -> dict[str, object]:
    model, opt = _zero(stage, "update")
    losses, ledgers = _steps_with_ledgers(model, opt)
    ref, ref_opt = _zero(stage, "gather")
    ref_losses = train_losses(ref, ref_opt, FREEZE + 3, batch=BATCH, seq=SEQ)
    masters = zip(model.zero_engine.placement.masters().values(), ref.zero_engine.placement.masters().values())
    later, first = _formulas(model)
    cut = any(s.offset // u.shard_numel != (s.offset + s.numel - 1) // u.shard_numel  # a tensor on two shards
              for u in model.zero_engine.units for s in u.slots)
    return {
        "params": all(torch.equal(a, b) for a, b in zip(_params(model), _params(ref))),
        "masters": all(torch.equal(a, b) for a, b in masters),
        "losses": losses == ref_losses, "moved": losses[-1] != losses[FREEZE],
        "gatherer": model.zero_engine.gatherer is model.zero_engine.reducer,
        "units": len(model.zero_engine.units), "cut": cut,
        "bytes": [ledger.total() for ledger in ledgers], "formula": [first, later, later],
        "ops": ledgers[-1].by_op(),
    }


def _check(result: dict[str, object]) -> None:
    assert result["units"] > 1 and result["gatherer"] and result["cut"]
    assert result["params"] and result["masters"] and result["losses"] and result["moved"]
    assert result["bytes"] == result["formula"], result["ops"]


K, AFTER = FREEZE + 2, 3


def _resume(root: str) -> bool:
    """Save after warm-up, continue; a fresh model loads and continues the same steps."""
    model, opt = _zero(2, "update")
    train_losses(model, opt, K, batch=BATCH, seq=SEQ)
    universal_ckpt.save({"model": model}, root, step=K)
    uninterrupted = train_losses(model, opt, AFTER, batch=BATCH, seq=SEQ, start=K)
    again, again_opt = _zero(2, "update")
    universal_ckpt.load({"model": again}, root)
    return train_losses(again, again_opt, AFTER, batch=BATCH, seq=SEQ, start=K) == uninterrupted


def _refusal() -> str:
    try:
        _zero(2, "update", torch.bfloat16)
    except ValueError as exc:
        return str(exc)
    return "built"


def _stage2_all(root: str) -> tuple[dict[str, object], bool, str]:
    return _against_gather(2), _resume(root), _refusal()


@pytest.mark.timeout(300)
def test_zero2_lamb_update_equals_the_exact_gather_bitwise_moves_only_the_exchange_and_resumes(tmp_path) -> None:
    for result, resumed, refused in run_distributed(_stage2_all, 2, str(tmp_path / "ckpt"), timeout=280):
        _check(result)
        assert resumed
        assert "OnebitLambConfig(zero_param_sync='update')" in refused and "bf16" in refused
    with pytest.raises(ValueError, match="OnebitLambConfig.zero_param_sync"):
        OnebitLambConfig(zero_param_sync="quantised")


@pytest.mark.timeout(300)
def test_zero1_lamb_at_four_ranks_equals_the_exact_gather_bitwise() -> None:
    for result in run_distributed(_against_gather, 4, 1, timeout=280):
        _check(result)
