"""Lightning Trainer with ``PlaitStrategy(pp_size=2)`` (cross-package: plait-lightning +
plait-zero-sharding): the pipelined LightningModule and the refusals of bad pipeline settings.

The LightningModule follows the strategy's pipeline contract (:mod:`plait.lightning.pipeline_parallel`):
``configure_model`` builds this rank's stage (two of four Linear+Tanh blocks, by the
``pipeline_parallel`` coordinate of ``self.device_mesh``), ``forward`` is the stage's forward, and
``training_step`` (manual optimization) calls ``pipeline_step``, which runs torch's 1F1B schedule
over 2 microbatches through ``ZeroPipelineStage`` and steps the ZeRO optimizer. Its dp 2 x pp 2 run
on 4 gloo ranks (losses equal to one process within 1e-5 relative, the mesh and the sampler) is
tested together with its checkpoints, in one launch, by ``test_lightning_pipeline_checkpoint.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")


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


def test_bad_pp_settings_are_refused_before_any_work() -> None:
    import plait.lightning
    from plait.lightning import PlaitConfig, PlaitStrategy
    from plait.lightning.pipeline_parallel import check_module

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=PlaitStrategy(pp_size=3), max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"pp_size=3 does not divide the world size 4"):
        trainer.fit(PipelinedRegression())
    with pytest.raises(ValueError, match=r"pp_size=2 with \{'ep_size': 2\}.*does not compose"):
        PlaitStrategy(pp_size=2, ep_size=2)
    with pytest.raises(ValueError, match=r"pp_size=0 must be a positive int"):
        PlaitConfig(pp_size=0)
    with pytest.raises(ValueError, match=r"pp_size=2 is supported by the Trainer strategy"):
        plait.lightning.PlaitFabricStrategy(config=PlaitConfig(pp_size=2))
    automatic = PipelinedRegression()
    automatic.automatic_optimization = True
    with pytest.raises(ValueError, match=r"set self.automatic_optimization = False.*pipeline_step"):
        check_module(automatic, 2)
