"""Universal checkpoints of ZeRO-sharded pipeline stages (cross-package: plait-zero-sharding +
plait-universal-ckpt): saved at (dp, pp) and (dp, pp, tp), loaded at other layouts.

The model is four Linear+Tanh blocks; a pipeline stage of ``pp`` holds ``4 / pp`` of them numbered
from 0 (a manual split), so :func:`~plait.zero_sharding.stage_checkpoint.pipeline_stage_state` maps
its names to the whole model's with ``uc.layer_offset``. Every layout trains the same objective on
the same global batch of 16 rows in microbatches of 2 (each rank scales its microbatches' mean
losses by ``dp / dp_saved``, so ZeRO's average over ``dp`` gives the same sum at every layout):

* saved at dp2 x pp2 (GPipe, ZeRO-3) after 2 AdamW steps, then 2 more steps (the uninterrupted
  run); loaded into other weights at dp2 x pp2 (the same arithmetic: bitwise), at dp4 x pp1 (one
  ZeRO-1 module, no pipeline) and at dp1 x pp2 (ZeRO-2, each pipeline alone): the next 2 losses
  within ``TOL`` of the uninterrupted run (only the order of the cross-rank sums differs);
* saved at dp1 x pp2 x tp2 (colwise / rowwise blocks, ZeRO-3) and loaded at dp2 x tp2 (one
  tensor-parallel ZeRO-3 module): the same;
* the checkpoint holds every parameter of the whole model and its AdamW state (``exp_avg``,
  ``exp_avg_sq``, ``step``) under the whole model's names, and its HF export (safetensors) equals
  the stages' weights at save time and loads into the plain model with ``load_state_dict``;
* ``pipeline_stage_state`` refuses a module ZeRO did not shard, a bad stage and a ``name_map`` that
  merges two tensors or returns no name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import plait.universal_ckpt as uc
from plait.kernels.testing import run_distributed

pytest.importorskip("torch.distributed.pipelining")

H, BLOCKS, ROWS, MICRO, SAVED_AT, MORE = 16, 4, 16, 2, 2, 2
OPT = dict(lr=1e-2, weight_decay=0.01)
TOL = 1e-6  # fp32; the gradient sums run in another order at another layout
TP_PLAN = {"0": "colwise", "1": "rowwise"}  # block index within a pair -> TP style of its Linear


def blocks(seed: int) -> nn.Sequential:
    """The whole model (same seed, same weights)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(BLOCKS)])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, H, generator=gen), torch.randn(ROWS, H, generator=gen)


def build(seed: int, zero_stage: int, dp, pp: int = 1, pp_rank: int = 0, tp_mesh=None):
    """This rank's stage of the model (all of it when ``pp == 1``), tensor-parallel on ``tp_mesh``
    (colwise / rowwise Linears in turn), ZeRO-sharded over the group ``dp``; with its checkpoint state."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding.stage_checkpoint import pipeline_stage_state

    per = BLOCKS // pp
    module = nn.Sequential(*list(blocks(seed))[pp_rank * per:(pp_rank + 1) * per])
    if tp_mesh is not None:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(module, tp_mesh, {f"{i}.0": styles[TP_PLAN[str(i % 2)]]() for i in range(per)})
    module, optimizer = zero_shard(module, torch.optim.AdamW, ZeroConfig(stage=zero_stage), mesh=dp, **OPT)
    state = pipeline_stage_state(module, name_map=uc.layer_offset("", pp_rank * per), stage=pp_rank)
    return module, optimizer, state


def train(module, optimizer, dp, steps: range, *, saved_dp: int, pp_group=None) -> list[float]:
    """``steps`` of this rank's rows, in microbatches, through a GPipe schedule over ``pp_group``
    (none: the module alone); returns the objective (the same at every layout) per step."""
    from torch.distributed.pipelining import ScheduleGPipe

    from plait.zero_sharding.pipelining import ZeroPipelineStage

    dp_size, dp_rank = dist.get_world_size(dp), dist.get_rank(dp)
    scale = dp_size / saved_dp
    rows = ROWS // dp_size
    loss_fn = lambda out, y: scale * F.mse_loss(out, y)  # noqa: E731 - the schedule's loss
    runner, pp_rank, pp_size = None, 0, 1
    if pp_group is not None:
        pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        stage = ZeroPipelineStage(module, pp_rank, pp_size, torch.device("cpu"), group=pp_group)
        runner = ScheduleGPipe(stage, n_microbatches=rows // MICRO, loss_fn=loss_fn)
    out = []
    for step in steps:
        x, y = (t[dp_rank * rows:(dp_rank + 1) * rows] for t in batch(step))
        parts: list[torch.Tensor] = []
        if runner is None:
            loss = sum(loss_fn(module(x[i:i + MICRO]), y[i:i + MICRO]) for i in range(0, rows, MICRO))
            loss.backward()
            parts.append(loss.detach())
        elif pp_rank == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=parts)
        optimizer.step()
        optimizer.zero_grad()
        total = torch.stack([p.detach() for p in parts]).sum().reshape(1) if parts else torch.zeros(1)
        dist.all_reduce(total, group=dp)
        out.append(float(total) / dp_size)
    return out


def whole_names(module, pp_rank: int, pp: int) -> dict[str, torch.Tensor]:
    """The stage's whole tensors (``state_dict()``) under the whole model's names."""
    rename = uc.layer_offset("", pp_rank * BLOCKS // pp)
    return {rename(name): value.clone() for name, value in module.state_dict().items()}


def singles() -> object:
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates each
    return groups[dist.get_rank()]


def refusals(module) -> None:
    """Bad input to pipeline_stage_state is refused, naming the fix."""
    from plait.zero_sharding.stage_checkpoint import pipeline_stage_state

    with pytest.raises(ValueError, match="after zero_shard"):
        pipeline_stage_state(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="stage=-1"):
        pipeline_stage_state(module, stage=-1)
    with pytest.raises(ValueError, match="maps two of the stage's tensors"):
        pipeline_stage_state(module, name_map=lambda name: "same").sharded_state_dict()
    with pytest.raises(ValueError, match="non-empty str"):
        pipeline_stage_state(module, name_map=lambda name: "").sharded_state_dict()


def pipelined(root: str) -> dict:
    """Saved at dp2 x pp2; loaded at dp2 x pp2, dp4 x pp1 and dp1 x pp2."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp_group, pp_rank = mesh["dp"].get_group(), mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    module, optimizer, state = build(0, 3, dp, 2, pp_rank)
    train(module, optimizer, dp, range(SAVED_AT), saved_dp=2, pp_group=pp_group)
    uc.save({"model": state}, root, step=SAVED_AT)
    refusals(module)
    out = {"saved": whole_names(module, pp_rank, 2),
           "uninterrupted": train(module, optimizer, dp, range(SAVED_AT, SAVED_AT + MORE), saved_dp=2,
                                  pp_group=pp_group)}
    alone = singles()
    for label, zero_stage, group, pp, pipe in (("dp2xpp2", 3, dp, 2, pp_group),
                                               ("dp4xpp1", 1, dist.group.WORLD, 1, None),
                                               ("dp1xpp2", 2, alone, 2, pp_group)):
        module, optimizer, state = build(7, zero_stage, group, pp, pp_rank if pp == 2 else 0)
        step = uc.load({"model": state}, root).step
        out[label] = train(module, optimizer, group, range(step, step + MORE), saved_dp=2, pp_group=pipe)
    return out


def pipelined_tensor_parallel(root: str) -> dict:
    """Saved at dp1 x pp2 x tp2; loaded at dp2 x tp2."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    dp, pp_group, pp_rank = mesh["dp"].get_group(), mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    module, optimizer, state = build(0, 3, dp, 2, pp_rank, mesh["tp"])
    train(module, optimizer, dp, range(SAVED_AT), saved_dp=1, pp_group=pp_group)
    uc.save({"model": state}, root, step=SAVED_AT)
    out = {"saved": whole_names(module, pp_rank, 2),
           "uninterrupted": train(module, optimizer, dp, range(SAVED_AT, SAVED_AT + MORE), saved_dp=1,
                                  pp_group=pp_group)}
    flat = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    module, optimizer, state = build(7, 3, flat["dp"].get_group(), tp_mesh=flat["tp"])
    step = uc.load({"model": state}, root).step
    out["dp2xtp2"] = train(module, optimizer, flat["dp"].get_group(), range(step, step + MORE), saved_dp=1)
    return out


def session(root: str) -> dict:
    return {"pp": pipelined(f"{root}/pp"), "pp_tp": pipelined_tensor_parallel(f"{root}/pp_tp")}


def check_checkpoint(root, saved: dict[str, torch.Tensor], export_dir) -> None:
    """Whole-model names, parameters and AdamW state in the checkpoint; its HF export equals the
    stages' weights and loads into the plain model."""
    from safetensors.torch import load_file

    from plait.universal_ckpt.interop.hf import export_hf

    ckpt = uc.latest(root)
    manifest = uc.read_manifest(ckpt)
    names = dict(blocks(0).named_parameters()).keys()
    assert saved.keys() == names
    for name in names:
        for field in ("model", "optim.exp_avg", "optim.exp_avg_sq", "optim.step"):
            assert f"model/{field}.{name}" in manifest.tensors, (field, name)
    export_hf(ckpt, export_dir)
    exported = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        exported.update(load_file(str(file)))
    plain = blocks(7)
    plain.load_state_dict(exported)  # strict: every name of the plain model, nothing else
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.timeout(300)
def test_pipeline_checkpoints_load_at_other_dp_pp_and_tp(tmp_path) -> None:
    results = run_distributed(session, 4, str(tmp_path), timeout=240)
    for key in ("pp", "pp_tp"):
        saved = {name: t for rank in results for name, t in rank[key]["saved"].items()}
        check_checkpoint(tmp_path / key, saved, tmp_path / f"{key}-hf")
    # The last stage's ranks hold the losses: ranks 1, 3 of the (dp, pp) mesh, 2, 3 of (dp, pp, tp).
    for rank in (1, 3):
        out = results[rank]["pp"]
        reference = out["uninterrupted"]
        assert out["dp2xpp2"] == reference, (rank, out["dp2xpp2"], reference)  # bitwise
        for label in ("dp4xpp1", "dp1xpp2"):
            torch.testing.assert_close(torch.tensor(out[label]), torch.tensor(reference), rtol=TOL, atol=TOL,
                                       msg=f"rank {rank} {label}")
    for rank in (2, 3):
        out = results[rank]["pp_tp"]
        torch.testing.assert_close(torch.tensor(out["dp2xtp2"]), torch.tensor(out["uninterrupted"]),
                                   rtol=TOL, atol=TOL, msg=f"rank {rank} dp2xtp2")
