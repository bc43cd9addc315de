"""Meshes with more than one dimension: dimensions ZeRO does not shard over are replicated with
their gradients all-reduced (HSDP), 2-D sub-meshes work as groups, unknown names are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from zero_test_support import OPT, OPTIMIZERS, Variant, build_model, reference_run, train_ranks

from plait.kernels.collectives import ByteLedger
from plait.kernels.mesh import make_mesh
from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

STEPS = 3
# SGD: the update is linear in the gradient, so a wrong averaging scale shows (Adam normalises it away).
SGD = Variant(steps=STEPS, optimizer="SGD")


def _hsdp_runs() -> list[tuple[int, list[float], dict[str, torch.Tensor], dict[str, int], dict[str, int]]]:
    """dp x ep mesh, default shard_dims: sharded over dp, replicated (gradients all-reduced) over ep."""
    mesh = make_mesh(dp=2, ep=2)
    out = []
    for stage in (1, 2, 3):
        config = ZeroConfig(stage=stage, param_persistence_threshold=0, reduce_bucket_elements=30_000,
                            check_replicas_every=1)
        model, optimizer = zero_shard(build_model(), torch.optim.SGD, config, mesh=mesh, **OPTIMIZERS["SGD"])
        units = model.zero_engine.units
        assert {u.group_size for u in units} == {2} and all(u.replicate_group is not None for u in units)
        with ByteLedger() as ledger:
            losses = train_ranks(model, optimizer, SGD)
        # one all-reduce of every gradient shard over ep per step, beside the 16-byte norm/overflow one
        expected = {"all_reduce": STEPS * (16 + 4 * sum(u.shard_numel for u in units))}
        params = {k: v for k, v in model.state_dict().items() if k in dict(model.named_parameters())}
        out.append((stage, losses, params, {"all_reduce": ledger.by_op()["all_reduce"]}, expected))
    return out


@pytest.mark.timeout(200)
def test_dimensions_not_sharded_over_are_replicated_and_averaged():
    ref_losses, ref_params = reference_run(SGD)
    for rank_result in run_distributed(_hsdp_runs, 4, timeout=180):
        for stage, losses, params, measured, expected in rank_result:
            assert measured == expected, stage
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
            for name, ref in ref_params.items():
                torch.testing.assert_close(params[name], ref, rtol=0, atol=1e-5,
                                           msg=lambda m, s=stage, n=name: f"stage {s} {n}: {m}")


def _sub_mesh_group_and_unknown_name() -> dict:
    import torch.distributed as dist

    mesh = make_mesh(dp=2, sp=2)
    with pytest.raises(ValueError, match=r"shard_dims=\('dp', 'epp'\) names \['epp'\]"):
        zero_shard(build_model(), torch.optim.AdamW, ZeroConfig(shard_dims=("dp", "epp")), mesh=mesh, **OPT)
    model = build_model()
    model, optimizer = zero_shard(model, torch.optim.SGD, ZeroConfig(stage=2), mesh=mesh["dp"], **OPTIMIZERS["SGD"],
                                  param_groups=[{"params": list(model.parameters()), "zero_group": mesh["dp", "sp"],
                                                 "zero_distinct": False}])
    units = model.zero_engine.units
    out = {"sizes": sorted({u.group_size for u in units}),
           "ranks": sorted({tuple(dist.get_process_group_ranks(u.group)) for u in units}),
           "losses": train_ranks(model, optimizer, ONE_STEP),
           "params": {k: v for k, v in model.state_dict().items() if k in dict(model.named_parameters())}}
    # A 2-D sub-mesh covering half the world (each rank's mesh.mesh holds only its own slice):
    # sharded over the ranks sharing this rank's ep coordinate, on every rank alike.
    partial = make_mesh(dp=2, sp=1, ep=2)["dp", "sp"]
    sharded, _ = zero_shard(build_model(), torch.optim.SGD, ZeroConfig(stage=2), mesh=partial, **OPTIMIZERS["SGD"])
    out["partial"] = sorted({tuple(dist.get_process_group_ranks(u.group)) for u in sharded.zero_engine.units})
    return out


ONE_STEP = Variant(steps=1, optimizer="SGD")


def test_two_dimensional_sub_mesh_as_group_and_unknown_dimension():
    ref_losses, ref_params = reference_run(ONE_STEP)
    for rank, result in enumerate(run_distributed(_sub_mesh_group_and_unknown_name, 4, timeout=90)):
        assert result["sizes"] == [4] and result["ranks"] == [(0, 1, 2, 3)], rank
        assert result["partial"] == [(rank % 2, 2 + rank % 2)], rank
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(result["params"][name], ref, rtol=0, atol=1e-5,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
