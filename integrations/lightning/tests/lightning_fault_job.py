"""A Lightning job on two CPU processes with one injected fault, run by test_lightning_faults.py.

``python lightning_fault_job.py FAULT TIMEOUT_S OUTDIR [plait|ddp|fabric]`` trains a small MLP
under Lightning's own launcher (``devices=2``: rank 0 starts rank 1 by re-running this script)
with the Trainer and ``PlaitStrategy(ZeroConfig(stage=3))`` (or Lightning's ``ddp``, for
comparison; or a Fabric loop with ``PlaitFabricStrategy``), a collective timeout of TIMEOUT_S and
the fault (``plait.kernels.testing.Fault`` text, e.g.
``hang:rank=1:step=3``). Each rank writes its pid to OUTDIR/pid<rank> when training starts; the
faulty rank writes OUTDIR/fault_time (wall clock) right before the fault; a rank that finishes
writes OUTDIR/done<rank> (rank 1 two seconds after ``fit`` returns).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from plait.kernels.testing import Fault
from plait.lightning import PlaitFabricStrategy, PlaitStrategy
from plait.zero_sharding import ZeroConfig


class FaultyModule(L.LightningModule):
    """A two-layer MLP whose training step injects the fault."""

    def __init__(self, fault: Fault, outdir: str) -> None:
        super().__init__()
        self.fault, self.outdir = fault, Path(outdir)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def on_train_start(self) -> None:
        """Tell the test this rank's pid."""
        (self.outdir / f"pid{self.global_rank}").write_text(str(os.getpid()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Inject the fault (on its rank and step), then an MSE step."""
        if self.fault.fires(self.global_step, self.global_rank):
            (self.outdir / "fault_time").write_text(repr(time.time()))
        self.fault.maybe_inject(self.global_step, self.global_rank)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data() -> DataLoader:
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(128, 8), torch.randn(128, 1)), batch_size=4)


def fabric_main(fault: Fault, timeout: timedelta, outdir: Path) -> None:
    """The same training as a Fabric loop."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=PlaitFabricStrategy(ZeroConfig(stage=3), timeout=timeout))
    fabric.launch()
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    net, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    (outdir / f"pid{fabric.global_rank}").write_text(str(os.getpid()))
    for step, (x, y) in zip(range(12), _data()):
        if fault.fires(step, fabric.global_rank):
            (outdir / "fault_time").write_text(repr(time.time()))
        fault.maybe_inject(step, fabric.global_rank)
        fabric.backward(torch.nn.functional.mse_loss(net(x), y))
        optimizer.step()
        optimizer.zero_grad()
    (outdir / f"done{fabric.global_rank}").write_text("done")


def main(argv: list[str]) -> None:
    """Run the job described in the module docstring."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stack, on request
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    fault, timeout, outdir = Fault.parse(argv[1]), timedelta(seconds=float(argv[2])), argv[3]
    kind = argv[4] if len(argv) > 4 else "plait"
    torch.set_num_threads(1)
    if kind == "fabric":
        return fabric_main(fault, timeout, Path(outdir))
    # The timeout also bounds start-up (rank 0's store waits that long for rank 1 to connect, and
    # rank 1 imports Lightning first), so on a busy two-core machine it cannot be much below 30 s.
    strategy = (PlaitStrategy(ZeroConfig(stage=3), timeout=timeout) if kind == "plait"
                else L.pytorch.strategies.DDPStrategy(timeout=timeout))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=12, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(FaultyModule(fault, outdir), _data())
    if trainer.global_rank == 1:
        time.sleep(2)  # work after fit on one rank: rank 0 must not cut it short by exiting first
    (Path(outdir) / f"done{trainer.global_rank}").write_text("done")


if __name__ == "__main__":
    main(sys.argv)
