"""A Lightning Fabric loop under ``torchrun --max-restarts`` that resumes by itself from its newest checkpoint.

``torchrun --standalone --nproc-per-node 2 [--max-restarts K] reliability_fabric_restart_job.py FAULT OUTDIR
STEPS SAVE_EVERY [STAGE]`` (run by test_reliability_lightning_restart.py, next to the Trainer job):

* ``PlaitFabricStrategy(ZeroConfig(stage=STAGE))``, ``devices=2`` (Fabric sees torchrun's environment
  and starts no process); the strategy joins through ``collectives.init_process_group``;
* ``fabric.save(OUTDIR/ckpts/step-<n>, ...)`` every SAVE_EVERY steps, each step in its own
  directory, so a save cut short never touches the previous one;
* at start, the newest directory holding a committed plait checkpoint is loaded
  (:func:`newest_checkpoint`); its ``step`` says where to go on;
* FAULT, the journal and the data: as for reliability_lightning_job.py.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from reliability_lightning_job import TIMEOUT_S, batch_of, start_worker
from reliability_restart_job import faults_of_attempt

from plait.kernels import collectives
from plait.lightning import PlaitFabricStrategy
from plait.lightning.checkpoint import is_directory_checkpoint
from plait.zero_sharding import ZeroConfig


def newest_checkpoint(root: Path) -> Path | None:
    """The ``step-<n>`` directory of ``root`` with the highest n that holds a committed checkpoint."""
    found = [path for path in root.glob("step-*") if is_directory_checkpoint(path)] if root.is_dir() else []
    return max(found, key=lambda path: int(path.name.split("-")[1]), default=None)


def main(fault_text: str, outdir: Path, steps: int, save_every: int, stage: int = 3) -> int:
    """Train, resuming from OUTDIR/ckpts when a checkpoint is there; returns the exit code."""
    journal = start_worker(outdir)
    attempt, rank = journal.attempt, int(os.environ["RANK"])
    strategy = PlaitFabricStrategy(ZeroConfig(stage=stage), timeout=timedelta(seconds=TIMEOUT_S))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    latest = newest_checkpoint(outdir / "ckpts")
    if latest is not None:
        fabric.load(latest, state)
    journal.event("start", state["step"])
    faults = faults_of_attempt(fault_text, attempt)
    for step in range(state["step"], steps):
        collectives.set_step(step)
        for fault in faults:
            if fault.fires(step, rank):
                journal.event("fault", step, fault=str(fault))
                fault.maybe_inject(step, rank)
        x, y = batch_of(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        journal.loss(step, float(loss.detach()))
        if (step + 1) % save_every == 0:
            fabric.save(outdir / "ckpts" / f"step-{step + 1}", {**state, "step": step + 1})
            journal.event("save", step + 1)
    journal.event("done", steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *map(int, sys.argv[5:6])))
