"""Lightning Trainer with ``PlaitStrategy(tp_size=2)`` (cross-package: plait-lightning + plait-zero-sharding):
dp 2 x tp 2 on 4 gloo ranks against Lightning's own ``ModelParallelStrategy`` with FSDP2.

The LightningModule is written as for ``ModelParallelStrategy``: ``configure_model`` builds an MLP
whole and applies ``ColwiseParallel``/``RowwiseParallel`` to its first and middle Linears on
``self.device_mesh["tensor_parallel"]`` (the last Linear stays plain). Under ``PlaitStrategy`` ZeRO
(stages 2 and 3) then shards the TP shards over ``"data_parallel"``; under the reference the same
``configure_model`` also calls ``fully_shard(self.model, mesh=self.device_mesh["data_parallel"])``.
Both train 4 steps on the same 4 items (the sampler splits them over the 2 dp ranks, a tp pair shares
its batch; one step per epoch); the losses are compared with each other and with one process on the
whole batch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from plait.kernels.testing import run_distributed  # noqa: E402

STEPS, ITEMS, PER_RANK, FEATURES, HIDDEN = 4, 4, 2, 8, 32  # one step per epoch: the same batch, so the loss falls
# fp32, same data and seed; only the order of the cross-rank sums differs.
TOL = 1e-5


class Pairs(torch.utils.data.Dataset):
    """Fixed random regression pairs."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(ITEMS, FEATURES, generator=gen)
        self.y = torch.randn(ITEMS, 4, generator=gen)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def build_mlp() -> nn.Sequential:
    """The MLP every run starts from (same seed, same weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, FEATURES), nn.Linear(FEATURES, 4))


class TPRegression(L.LightningModule):
    """A user's tensor-parallel LightningModule (as for Lightning's ModelParallelStrategy)."""

    def __init__(self, fsdp: bool = False) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.model is not None:
            return
        model = build_mlp()  # built whole: parallelize_module cuts its TP shards
        parallelize_module(model, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=self.device_mesh["data_parallel"])
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Pairs(), batch_size=PER_RANK)


def _fit(strategy: Any, fsdp: bool = False) -> tuple[dict[int, float], Any, TPRegression]:
    from plait.lightning.demo import LossRecorder

    module = TPRegression(fsdp)
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, callbacks=[recorder],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    return recorder.losses, trainer, module


def tp_session() -> dict[str, Any]:
    """PlaitStrategy(tp_size=2) at stages 2 and 3, then ModelParallelStrategy(2, 2) with fully_shard."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    from plait.lightning import PlaitStrategy
    from plait.zero_sharding import ZeroConfig

    out: dict[str, Any] = {}
    for stage in (2, 3):
        losses, trainer, module = _fit(PlaitStrategy(zero=ZeroConfig(stage=stage), tp_size=2))
        mesh = trainer.strategy.device_mesh
        out[f"zero{stage}"] = losses
        out[f"zero{stage}_facts"] = {
            "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
            "module_mesh": module.device_mesh is mesh,
            "dtensors": sorted(n for n, p in module.model.named_parameters() if isinstance(p, DTensor)),
            "sampler": trainer.strategy.distributed_sampler_kwargs,
        }
    out["fsdp2"] = _fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), fsdp=True)[0]
    out["rank"] = dist.get_rank()
    return out


def one_process() -> dict[int, float]:
    """The same MLP on the whole global batch (dp rank r's i-th sample is item r + 2 i: all 4 items)."""
    data, model = Pairs(), build_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = {}
    for step in range(STEPS):
        loss = nn.functional.mse_loss(model(data.x), data.y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


@pytest.mark.timeout(300)
def test_trainer_tp2_follows_model_parallel_strategy_and_one_process() -> None:
    results = run_distributed(tp_session, 4, timeout=240)
    reference = one_process()
    assert reference[STEPS - 1] < reference[0]
    for rank, result in enumerate(results):
        for stage in (2, 3):
            facts = result[f"zero{stage}_facts"]
            assert facts["mesh"] == (("data_parallel", "tensor_parallel"), (2, 2)), facts
            assert facts["module_mesh"], "the LightningModule's device_mesh is the strategy's"
            assert facts["dtensors"] == ["0.bias", "0.weight", "2.bias", "2.weight"], facts["dtensors"]
            assert (facts["sampler"]["num_replicas"], facts["sampler"]["rank"]) == (2, rank // 2), facts["sampler"]
            ours, fsdp2 = result[f"zero{stage}"], result["fsdp2"]
            assert sorted(ours) == sorted(fsdp2) == list(range(STEPS)), (ours, fsdp2)
            for step in range(STEPS):
                assert math.isclose(ours[step], fsdp2[step], rel_tol=TOL, abs_tol=TOL), (rank, stage, step, ours, fsdp2)
                assert math.isclose(ours[step], reference[step], rel_tol=TOL, abs_tol=TOL), (stage, step, ours,
                                                                                             reference)
    print("one process", reference, "fsdp2", results[0]["fsdp2"], "zero2", results[0]["zero2"], "zero3",
          results[0]["zero3"])


def test_bad_tp_settings_are_refused_before_processes_start() -> None:
    import plait.lightning
    from plait.lightning import PlaitConfig, PlaitStrategy

    def fit(strategy: Any, **extra: Any) -> None:
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, **extra)
        trainer.fit(TPRegression())

    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the world size 4"):
        fit(PlaitStrategy(tp_size=3), enable_checkpointing=False)
    with pytest.raises(NotImplementedError, match=r"enable_checkpointing=False.*gathered_parameters.*full_tensor"):
        fit(PlaitStrategy(tp_size=2))  # the Trainer's default ModelCheckpoint
    with pytest.raises(NotImplementedError, match=r"tp_size=2\) cannot save checkpoints.*enable_checkpointing=False"):
        PlaitStrategy(tp_size=2).save_checkpoint({}, "unused")  # trainer.save_checkpoint's route
    with pytest.raises(ValueError, match=r"tp_size=2 with sp_size=2.*does not compose"):
        PlaitStrategy(tp_size=2, sp_size=2)
    with pytest.raises(ValueError, match=r"tp_size=0 must be a positive int"):
        PlaitConfig(tp_size=0)
    with pytest.raises(ValueError, match=r"tp_size=2 is supported by the Trainer strategy"):
        plait.lightning.PlaitFabricStrategy(config=PlaitConfig(tp_size=2))
