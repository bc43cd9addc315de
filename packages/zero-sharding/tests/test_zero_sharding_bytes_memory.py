"""Logical bytes per step from the ledger against the ZeRO formulas, and model-state bytes per rank
against the ZeRO memory formula and against ``plait estimate``'s row for the same setting (each within
2%), at world sizes 2 and 4."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import BATCH, OPT, SEQ, build_model

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import global_batch, rank_slice, run_distributed
from plait.zero_sharding import ZeroConfig, model_state_bytes, zero_formula_bytes, zero_shard
from plait.zero_sharding.estimate import estimate

CONTROL_BYTES = 16  # one float64[2] all-reduce per step: global grad norm + overflow flag


def _expected_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the engine must move per step, from its units (stage 3's root unit stays gathered
    from forward to the end of backward, as FSDP2's root does, so it is gathered once, not twice)."""
    engine = model.zero_engine
    out = {"all_gather": 0, "reduce_scatter": 0}
    for unit in engine.units:
        c = torch.empty((), dtype=unit.compute_dtype).element_size()
        r = torch.empty((), dtype=unit.reduce_dtype).element_size()
        out["reduce_scatter"] += unit.padded_numel * r
        if unit.resident:
            out["all_gather"] += unit.padded_numel * c  # after the step
        elif unit in engine.partition.root_units:
            out["all_gather"] += unit.padded_numel * c  # forward only
        else:
            out["all_gather"] += 2 * unit.padded_numel * c  # forward + backward
    return out


def _rank_bytes_memory(jobs: list[tuple[int, torch.dtype]]) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for stage, dtype in jobs:
        config = ZeroConfig(stage=stage, param_persistence_threshold=0, compute_dtype=dtype,
                            reduce_bucket_elements=30_000)
        model, optimizer = zero_shard(build_model(), torch.optim.AdamW, config, **OPT)
        batch = rank_slice(global_batch(0, BATCH, SEQ), rank, world)
        for step in range(3):
            with ByteLedger() as ledger:
                model(**batch).loss.backward()
                if step == 2:
                    measured = model_state_bytes(model)  # gradients present, optimizer state allocated
                optimizer.step()
                optimizer.zero_grad()
        psi = sum(p.numel() for p in model.parameters())
        padding = sum(u.padded_numel - u.numel for u in model.zero_engine.units)
        formula = zero_formula_bytes(psi, stage=stage, world_size=world, compute_dtype=dtype,
                                     grad_dtype=config.effective_reduce_dtype, optimizer_state_bytes=8)
        # `plait estimate`'s row for this setting (it reduces gradients in the compute dtype, the default).
        estimated = next(row.device_bytes for row in estimate(psi, world_sizes=[world], dtype=dtype)
                         if (row.stage, row.offload) == (stage, "none"))
        results.append({"stage": stage, "dtype": str(dtype), "by_op": ledger.by_op(), "volume": ledger.volume(),
                        "estimate": estimated,
                        "expected": _expected_bytes(model), "psi": psi, "padding": padding,
                        "units": len(model.zero_engine.units), "measured": measured, "formula": formula,
                        "root": sum(u.padded_numel for u in model.zero_engine.partition.root_units)})
    return results


def _check(results: list[dict], world: int) -> None:
    for r in results:
        item = 2 if "bfloat16" in r["dtype"] else 4
        what = f"stage {r['stage']} {r['dtype']} world {world}"
        # padding stated: fewer than `world` elements per unit.
        assert 0 <= r["padding"] < r["units"] * world, what
        assert r["by_op"]["all_gather"] == r["expected"]["all_gather"], (what, r)
        assert r["by_op"]["reduce_scatter"] == r["expected"]["reduce_scatter"], (what, r)
        assert r["by_op"].get("all_reduce", 0) == CONTROL_BYTES, (what, r)
        padded = (r["psi"] + r["padding"]) * item
        if r["stage"] < 3:  # 2 Psi: reduce-scatter + all-gather
            assert r["volume"] - 2 * CONTROL_BYTES == 2 * padded, (what, r)
        else:  # 3 Psi, minus the root unit's backward gather
            assert r["volume"] - 2 * CONTROL_BYTES == 3 * padded - r["root"] * item, (what, r)
        total = r["measured"]["total"]
        assert abs(total - r["formula"]) <= 0.02 * r["formula"], (what, total, r["formula"], r["measured"])
        assert abs(total - r["estimate"]) <= 0.02 * r["estimate"], (what, total, r["estimate"], r["measured"])


@pytest.mark.timeout(200)
def test_bytes_and_memory_world2() -> None:
    jobs = [(1, torch.float32), (2, torch.float32), (3, torch.float32), (1, torch.bfloat16), (2, torch.bfloat16),
            (3, torch.bfloat16)]
    _check(run_distributed(_rank_bytes_memory, 2, jobs, timeout=180)[0], 2)


@pytest.mark.timeout(200)
def test_bytes_and_memory_world4() -> None:
    jobs = [(1, torch.float32), (2, torch.float32), (3, torch.float32), (3, torch.bfloat16)]
    results = run_distributed(_rank_bytes_memory, 4, jobs, timeout=180)
    for rank_results in results:  # every rank holds its own share: check all of them
        _check(rank_results, 4)
