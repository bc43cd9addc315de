"""Lightning Trainer with ``PlaitStrategy(pp_size=2)`` (cross-package: plait-lightning +
plait-zero-sharding): dp 2 x pp 2 on 4 gloo ranks against one process.

The LightningModule follows the strategy's pipeline contract (:mod:`plait.lightning.pipeline_parallel`):
``configure_model`` builds this rank's stage (two of four Linear+Tanh blocks, by the
``pipeline_parallel`` coordinate of ``self.device_mesh``), ``forward`` is the stage's forward, and
``training_step`` (manual optimization) calls ``pipeline_step``, which runs torch's 1F1B schedule
over 2 microbatches through ``ZeroPipelineStage`` and steps the ZeRO optimizer. Each stage is
sharded by ZeRO-3 over its data-parallel pair. The losses over 4 steps
equal one process training the whole model on the same samples within 1e-5 relative (the sum of
the microbatch losses, averaged over dp, which is what the schedule's per-microbatch backward and
ZeRO's average compute).
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

STEPS, ITEMS, PER_RANK, MICROBATCHES, H = 4, 8, 4, 2, 8
TOL = 1e-5  # fp32, same data and seed; only the order of the cross-rank sums differs


class Pairs(torch.utils.data.Dataset):
    """Fixed random regression pairs."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(ITEMS, H, generator=gen)
        self.y = torch.randn(ITEMS, H, generator=gen)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def build_blocks() -> nn.Sequential:
    """The whole model every run starts from (same seed, same weights)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(4)])


class PipelinedRegression(L.LightningModule):
    """A user's pipelined LightningModule: this rank's stage, manual optimization."""

    def __init__(self, schedule: str = "1f1b") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.schedule = schedule
        self.stage: nn.Module | None = None
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if self.stage is not None:
            return
        pp = self.device_mesh["pipeline_parallel"].get_local_rank()
        self.stage = nn.Sequential(*list(build_blocks())[2 * pp:2 * pp + 2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        from plait.lightning.pipeline_parallel import pipeline_step

        x, y = batch
        loss = pipeline_step(self, x, y, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss,
                             schedule=self.schedule)
        self.losses[self.trainer.global_step - 1] = float(loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Pairs(), batch_size=PER_RANK)


def pp_session() -> dict[str, Any]:
    """PlaitStrategy(pp_size=2) at ZeRO-3 with 1F1B (GPipe and the other ZeRO stages inside a
    pipeline: plait-zero-sharding's tests/test_zero_sharding_pipelining.py)."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from plait.lightning import PlaitStrategy
    from plait.zero_sharding import ZeroConfig, ZeroModule

    out: dict[str, Any] = {"rank": dist.get_rank()}
    for stage, schedule in ((3, "1f1b"),):
        module = PipelinedRegression(schedule)
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=PlaitStrategy(zero=ZeroConfig(stage=stage),
                                                                                 pp_size=2),
                            max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module)
        mesh = trainer.strategy.device_mesh
        out[stage] = {"losses": module.losses, "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
                      "sharded": isinstance(module, ZeroModule),
                      "sampler": trainer.strategy.distributed_sampler_kwargs}
    return out


def one_process() -> dict[int, float]:
    """The whole model on both dp ranks' batches: each dp rank's sum of microbatch mean losses,
    averaged over dp. The sampler gives dp rank r the items r, r + 2, r + 4, r + 6."""
    data, model = Pairs(), build_blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    size = PER_RANK // MICROBATCHES
    losses = {}
    for step in range(STEPS):  # one batch per rank per epoch: the same batch every step
        total = 0.0
        for rank in range(2):
            rows = list(range(rank, ITEMS, 2))
            for m in range(MICROBATCHES):
                pick = rows[m * size:(m + 1) * size]
                total = total + nn.functional.mse_loss(model(data.x[pick]), data.y[pick])
        loss = total / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


@pytest.mark.timeout(300)
def test_trainer_dp2_pp2_equals_one_process() -> None:
    results = run_distributed(pp_session, 4, timeout=240)
    reference = one_process()
    assert reference[STEPS - 1] < reference[0]
    for stage in (3,):
        for result in results:
            facts = result[stage]
            assert facts["mesh"] == (("data_parallel", "pipeline_parallel"), (2, 2)), facts
            assert facts["sharded"], "the stage's LightningModule is sharded by ZeRO"
            rank = result["rank"]
            assert (facts["sampler"]["num_replicas"], facts["sampler"]["rank"]) == (2, rank // 2), facts["sampler"]
        for step in range(STEPS):  # dp rank 0 is ranks 0-1, dp rank 1 is ranks 2-3 (a pipeline each)
            assert results[0][stage]["losses"][step] == results[1][stage]["losses"][step]  # sent by the last stage
            mean = (results[0][stage]["losses"][step] + results[2][stage]["losses"][step]) / 2
            assert math.isclose(mean, reference[step], rel_tol=TOL, abs_tol=TOL), (stage, step, mean, reference)
    print("one process", reference, "zero3 1f1b", results[0][3]["losses"])


def test_bad_pp_settings_are_refused_before_any_work() -> None:
    import plait.lightning
    from plait.lightning import PlaitConfig, PlaitStrategy
    from plait.lightning.pipeline_parallel import check_module

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=PlaitStrategy(pp_size=3), max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"pp_size=3 does not divide the world size 4"):
        trainer.fit(PipelinedRegression())
    with pytest.raises(ValueError, match=r"pp_size=2 with \{'tp_size': 2\}.*does not compose"):
        PlaitStrategy(pp_size=2, tp_size=2)
    with pytest.raises(ValueError, match=r"pp_size=0 must be a positive int"):
        PlaitConfig(pp_size=0)
    with pytest.raises(ValueError, match=r"pp_size=2 is supported by the Trainer strategy"):
        plait.lightning.PlaitFabricStrategy(config=PlaitConfig(pp_size=2))
    automatic = PipelinedRegression()
    automatic.automatic_optimization = True
    with pytest.raises(ValueError, match=r"set self.automatic_optimization = False.*pipeline_step"):
        check_module(automatic, 2)
