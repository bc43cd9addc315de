"""A Lightning Fabric loop (``PlaitFabricStrategy`` ZeRO-3, ``devices=2``) with PreemptionGuard and resume.

``python reliability_fabric_job.py preempt|resume OUTDIR [FAULT]`` (run by
test_reliability_fabric_preemption.py):

* ``preempt``: trains up to STEPS steps; FAULT (``plait.kernels.testing.Fault`` text, e.g.
  ``sigterm:rank=1:step=4``) acts at its rank and step; when ``guard.should_stop()`` says so,
  every rank saves ``fabric.save(OUTDIR/ckpt, ...)`` after the same step and leaves the loop;
* ``resume``: loads OUTDIR/ckpt (the step travels in it) and trains to STEPS; then, in the same
  process, a fresh model trains all STEPS steps straight: the reference the test compares with.

Each rank writes OUTDIR/<mode>-rank<r>.json: losses by step (``float.hex``), the stop step, signal
and save times, and for ``resume`` the straight run's losses.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch

from plait.kernels import collectives
from plait.kernels.testing import Fault
from plait.lightning import PlaitFabricStrategy
from plait.zero_sharding import ZeroConfig

STEPS = 9


def build(fabric: L.Fabric) -> tuple:
    """The model and optimizer, set up by Fabric (same seed on every call: the same start)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return fabric.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))


def train_step(fabric: L.Fabric, net: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> str:
    """One step on the batch of ``step`` (seeded by step and rank: a resume sees the same data)."""
    generator = torch.Generator().manual_seed(1000 * step + fabric.global_rank)
    x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
    loss = torch.nn.functional.mse_loss(net(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach()).hex()


def run(fabric: L.Fabric, net, optimizer, start: int, fault: Fault | None, guard) -> tuple[dict, int | None]:
    """Steps ``start..STEPS``; returns the losses and the step the guard stopped after (or None)."""
    losses = {}
    for step in range(start, STEPS):
        if fault is not None:
            fault.maybe_inject(step, fabric.global_rank)
        losses[step] = train_step(fabric, net, optimizer, step)
        if guard is not None and guard.should_stop():
            return losses, step
    return losses, None


def main(mode: str, outdir: Path, fault_text: str | None) -> None:
    # 60 s: rank 1 imports Lightning slowly on a loaded machine, and joining waits for it
    strategy = PlaitFabricStrategy(ZeroConfig(stage=3), timeout=timedelta(seconds=60))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.set_num_threads(1)
    net, optimizer = build(fabric)
    result: dict = {}
    if mode == "preempt":
        guard = collectives.PreemptionGuard(grace_s=30.0).install()
        result["losses"], stopped = run(fabric, net, optimizer, 0, Fault.parse(fault_text) if fault_text else None,
                                        guard)
        if stopped is not None:
            fabric.save(outdir / "ckpt", {"model": net, "optimizer": optimizer, "step": stopped + 1})
        guard.uninstall()
        result.update(stopped=stopped, signalled_at=guard.signalled_at, saved_at=time.time())
    else:
        state = {"model": net, "optimizer": optimizer, "step": 0}
        fabric.load(outdir / "ckpt", state)
        result["start"] = state["step"]
        result["losses"], _ = run(fabric, net, optimizer, state["step"], None, None)
        fresh, fresh_optimizer = build(fabric)
        result["straight"], _ = run(fabric, fresh, fresh_optimizer, 0, None, None)
    (outdir / f"{mode}-rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
