"""ZeRO with tensor and pipeline parallelism together: a ``(dp=1, pp=2, tp=2)`` mesh of 4 gloo ranks.

Each of two pipeline stages (two Linear+Tanh blocks) has its first Linear ``ColwiseParallel`` and
its second ``RowwiseParallel`` on ``tp``, is sharded by ``zero_shard`` over ``dp`` and run by
:class:`~plait.zero_sharding.pipelining.ZeroPipelineStage` under torch's GPipe and 1F1B schedules
(4 microbatches per step; the ranks of a tp pair exchange activations with their own peers of the
other stage). Checked against one process training the whole model on the same samples: losses
within 1e-6 relative over 3 AdamW steps, ZeRO-3, both schedules. Three dimensions at once need 8
ranks with ``dp=2``; at 4 ranks ``dp`` is 1, so ZeRO shards nothing here but runs its whole path
(flat units over DTensor shards, deferred reduction at the schedule's last backward, the step).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

pipelining = pytest.importorskip("torch.distributed.pipelining")

H, MICROBATCHES, STEPS, BATCH = 16, 4, 3, 8


def _blocks() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh()) for _ in range(4)])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, H, generator=gen), torch.randn(BATCH, H, generator=gen)


def _reference() -> list[float]:
    """One process, the whole model: the sum of the microbatches' mean losses (what the schedule's
    per-microbatch backward computes)."""
    model = _blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    size = BATCH // MICROBATCHES
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = sum(torch.nn.functional.mse_loss(model(x[i:i + size]), y[i:i + size]) for i in range(0, BATCH, size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _pipeline(schedule: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from plait.zero_sharding.pipelining import ZeroPipelineStage

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    pp = mesh["pp"].get_local_rank()
    module = torch.nn.Sequential(*list(_blocks())[2 * pp:2 * pp + 2])
    parallelize_module(module, mesh["tp"], {"0.0": ColwiseParallel(), "1.0": RowwiseParallel()})
    assert all(isinstance(p, DTensor) for p in module.parameters())
    module, optimizer = zero_shard(module, torch.optim.AdamW, ZeroConfig(stage=3), mesh=mesh["dp"], lr=1e-2)
    pipe = ZeroPipelineStage(module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        pipe, n_microbatches=MICROBATCHES, loss_fn=torch.nn.functional.mse_loss)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        parts: list[torch.Tensor] = []
        if pp == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=parts)
        optimizer.step()
        optimizer.zero_grad()
        if pp == 1:
            losses.append(float(torch.stack([p.detach() for p in parts]).sum()))
    dist.barrier()
    return losses


def _session() -> dict:
    return {schedule: _pipeline(schedule) for schedule in ("gpipe", "1f1b")}


@pytest.mark.timeout(240)
def test_zero3_with_tensor_and_pipeline_parallelism_equals_one_process() -> None:
    reference = _reference()
    results = run_distributed(_session, 4, timeout=200)
    for rank in (2, 3):  # the last pipeline stage's tp pair reports the losses
        for schedule, losses in results[rank].items():
            assert losses == pytest.approx(reference, rel=1e-6), (rank, schedule, losses, reference)
