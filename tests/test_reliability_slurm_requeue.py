"""R9, restart after a SLURM requeue with a plait strategy, without SLURM: saved, requeued, resumed by itself.

SLURM is played by this test: each task of ``reliability_slurm_job.py`` is started as ``srun`` starts
it (one process per task, ``SLURM_NTASKS``/``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``/
``SLURM_JOB_ID``/``SLURM_NODELIST``..., one process group), and a fake ``scontrol`` on ``PATH``
records the requeue. Lightning then uses ``SLURMEnvironment(auto_requeue=True)``, its default on SLURM.

* **straight**: 9 steps, no signal (the reference);
* **signalled**: before step 3 every task gets SIGUSR1 (what ``#SBATCH --signal=USR1@90`` does).
  Checked: the ranks save plait's sharded checkpoint ``hpc_ckpt_1.ckpt`` (a universal-checkpoint
  directory, committed) together at the next step boundary, rank 0 runs ``scontrol requeue <job
  id>``; then, as slurmctld does on a requeue, every task gets SIGTERM (and SIGKILL ``KILL_WAIT_S``
  later, which is never needed): both tasks stop at the next batch start and exit 0, no process left;
* **requeued**: the same command with the same variables and ``SLURM_RESTART_COUNT=1``; ``fit()``
  finds ``hpc_ckpt_1.ckpt`` by itself, both ranks start from step 4, every loss from there and the
  final weights are bit for bit the straight run's, and the job exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_jobs import events, live_processes_mentioning, losses, record

pytest.importorskip("lightning")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc")

JOB = Path(__file__).with_name("reliability_slurm_job.py")
STEPS, SIGNAL_STEP, JOB_ID = 9, 3, "4242"
# One launch of two Lightning tasks: about 15 s at load 4 on two cores, past 75 s with a load generator
# beside a busy machine. Only a stuck launch meets this bound, so it is generous.
LIMIT_S = 300.0
KILL_WAIT_S = 30.0  # SLURM's default KillWait: SIGTERM, then SIGKILL this much later (15.4 s used at load 33)
FAKE_SCONTROL = """#!/bin/sh
# scontrol as the test's SLURM: record the command; the test ends the job as slurmctld would.
echo "$@" >> "$FAKE_SLURM_LOG"
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_env(tmp_path: Path, rank: int, port: int, restart: int) -> dict[str, str]:
    """What srun sets for task ``rank`` of a 2-task, 1-node job (plus the fake scontrol on PATH)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "scontrol").write_text(FAKE_SCONTROL)
    (fake_bin / "scontrol").chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_PROCID=str(rank),
               SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train",
               SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               SLURM_RESTART_COUNT=str(restart), PATH=f"{fake_bin}{os.pathsep}{env['PATH']}",
               FAKE_SLURM_LOG=str(tmp_path / "scontrol.log"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _srun(tmp_path: Path, outdir: Path, signal_step: int, restart: int = 0) -> tuple[list[int | None], str, float]:
    """Start both tasks in one process group; on a requeue, SIGTERM then SIGKILL it as slurmctld does.

    Returns:
        (each task's exit code, their output, seconds from the requeue to the last task gone or 0.0).
    """
    port, log = _free_port(), tmp_path / "scontrol.log"
    requeues_before = log.read_text().count("\n") if log.exists() else 0
    command = [sys.executable, str(JOB), str(outdir), str(STEPS), str(signal_step)]
    procs: list[subprocess.Popen] = []
    for rank in (0, 1):
        procs.append(subprocess.Popen(command, env=_slurm_env(tmp_path, rank, port, restart), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      process_group=procs[0].pid if procs else 0))
    group, started, requeued_at, killed = procs[0].pid, time.monotonic(), None, False
    while any(proc.poll() is None for proc in procs):
        now = time.monotonic()
        if requeued_at is None and log.exists() and log.read_text().count("\n") > requeues_before:
            requeued_at = now
            os.killpg(group, signal.SIGTERM)
        if (requeued_at is not None and now > requeued_at + KILL_WAIT_S and not killed) or now > started + LIMIT_S:
            os.killpg(group, signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    output = "\n".join(proc.stdout.read() for proc in procs)
    assert time.monotonic() < started + LIMIT_S + 10, f"the tasks ran past {LIMIT_S:.0f} s:\n{output[-4000:]}"
    gone_after = time.monotonic() - requeued_at if requeued_at is not None else 0.0
    return [proc.returncode for proc in procs], output, gone_after


def test_a_requeue_signal_saves_plaits_checkpoint_requeues_and_the_requeued_job_resumes_bitwise(tmp_path):
    from plait.lightning import consolidated_state_dict
    from plait.lightning.checkpoint import is_directory_checkpoint

    straight, job = tmp_path / "straight", tmp_path / "job"
    straight.mkdir()
    job.mkdir()
    codes, output, _ = _srun(tmp_path, straight, -1)
    assert codes == [0, 0], output[-4000:]
    assert not (tmp_path / "scontrol.log").exists()

    codes, output, gone_after = _srun(tmp_path, job, SIGNAL_STEP)
    assert live_processes_mentioning(str(job)) == []
    assert codes == [0, 0] and gone_after < KILL_WAIT_S, (codes, output[-4000:])  # stopped by SIGTERM, not SIGKILL
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {JOB_ID}\n", output[-4000:]
    hpc = job / "hpc_ckpt_1.ckpt"
    assert is_directory_checkpoint(hpc), sorted(p.name for p in job.iterdir())
    assert not any(e["event"] == "done" for rank in (0, 1) for e in events(job, rank)), output[-4000:]
    signalled = next(e for e in events(job, 0) if e["event"] == "fault")["time"]
    saved_after = (hpc / "latest").stat().st_mtime - signalled  # the commit writes the root's latest pointer last
    redone = max(losses(job, 0)[0]) + 1 - (SIGNAL_STEP + 1)  # steps trained after the save, until the SIGTERM
    print(f"SLURM requeue: SIGUSR1 before step {SIGNAL_STEP} -> {hpc.name} committed, scontrol requeue {JOB_ID}; "
          f"both tasks exited 0 {gone_after:.1f} s after the requeue's SIGTERM")
    print(f"checkpoint committed {saved_after:.2f} s after SIGUSR1; steps trained after it (redone): {redone}")

    codes, output, _ = _srun(tmp_path, job, -1, restart=1)
    assert codes == [0, 0], output[-4000:]
    assert live_processes_mentioning(str(job)) == []
    starts = [next(e for e in events(job, rank) if e["event"] == "start" and e["attempt"] == 1) for rank in (0, 1)]
    assert [e["step"] for e in starts] == [SIGNAL_STEP + 1] * 2  # saved at the step boundary after the signal
    for rank in (0, 1):
        want, got = losses(straight, rank)[0], losses(job, rank)
        assert set(range(SIGNAL_STEP + 1)) <= set(got[0]) and got[0] == {s: want[s] for s in got[0]}
        assert got[1] == {step: want[step] for step in range(SIGNAL_STEP + 1, STEPS)}
    final_want, final_got = (consolidated_state_dict(outdir / "final.ckpt") for outdir in (straight, job))
    assert sorted(final_got) == sorted(final_want)
    assert [name for name in final_want if not torch.equal(final_got[name], final_want[name])] == []
    record("plait-lightning: Trainer, PlaitStrategy ZeRO-3, SLURM auto-requeue (faked srun/scontrol)",
           f"SIGUSR1 to every task before step {SIGNAL_STEP}, requeue (SIGTERM, SIGKILL {KILL_WAIT_S:g} s later)",
           named="n/a (a requeue, not a failure)", left=0, lost_steps=redone, bitwise=True, requeue=True,
           checkpoint_after_s=round(saved_after, 2), exit_after_s=round(gone_after, 1))
