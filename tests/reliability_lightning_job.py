"""A Lightning Trainer job under ``torchrun --max-restarts`` that resumes by itself (``ckpt_path="last"``).

``torchrun --standalone --nproc-per-node 2 [--max-restarts K] reliability_lightning_job.py FAULT OUTDIR
STEPS SAVE_EVERY [STAGE]`` (run by test_reliability_lightning_restart.py; STAGE is the ZeRO stage, 3
by default):

* ``PlaitStrategy(ZeroConfig(stage=STAGE))`` with ``devices=2`` (Lightning sees torchrun's environment
  and starts no process itself); the strategy joins the default group through
  ``collectives.init_process_group``, so a restarted attempt never reads the previous one's addresses;
* a ``ModelCheckpoint`` every SAVE_EVERY steps (``save_top_k=-1``) with ``save_last="link"``:
  ``last.ckpt`` is re-pointed only after a checkpoint is committed, so a rank killed inside a save
  never leaves a half-written ``last``;
* ``trainer.fit(module, ckpt_path="last")``: the first attempt finds nothing and starts fresh, a
  restarted (or relaunched) one resumes from the newest committed checkpoint;
* FAULT: as for reliability_restart_job.py (``none`` or ``fault[@attempt],...``, e.g.
  ``kill:rank=1:step=4`` on the first attempt).

The data of a step depends only on the step and the rank (a resumed run sees the same batches).
Each rank appends ``attempt step loss.hex()`` lines to OUTDIR/losses-rank<r>.txt and JSON events
(start with the step it starts from, save, fault, done) to OUTDIR/events-rank<r>.jsonl.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from reliability_restart_job import Journal, faults_of_attempt

from plait.kernels import collectives
from plait.lightning import PlaitStrategy
from plait.zero_sharding import ZeroConfig

TIMEOUT_S = 30.0  # collective and join timeout: a rank's Lightning import is slow on a loaded machine


class Module(L.LightningModule):
    """A two-layer MLP trained with Adam on batches seeded by (step, rank); journals every step."""

    def __init__(self, journal: Journal, fault_text: str, save_every: int) -> None:
        super().__init__()
        self.journal, self.save_every = journal, save_every
        self.faults = faults_of_attempt(fault_text, journal.attempt)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def on_train_start(self) -> None:
        """Record where this attempt starts (0, or the step a checkpoint restored)."""
        self.journal.event("start", self.global_step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """MSE on this step's batch; a fault of this attempt acts before the step's collectives."""
        step, rank = self.global_step, self.global_rank
        collectives.set_step(step)
        for fault in self.faults:
            if fault.fires(step, rank):
                self.journal.event("fault", step, fault=str(fault))
                fault.maybe_inject(step, rank)
        x, y = batch_of(step, rank)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.journal.loss(step, float(loss.detach()))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """ModelCheckpoint's hook ran first: a step that saved has its checkpoint committed now."""
        if self.global_step % self.save_every == 0:
            self.journal.event("save", self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam: its moments must survive the restart too."""
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> list[int]:
        """Placeholders: the batch of a step is drawn in ``training_step`` from its step and rank."""
        return list(range(1000))


def batch_of(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` on ``rank``: seeded by both, so a resumed run sees the same data."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)


def start_worker(outdir: Path) -> Journal:
    """Quiet Lightning, one thread, and this worker's journal and pid file (per torchrun attempt)."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    attempt, rank = collectives.restart_count(), int(os.environ["RANK"])
    (outdir / f"pid{rank}-attempt{attempt}").write_text(str(os.getpid()))
    return Journal(outdir, rank, attempt)


def main(fault_text: str, outdir: Path, steps: int, save_every: int, stage: int = 3) -> int:
    """Fit (resuming from OUTDIR/checkpoints when a checkpoint is there); returns the exit code."""
    journal = start_worker(outdir)
    checkpoints = ModelCheckpoint(dirpath=outdir / "checkpoints", every_n_train_steps=save_every, save_top_k=-1,
                                  save_last="link")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PlaitStrategy(ZeroConfig(stage=stage),
                                                                            timeout=timedelta(seconds=TIMEOUT_S)),
                        max_steps=steps, logger=False, use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=True, default_root_dir=str(outdir),
                        callbacks=[checkpoints])
    trainer.fit(Module(journal, fault_text, save_every), ckpt_path="last")
    journal.event("done", trainer.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *map(int, sys.argv[5:6])))
