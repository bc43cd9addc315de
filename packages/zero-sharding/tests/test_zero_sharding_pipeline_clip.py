"""Global-norm clipping under ZeRO inside ``torch.distributed.pipelining``, 4 gloo ranks.

Two pipeline stages (two Linear+Tanh blocks each) run by
:class:`~plait.zero_sharding.pipelining.ZeroPipelineStage`, on two meshes: ``dp2 x pp2`` (ZeRO-2,
GPipe) and ``dp1 x pp2 x tp2`` (ZeRO-3, 1F1B, each stage's first Linear ``ColwiseParallel`` and
second ``RowwiseParallel`` on ``tp``). Every step clips with ``optimizer.clip_grad_norm_`` at a
value well below the gradient norm, so clipping acts on every step. Checked against one process
training the whole model on the same samples with ``torch.nn.utils.clip_grad_norm_``: the norm
each rank reports (the whole model's, across stages, ``tp`` and ``dp``) and the losses, within
1e-5 relative over 3 AdamW steps. A stage's own norm would be about ``1/sqrt(2)`` of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

pipelining = pytest.importorskip("torch.distributed.pipelining")

H, MICROBATCHES, STEPS, PER_RANK = 16, 2, 3, 4
CLIP = 0.05  # below every step's gradient norm here
TOL = 1e-5  # fp32, same samples; only the order of the cross-rank sums differs
LAYOUTS = {"dp2 x pp2": (2, 1, 2, "gpipe"), "dp1 x pp2 x tp2": (1, 2, 3, "1f1b")}  # dp, tp, ZeRO stage, schedule


def _blocks() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh()) for _ in range(4)])


def _data(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(dp * PER_RANK, H, generator=gen), torch.randn(dp * PER_RANK, H, generator=gen)


def _reference(dp: int) -> tuple[list[float], list[float]]:
    """One process, the whole model: the losses (each dp rank's sum of microbatch losses, averaged
    over dp, as ZeRO's average computes) and the gradient norms ``clip_grad_norm_`` reports."""
    model = _blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    size = PER_RANK // MICROBATCHES
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _data(step, dp)
        loss = sum(torch.nn.functional.mse_loss(model(x[i:i + size]), y[i:i + size])
                   for i in range(0, dp * PER_RANK, size)) / dp
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def _pipeline(dp: int, tp: int, zero_stage: int, schedule: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from plait.zero_sharding.pipelining import ZeroPipelineStage

    mesh = init_device_mesh("cpu", (dp, 2, tp), mesh_dim_names=("dp", "pp", "tp"))
    pp, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = torch.nn.Sequential(*list(_blocks())[2 * pp:2 * pp + 2])
    if tp > 1:
        parallelize_module(module, mesh["tp"], {"0.0": ColwiseParallel(), "1.0": RowwiseParallel()})
    module, optimizer = zero_shard(module, torch.optim.AdamW, ZeroConfig(stage=zero_stage), mesh=mesh["dp"], lr=1e-2)
    pipe = ZeroPipelineStage(module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        pipe, n_microbatches=MICROBATCHES, loss_fn=torch.nn.functional.mse_loss)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _data(step, dp)
        x, y = x[dp_rank * PER_RANK:(dp_rank + 1) * PER_RANK], y[dp_rank * PER_RANK:(dp_rank + 1) * PER_RANK]
        parts: list[torch.Tensor] = []
        if pp == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=parts)
        norms.append(float(optimizer.clip_grad_norm_(CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        total = torch.stack([p.detach() for p in parts]).sum() if parts else torch.zeros(())
        dist.all_reduce(total, group=mesh["dp"].get_group())  # the pipelines' mean, on the last stage
        losses.append(float(total) / dp)
    dist.barrier()
    return {"losses": losses, "norms": norms, "last_stage": pp == 1}


def _session() -> dict:
    return {label: _pipeline(*layout) for label, layout in LAYOUTS.items()}


@pytest.mark.timeout(300)
def test_clipping_in_a_pipeline_uses_the_whole_models_norm() -> None:
    results = run_distributed(_session, 4, timeout=260)
    for label, (dp, *_rest) in LAYOUTS.items():
        losses, norms = _reference(dp)
        assert all(norm > CLIP for norm in norms), norms  # clipping binds on every step
        for rank, result in enumerate(results):
            ours = result[label]
            assert ours["norms"] == pytest.approx(norms, rel=TOL), (label, rank, ours["norms"], norms)
            if ours["last_stage"]:
                assert ours["losses"] == pytest.approx(losses, rel=TOL), (label, rank, ours["losses"], losses)
