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

Checkpoints: a stage-3 run saves every 2 steps; resumed from its step-2 checkpoint at dp2 x tp2 it
repeats steps 2 and 3 bitwise, and at dp4 x tp1 (no tensor parallelism) within 1e-6; its whole
weights (``state_dict()``, ``export_full_weights``, and the HF export of its last checkpoint
directory) are the same tensors on every rank and follow one process.
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

# One step per epoch: the same batch, so the loss falls; checkpoints every CHECKPOINT_EVERY steps.
STEPS, ITEMS, PER_RANK, FEATURES, HIDDEN, CHECKPOINT_EVERY = 4, 4, 2, 8, 32, 2
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
        if self.device_mesh is not None:  # None under tp_size=1: the same MLP, not tensor-parallel
            parallelize_module(model, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
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


def _fit(strategy: Any, fsdp: bool = False, checkpoints: str | None = None,
         ckpt_path: str | None = None) -> tuple[dict[int, float], Any, TPRegression]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from plait.lightning.demo import LossRecorder

    module = TPRegression(fsdp)
    callbacks: list[Any] = [LossRecorder()]
    if checkpoints is not None:  # a checkpoint every CHECKPOINT_EVERY steps, all kept
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=CHECKPOINT_EVERY, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, callbacks=callbacks,
                        logger=False, enable_checkpointing=checkpoints is not None, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path=ckpt_path)
    return callbacks[0].losses, trainer, module


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


def one_process(with_model: bool = False) -> Any:
    """The same MLP on the whole global batch (dp rank r's i-th sample is item r + 2 i: all 4 items):
    the losses (and the trained model with ``with_model``)."""
    data, model = Pairs(), build_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = {}
    for step in range(STEPS):
        loss = nn.functional.mse_loss(model(data.x), data.y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return (losses, model) if with_model else losses


def checkpoint_session(root: str) -> dict[str, Any]:
    """dp2 x tp2 at ZeRO-3 for STEPS steps with a checkpoint every CHECKPOINT_EVERY steps, its whole
    weights (state_dict, export_full_weights); then resumed from the first checkpoint at dp2 x tp2
    and at dp4 x tp1 (ZeRO-2, no tensor parallelism)."""
    warnings.filterwarnings("ignore")
    from pathlib import Path

    from plait.lightning import PlaitStrategy
    from plait.zero_sharding import ZeroConfig

    out: dict[str, Any] = {}
    out["uninterrupted"], _, module = _fit(PlaitStrategy(zero=ZeroConfig(stage=3), tp_size=2), checkpoints=root)
    out["whole"] = module.state_dict()  # collective: every rank gets whole tensors
    module.export_full_weights(Path(root) / "exported.safetensors")
    first = str(next(Path(root).glob(f"*step={CHECKPOINT_EVERY}.ckpt")))
    out["resumed"] = _fit(PlaitStrategy(zero=ZeroConfig(stage=3), tp_size=2), ckpt_path=first)[0]
    out["resumed_dp4"] = _fit(PlaitStrategy(zero=ZeroConfig(stage=2)), ckpt_path=first)[0]
    return out


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


@pytest.mark.timeout(300)
def test_trainer_tp2_checkpoints_resume_exactly_and_export_whole_weights(tmp_path) -> None:
    from safetensors.torch import load_file

    from plait.universal_ckpt.interop.hf import export_hf

    results = run_distributed(checkpoint_session, 4, str(tmp_path), timeout=240)
    reference, trained = one_process(with_model=True)
    expected = {f"model.{name}": value for name, value in trained.state_dict().items()}
    exported = load_file(tmp_path / "exported.safetensors")
    last = next(tmp_path.glob(f"*step={STEPS}.ckpt"))
    converted = load_file(next(export_hf(last, tmp_path / "hf").glob("*.safetensors")))
    for result in results:
        ours, resumed, dp4 = result["uninterrupted"], result["resumed"], result["resumed_dp4"]
        assert sorted(resumed) == sorted(dp4) == list(range(CHECKPOINT_EVERY, STEPS)), (resumed, dp4)
        for step in range(CHECKPOINT_EVERY, STEPS):
            assert resumed[step] == ours[step], (step, resumed, ours)  # same layout: bitwise
            assert math.isclose(dp4[step], ours[step], rel_tol=1e-6, abs_tol=1e-7), (step, dp4, ours)
            assert math.isclose(ours[step], reference[step], rel_tol=TOL, abs_tol=TOL), (step, ours, reference)
        assert result["whole"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result["whole"][name], results[0]["whole"][name]), name  # the same on every rank
            torch.testing.assert_close(result["whole"][name], value, rtol=TOL, atol=TOL)
    for name, value in results[0]["whole"].items():
        assert torch.equal(exported[name], value), name
        assert torch.equal(converted[name], value), name  # the HF export of the last checkpoint
    print("uninterrupted", results[0]["uninterrupted"], "resumed", results[0]["resumed"], "dp4",
          results[0]["resumed_dp4"])


def test_bad_tp_settings_are_refused_before_processes_start() -> None:
    import plait.lightning
    from plait.lightning import PlaitConfig, PlaitStrategy

    def fit(strategy: Any, **extra: Any) -> None:
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, **extra)
        trainer.fit(TPRegression())

    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the world size 4"):
        fit(PlaitStrategy(tp_size=3), enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"tp_size=2 with sp_size=2.*does not compose"):
        PlaitStrategy(tp_size=2, sp_size=2)
    with pytest.raises(ValueError, match=r"tp_size=0 must be a positive int"):
        PlaitConfig(tp_size=0)
    with pytest.raises(ValueError, match=r"tp_size=2 is supported by the Trainer strategy"):
        plait.lightning.PlaitFabricStrategy(config=PlaitConfig(tp_size=2))
