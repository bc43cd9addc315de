"""A Lightning Trainer job as SLURM starts it, with SLURM's auto-requeue (run by test_reliability_slurm_requeue.py).

``python reliability_slurm_job.py OUTDIR STEPS SIGNAL_STEP``, once per task, with the variables
``srun`` sets (``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_JOB_ID``, ...):

* ``PlaitStrategy(ZeroConfig(stage=3))``, ``devices=2``: Lightning detects ``SLURMEnvironment``
  (``auto_requeue=True`` by default) and starts no process itself;
* ``trainer.fit(module)`` without ``ckpt_path``, ``default_root_dir=OUTDIR``: a requeued job
  resumes from ``OUTDIR/hpc_ckpt_N.ckpt`` by itself (Lightning's rule on SLURM);
* at step SIGNAL_STEP (``-1``: never) of the first run (``SLURM_RESTART_COUNT`` unset or 0), rank 0
  sends SIGUSR1 to the job's process group: every task gets it, as from SLURM's ``--signal=USR1@T``;
  from then on each step sleeps ``STEP_SLEEP_S``, so the job is still training when the requeue's
  SIGTERM comes (as a real job is, with 90 s left);
* a finished fit saves ``OUTDIR/final.ckpt``.

The model, data and journal are those of ``reliability_lightning_job.py`` (a step's batch depends
only on its step and rank); the journal's attempt is ``SLURM_RESTART_COUNT``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from reliability_lightning_job import TIMEOUT_S, Module
from reliability_restart_job import Journal

from plait.lightning import PlaitStrategy
from plait.zero_sharding import ZeroConfig

STEP_SLEEP_S = 0.3


class SignalledModule(Module):
    """The journaled MLP of ``reliability_lightning_job.py``; rank 0 signals the job at ``signal_step``."""

    def __init__(self, journal: Journal, signal_step: int) -> None:
        super().__init__(journal, "none", save_every=10**9)
        self.signal_step = signal_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """SIGUSR1 to every task at ``signal_step`` (first run only); slow steps after it."""
        step = self.global_step
        if self.journal.attempt == 0 and 0 <= self.signal_step <= step:
            if step == self.signal_step and self.global_rank == 0:
                self.journal.event("fault", step, fault="SIGUSR1 to every task")
                os.killpg(os.getpgrp(), signal.SIGUSR1)
            time.sleep(STEP_SLEEP_S)
        return super().training_step(batch, batch_idx)


def main(outdir: Path, steps: int, signal_step: int) -> int:
    """Fit (resuming from an hpc checkpoint of OUTDIR when there is one), then save OUTDIR/final.ckpt."""
    torch.set_num_threads(1)
    rank, attempt = int(os.environ["SLURM_PROCID"]), int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    (outdir / f"pid{rank}-attempt{attempt}").write_text(str(os.getpid()))
    journal = Journal(outdir, rank, attempt)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PlaitStrategy(ZeroConfig(stage=3),
                                                                            timeout=timedelta(seconds=TIMEOUT_S)),
                        max_steps=steps, logger=False, use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(outdir))
    trainer.fit(SignalledModule(journal, signal_step))
    trainer.save_checkpoint(outdir / "final.ckpt")
    journal.event("done", trainer.global_step)
    return 0


if __name__ == "__main__":
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
