"""R8 under ``torchrun``: a rank that hangs in a collective is named and no process is left behind.

``torchrun --standalone --nproc-per-node 2`` runs ``torchrun_fault_job.py`` (a labelled all-gather
per step, collective timeout 6 s); rank 1 hangs before step 3's all-gather. Checked: rank 0's error
names rank 1 and the collective; torchrun exits non-zero; every process of the job (the agent and
both workers, found through /proc by the job's unique directory in their command lines) is gone
within the timeout + 10 s of the fault. And rank 1 SIGKILLed at step 3: torchrun names it as the
root cause, stops rank 0, and nothing is left.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from plait.kernels.testing import live_processes_mentioning, run_in_session, torchrun_command

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds leftover processes through /proc")

JOB = Path(__file__).with_name("torchrun_fault_job.py")
TIMEOUT_S = 6.0


def _run_job(fault: str, outdir: Path, limit_s: float) -> tuple[int, str, float]:
    """Launch the job; returns (torchrun's exit code, its output, wall-clock time it ended)."""
    command = [*torchrun_command(), "--standalone", "--nproc-per-node", "2", str(JOB), fault, str(TIMEOUT_S),
               str(outdir)]
    run = run_in_session(command, limit_s=limit_s, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return run.rc, run.output, run.ended


def test_a_hanging_rank_under_torchrun_is_named_and_nothing_is_left(tmp_path):
    outdir = tmp_path / "torchrun-hang-job"
    outdir.mkdir()
    rc, output, ended = _run_job("hang:rank=1:step=3", outdir, limit_s=TIMEOUT_S + 60)
    fault_time = float((outdir / "fault_time").read_text())
    left = live_processes_mentioning(str(outdir))
    pids = [int((outdir / f"pid{rank}").read_text()) for rank in (0, 1)]
    error = (outdir / "error0").read_text()
    print(f"torchrun: fault to torchrun's exit {ended - fault_time:.1f} s, rc {rc}; processes left: {left}")
    assert rc != 0
    assert left == [] and not any(Path(f"/proc/{pid}").exists() for pid in pids), left
    assert "rank 1 did not enter toy all-gather of step 3 (step 3; all_gather #4 on world)" in error
    assert "its last collective was toy all-gather of step 2" in error
    assert "rank 1 did not enter toy all-gather of step 3" in output  # what the person at the terminal sees
    assert ended - fault_time < TIMEOUT_S + 10


def test_a_killed_rank_under_torchrun_ends_the_job(tmp_path):
    outdir = tmp_path / "torchrun-kill-job"
    outdir.mkdir()
    rc, output, ended = _run_job("kill:rank=1:step=3", outdir, limit_s=TIMEOUT_S + 60)
    fault_time = float((outdir / "fault_time").read_text())
    left = live_processes_mentioning(str(outdir))
    error = (outdir / "error0").read_text() if (outdir / "error0").exists() else "(rank 0 wrote no error)"
    print(f"torchrun: rank 1 killed; torchrun exited {ended - fault_time:.1f} s later, rc {rc}; left: {left}; "
          f"rank 0: {error.strip()}")
    assert rc != 0 and left == []
    # torchrun's own report names the dead rank as the root cause (rank 0 is SIGTERMed by the
    # agent, usually before its collective reports the lost peer)
    assert re.search(r"Root Cause.*?rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9", output, re.DOTALL), output[-3000:]
    assert ended - fault_time < TIMEOUT_S + 10
