"""Launching a job under ``torchrun`` the way a user does, and finding what it left behind.

Shared by the top-level reliability tests (test_reliability_*.py): each runs
``reliability_restart_job.py`` under ``torchrun --standalone`` in a fresh session, kills the whole
session if it overruns, and looks through ``/proc`` for live processes whose command line holds the
job's unique output directory (the agent and its workers, whichever restart they belong to).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# The reliability tests import the process scan from here, as they did before it moved to the shared module.
from plait.kernels.testing import SessionRun, run_in_session, torchrun_command
from plait.kernels.testing import live_processes_mentioning as live_processes_mentioning

JOB = Path(__file__).with_name("reliability_restart_job.py")


def run_job(outdir: Path, fault: str, *, steps: int, save_every: int, nproc: int = 2, max_restarts: int = 0,
            stage: int | str = 3, limit_s: float = 120.0, job: Path = JOB) -> SessionRun:
    """Run ``job`` (``reliability_restart_job.py`` or a script taking the same arguments) once under
    torchrun; the whole session is SIGKILLed past ``limit_s``.

    Raises:
        TimeoutError: the job ran past ``limit_s`` (it is killed first).
    """
    command = [*torchrun_command(), "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
               "--monitor-interval", "0.2", str(job), fault, str(outdir), str(steps), str(save_every), str(stage)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    return run_in_session(command, limit_s=limit_s, env=env)


def losses(outdir: Path, rank: int) -> dict[int, dict[int, str]]:
    """attempt -> step -> the loss's exact bits (``float.hex``), from the job's loss file."""
    out: dict[int, dict[int, str]] = {}
    for line in (outdir / f"losses-rank{rank}.txt").read_text().splitlines():
        attempt, step, bits = line.split()
        out.setdefault(int(attempt), {})[int(step)] = bits
    return out


def events(outdir: Path, rank: int) -> list[dict]:
    """The job's events of ``rank`` (start, resume, save, fault, preempted, done), in order."""
    return [json.loads(line) for line in (outdir / f"events-rank{rank}.jsonl").read_text().splitlines()]


def pids(outdir: Path) -> list[int]:
    """Every worker pid the job wrote (all ranks, all attempts)."""
    return [int(path.read_text()) for path in outdir.glob("pid*-attempt*")]


RESULTS_ENV = "PLAIT_RELIABILITY_RESULTS"


def record(package: str, fault: str, **figures: object) -> None:
    """Append one row of docs/reliability.md's table to the file ``PLAIT_RELIABILITY_RESULTS`` names.

    Nothing happens when the variable is unset (a plain test run); ``reliability_report.py run``
    sets it, collects the rows into the committed results file and renders the table from it.

    Args:
        package: what ran (``zero-sharding ZeRO-3``, ``onebit-optim``, ``plait-lightning``...).
        fault: what went wrong (``rank 1 SIGKILLed at step 2``...).
        figures: the measured values (``named``, ``seconds``, ``left``, ``lost_steps``, ``lost_s``,
            ``bitwise``, ``exit_zero``...), JSON values.
    """
    target = os.environ.get(RESULTS_ENV)
    if not target:
        return
    with open(target, "a") as handle:
        handle.write(json.dumps({"package": package, "fault": fault, **figures}) + "\n")
