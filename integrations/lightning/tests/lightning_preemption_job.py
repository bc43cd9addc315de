"""A Lightning job on two CPU processes that may be preempted, run by test_lightning_preemption.py.

``python lightning_preemption_job.py MODE OUTDIR [FAULT]`` trains a small MLP for 12 steps under
Lightning's own launcher (``devices=2``) with ``PlaitStrategy(ZeroConfig(stage=3))``, a
``ModelCheckpoint`` every 3 steps (the user's checkpoints, in ``OUTDIR/checkpoints``) and
:class:`~plait.lightning.PreemptionCheckpoint`:

* ``straight``: the whole run, uninterrupted;
* ``preempt``: FAULT (``plait.kernels.testing.Fault`` text, e.g. ``sigterm:rank=1:step=5``) sends
  SIGTERM at its rank and step; the faulty rank writes OUTDIR/fault_time first;
* ``resume``: a new job whose ``fit()`` is given no checkpoint: it finds the preemption checkpoint
  by itself (``PreemptionCheckpoint(dirpath=OUTDIR/checkpoints)``).

Each rank appends ``step loss`` lines to OUTDIR/losses-MODE-rank<R>.txt (loss as float.hex, so
the test compares bits). A rank stopped by the preemption writes OUTDIR/exit<R> (rank 0 adds the
exit codes of the ranks it launched) before the ``SystemExit`` ends it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from plait.kernels.testing import Fault
from plait.lightning import PlaitStrategy, PreemptionCheckpoint
from plait.zero_sharding import ZeroConfig

STEPS = 12


class Module(L.LightningModule):
    """A two-layer MLP; logs each step's loss bits; injects the fault."""

    def __init__(self, mode: str, outdir: Path, fault: Fault | None) -> None:
        super().__init__()
        self.mode, self.outdir, self.fault = mode, outdir, fault
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def on_train_start(self) -> None:
        """Tell the test this rank's pid."""
        (self.outdir / f"pid-{self.mode}{self.global_rank}").write_text(str(os.getpid()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """MSE; the fault acts at its step (after the loss, as a signal arrives mid-step)."""
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        with open(self.outdir / f"losses-{self.mode}-rank{self.global_rank}.txt", "a") as out:
            out.write(f"{self.global_step} {loss.item().hex()}\n")
        if self.fault is not None and self.fault.fires(self.global_step, self.global_rank):
            (self.outdir / "fault_time").write_text(repr(time.time()))
            self.fault.maybe_inject(self.global_step, self.global_rank)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam (its state must survive the resume too)."""
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> ResumableBatches:
        """This rank's batches, resumable mid-epoch."""
        return ResumableBatches(self.global_rank, self.trainer.world_size)


class ResumableBatches:
    """This rank's share of a fixed data set in batches of 4, that knows where it is in the epoch.

    A plain ``DataLoader`` restarts its epoch on resume; Lightning saves and restores the
    position of any loader with ``state_dict``/``load_state_dict`` (torchdata's
    ``StatefulDataLoader`` is the general tool; this is the smallest one).
    """

    def __init__(self, rank: int, world: int) -> None:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(256, 8, generator=generator), torch.randn(256, 1, generator=generator)
        self.batches = [(x[i:i + 4], y[i:i + 4]) for i in range(4 * rank, 256, 4 * world)]
        self.consumed, self.skip = 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        start, self.skip = self.skip, 0
        for index in range(start, len(self.batches)):
            self.consumed = index + 1
            yield self.batches[index]

    def state_dict(self) -> dict[str, int]:
        """Batches handed out this epoch."""
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start the next iteration where the saved one was."""
        self.skip = state["consumed"]


def main(argv: list[str]) -> None:
    """Run the job described in the module docstring."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    mode, outdir = argv[1], Path(argv[2])
    fault = Fault.parse(argv[3]) if len(argv) > 3 else None
    torch.set_num_threads(1)
    checkpoints = outdir / "checkpoints"
    preemption = PreemptionCheckpoint(checkpoints if mode == "resume" else None)
    strategy = PlaitStrategy(ZeroConfig(stage=3), timeout=timedelta(seconds=30))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(outdir),
                        callbacks=[ModelCheckpoint(every_n_train_steps=3, save_top_k=-1), preemption])
    try:
        trainer.fit(Module(mode, outdir, fault))
    except SIGTERMException:
        procs = getattr(trainer.strategy.launcher, "procs", []) or []
        record = {"saved": preemption.saved_path, "save_s": preemption.save_seconds, "at": time.time(),
                  "saved_at": preemption.saved_at,
                  "signalled_at": preemption.signalled_at, "children": [p.poll() for p in procs]}
        (outdir / f"exit{trainer.global_rank}").write_text(json.dumps(record))
        raise
    (outdir / f"done-{mode}{trainer.global_rank}").write_text("done")


if __name__ == "__main__":
    main(sys.argv)
