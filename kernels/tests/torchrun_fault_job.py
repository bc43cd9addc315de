"""A tiny job for ``torchrun`` with one injected fault, run by test_kernels_torchrun.py.

``torchrun --standalone --nproc-per-node 2 torchrun_fault_job.py FAULT TIMEOUT_S OUTDIR``: every
rank joins a gloo group with a collective timeout of TIMEOUT_S and all-gathers one small tensor
per step under a plait name (``toy all-gather of step S``); the fault (``plait.kernels.testing.Fault``
text, e.g. ``hang:rank=1:step=3``) acts at its rank and step. Each rank writes its pid to
OUTDIR/pid<rank> at start; the faulty rank writes OUTDIR/fault_time (wall clock) right before the
fault; a rank that fails writes its error to OUTDIR/error<rank> and exits 1; one that finishes
writes OUTDIR/done<rank>.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.testing import Fault


def main(fault_text: str, timeout_s: float, outdir: Path) -> int:
    """Run the job; returns the process's exit code."""
    fault = Fault.parse(fault_text)
    rank = int(os.environ["RANK"])
    (outdir / f"pid{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    shard, full = torch.full((4,), float(rank)), torch.empty(8)
    try:
        for step in range(8):
            collectives.set_step(step)
            if fault.fires(step, rank):
                (outdir / "fault_time").write_text(repr(time.time()))
            fault.maybe_inject(step, rank)
            collectives.all_gather_into_tensor(full, shard, name=f"toy all-gather of step {step}")
            time.sleep(0.05)
    except Exception as exc:  # written for the test, then the job fails as it would
        (outdir / f"error{rank}").write_text("".join(traceback.format_exception_only(exc)))
        raise
    (outdir / f"done{rank}").write_text("ok")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])))
