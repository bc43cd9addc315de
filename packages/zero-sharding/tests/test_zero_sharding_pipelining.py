"""ZeRO 1/2/3 inside ``torch.distributed.pipelining`` on a ``(dp=2, pp=2)`` mesh of 4 gloo ranks.

Each of two pipeline stages (two Linear+Tanh blocks each) is sharded by ``zero_shard`` over ``dp``
and run by torch's ``PipelineStage`` with the GPipe and 1F1B schedules, 4 microbatches per step.
Checked: the losses equal one process training the whole model on the same samples (within 1e-6
relative over 4 AdamW steps, every stage and schedule), and the data-parallel bytes per step: with
:class:`ZeroPipelineStage` exactly one backward's reduce-scatter of the stage's own gradients,
with plain ``PipelineStage`` (which trains it correctly too) one per microbatch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard

pipelining = pytest.importorskip("torch.distributed.pipelining")

H, MICROBATCHES, STEPS, PER_RANK = 16, 4, 4, 8


def _blocks() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh()) for _ in range(4)])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(2 * PER_RANK, H, generator=gen), torch.randn(2 * PER_RANK, H, generator=gen)


def _reference() -> list[float]:
    """One process, the whole model: each dp rank's sum of microbatch mean losses, averaged over dp
    (what the schedule's per-microbatch backward and ZeRO's average compute)."""
    model = _blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    size = PER_RANK // MICROBATCHES
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = sum(torch.nn.functional.mse_loss(model(x[i:i + size]), y[i:i + size])
                   for i in range(0, 2 * PER_RANK, size)) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _pipeline(stage: int, schedule: str, zero_stage_class: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from plait.zero_sharding.pipelining import ZeroPipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    module = torch.nn.Sequential(*list(_blocks())[2 * pp:2 * pp + 2])
    numel = sum(p.numel() for p in module.parameters())
    module, optimizer = zero_shard(module, torch.optim.AdamW, ZeroConfig(stage=stage), mesh=mesh["dp"], lr=1e-2)
    stage_cls = ZeroPipelineStage if zero_stage_class else PipelineStage
    pipe = stage_cls(module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        pipe, n_microbatches=MICROBATCHES, loss_fn=torch.nn.functional.mse_loss)
    losses, ledger = [], ByteLedger()
    for step in range(STEPS):
        x, y = (t[dp * PER_RANK:(dp + 1) * PER_RANK] for t in _data(step))
        parts: list[torch.Tensor] = []
        with ledger if step == STEPS - 1 else contextlib.nullcontext():  # the last step's bytes
            if pp == 0:
                runner.step(x)
            else:
                runner.step(target=y, losses=parts)
            optimizer.step()
            optimizer.zero_grad()
        if pp == 1:
            total = torch.stack([p.detach() for p in parts]).sum().reshape(1)
            dist.all_reduce(total, group=mesh["dp"].get_group())
            losses.append(float(total) / 2)
    return {"losses": losses, "numel": numel, "reduced": ledger.total(op="reduce_scatter")}


def _session() -> dict:
    out = {}
    for stage in (1, 2, 3):
        for schedule in ("gpipe", "1f1b"):
            out[stage, schedule] = _pipeline(stage, schedule, True)
    out["plain_stage"] = _pipeline(2, "1f1b", False)
    return out


@pytest.mark.timeout(300)
def test_zero_stages_inside_gpipe_and_1f1b_equal_one_process_and_reduce_once_per_step() -> None:
    reference = _reference()
    results = run_distributed(_session, 4, timeout=240)
    for rank in (1, 3):  # the last pipeline stage of each dp replica reports the losses
        for key, result in results[rank].items():
            assert result["losses"] == pytest.approx(reference, rel=1e-6), key
    for rank, by_key in enumerate(results):
        for key, result in by_key.items():
            # fp32 gradients, 544 elements per stage (a multiple of dp: no padding). The ledger
            # counts a reduce-scatter's logical input, 4 bytes per element.
            one_backward = 4 * result["numel"]
            if key == "plain_stage":  # torch's PipelineStage: one reduction per microbatch
                assert result["reduced"] == MICROBATCHES * one_backward, (rank, result)
            else:  # ZeroPipelineStage: the step's last backward only
                assert result["reduced"] == one_backward, (rank, key, result)
