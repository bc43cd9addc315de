"""Universal checkpoints of a tensor-parallel model under ZeRO (cross-package: plait-zero-sharding +
plait-universal-ckpt): saved at dp 2 x tp 2, loaded at dp 2 x tp 2, dp 4 x tp 1 and dp 1 x tp 2.

An MLP whose first Linear is ``ColwiseParallel`` (``Shard(0)`` weight and bias), whose middle one is
``RowwiseParallel`` (``Shard(1)`` weight: its ZeRO pieces are boxes of the global tensor, not flat
ranges; ``Replicate()`` bias) and whose last one stays plain trains 2 steps at dp2 x tp2 under
ZeRO-3 and is saved; the same run then trains 2 more steps (the uninterrupted reference). A model
built from other weights loads the checkpoint at each layout and trains those 2 steps on the same
global batch:

* dp2 x tp2, ZeRO-3: the same arithmetic, so the losses are bitwise those of the uninterrupted run;
* dp4 x tp1, ZeRO-1 (no tensor parallelism) and dp1 x tp2, ZeRO-2 (each tp pair trains alone, on a
  data-parallel group of one rank): within ``TOL`` (only the order of the cross-rank sums differs).

The consolidated checkpoint equals the model's whole state dict at save time.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed

BATCH, FEATURES, HIDDEN, SAVED_AT, MORE = 4, 8, 32, 2, 2
OPT = dict(lr=1e-2, weight_decay=0.01)
TOL = 1e-6  # fp32; the gradient sums run in another order at another layout


def build(seed: int) -> nn.Sequential:
    """The MLP (same seed, same weights)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, FEATURES), nn.Linear(FEATURES, 4))


def sharded(seed: int, stage: int, tp_mesh, dp) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP, tensor-parallel on ``tp_mesh`` (none when ``None``), ZeRO-sharded over ``dp``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from plait.zero_sharding import ZeroConfig, zero_shard

    model = build(seed)
    if tp_mesh is not None:
        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=stage), mesh=dp, **OPT)


def train(model: nn.Module, opt: torch.optim.Optimizer, dp, steps: range) -> list[float]:
    """``steps`` on this dp rank's rows of each step's global batch; losses averaged over dp."""
    size, rank = dist.get_world_size(dp), dist.get_rank(dp)
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(BATCH, FEATURES, generator=gen), torch.randn(BATCH, 4, generator=gen)
        rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp)
        losses.append(float(mean) / size)
    return losses


def save_and_reload(root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_group()
    model, opt = sharded(0, 3, mesh["tp"], dp)
    out = {"first": train(model, opt, dp, range(SAVED_AT))}
    uc.save({"model": model}, root, step=SAVED_AT)
    out["saved"] = model.state_dict()
    out["uninterrupted"] = train(model, opt, dp, range(SAVED_AT, SAVED_AT + MORE))
    world = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # every rank creates each
    for label, stage, tp_mesh, group in (("dp2xtp2", 3, mesh["tp"], dp), ("dp4xtp1", 1, None, world),
                                         ("dp1xtp2", 2, mesh["tp"], alone)):
        model, opt = sharded(7, stage, tp_mesh, group)  # other weights: the load must overwrite them all
        manifest = uc.load({"model": model}, root)
        out[label] = train(model, opt, group, range(manifest.step, manifest.step + MORE))
    return out


def consolidated(root) -> dict[str, torch.Tensor]:
    ckpt = uc.latest(root)
    manifest = uc.read_manifest(ckpt)
    return {name.removeprefix("model/model."): uc.read_full(ckpt, manifest, entry)
            for name, entry in manifest.tensors.items() if name.startswith("model/model.")}


@pytest.mark.timeout(240)
def test_tp_checkpoint_loads_at_other_dp_and_tp_sizes(tmp_path) -> None:
    results = run_distributed(save_and_reload, 4, str(tmp_path), timeout=200)
    whole = consolidated(tmp_path)
    saved = results[0]["saved"]
    assert whole.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(whole[name], tensor), name
    for rank, out in enumerate(results):
        reference = out["uninterrupted"]
        assert out["dp2xtp2"] == reference, (rank, out["dp2xtp2"], reference)  # bitwise
        for label in ("dp4xtp1", "dp1xtp2"):
            torch.testing.assert_close(torch.tensor(out[label]), torch.tensor(reference), rtol=TOL, atol=TOL,
                                       msg=f"rank {rank} {label}")
    print("uninterrupted", results[0]["uninterrupted"], {k: results[0][k] for k in ("dp4xtp1", "dp1xtp2")})
