"""A Lightning job on two CPU processes with a slow rank, run by test_lightning_stragglers.py.

``python lightning_straggler_job.py OUTDIR`` trains a small MLP for 16 steps under Lightning's own
launcher (``devices=2``) with ``PlaitStrategy(ZeroConfig(stage=3))``, a ``CSVLogger`` in OUTDIR
and ``StragglerMonitor(every_n_steps=4)``; rank 1 is 50 ms late at every step from step 2 on
(``Fault("slow", rank=1, step=2, seconds=0.05)``).
"""

from __future__ import annotations

import logging
import sys
import warnings
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from plait.kernels.testing import Fault
from plait.lightning import PlaitStrategy, StragglerMonitor
from plait.zero_sharding import ZeroConfig

FAULT = Fault(kind="slow", rank=1, step=2, seconds=0.05)


class Module(L.LightningModule):
    """A two-layer MLP whose rank 1 is slow."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The slow rank sleeps, then an MSE step."""
        FAULT.maybe_inject(self.global_step, self.global_rank)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(outdir: str) -> None:
    """Run the job described in the module docstring."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(256, 8, generator=generator), torch.randn(256, 1, generator=generator)),
                      batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=PlaitStrategy(ZeroConfig(stage=3), timeout=timedelta(seconds=30)),
                        max_steps=16, logger=CSVLogger(outdir, name="run", version=0), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StragglerMonitor(every_n_steps=4, prog_bar=True)])
    trainer.fit(Module(), data)


if __name__ == "__main__":
    main(sys.argv[1])
