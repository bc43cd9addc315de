"""Finding processes a test left behind, by a token in their command line (Linux, ``/proc``).

Failure tests launch jobs (torchrun, Lightning's launcher, SLURM-style restarts) and must show that
no process of the job is left once it ends; :func:`run_in_session` launches such a job in a session
of its own and kills the whole session when it overruns. Each job runs with a unique directory on its command
line, so a scan of ``/proc`` for that directory finds exactly its processes. Read from ``/proc``
rather than psutil, which the distributions do not install.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def live_processes_mentioning(token: str) -> list[str]:
    """Every live process (not a zombie: dead, only not yet reaped) whose command line holds ``token``.

    Args:
        token: text to look for, typically the job's unique output directory.

    Returns:
        ``"pid: command line"`` per process found; the calling process is never listed.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it ended while we looked
            continue
        if token in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


@dataclass(frozen=True)
class SessionRun:
    """One job run by :func:`run_in_session`.

    Attributes:
        rc: the job's exit code.
        output: what it printed (stdout and stderr together, or stderr alone; see ``keep``).
        ended: wall-clock time (``time.time()``) at which it exited.
    """

    rc: int
    output: str
    ended: float


class SessionTimeoutError(TimeoutError):
    """The job ran past its limit; its whole session was SIGKILLed. ``output`` holds what it printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def torchrun_command() -> list[str]:
    """The ``torchrun`` of this interpreter's environment (``python -m torch.distributed.run`` when
    the console script is missing, as in some lone installs)."""
    found = Path(sys.executable).with_name("torchrun")
    return [str(found)] if found.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def run_in_session(argv: list[str], *, limit_s: float, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                   keep: str = "both") -> SessionRun:
    """Run a job as a user would, in a session of its own, and never leave it behind.

    Launchers (torchrun, Lightning's, a shell script) start further processes; a new session puts
    them all in one process group, so one ``killpg`` ends the whole job when it overruns.

    Args:
        argv: the command.
        limit_s: seconds before the whole session is SIGKILLed.
        env: the job's environment (the caller's when ``None``).
        cwd: its working directory.
        keep: ``"both"`` (stdout and stderr together) or ``"stderr"`` (stdout discarded).

    Returns:
        Its exit code, output and end time.

    Raises:
        ValueError: ``keep`` is neither of the two.
        SessionTimeoutError: it ran past ``limit_s`` (it is killed first; the exception holds its output).
    """
    if keep not in ("both", "stderr"):
        raise ValueError(f"keep={keep!r}: give 'both' or 'stderr'")
    stdout = subprocess.PIPE if keep == "both" else subprocess.DEVNULL
    stderr = subprocess.STDOUT if keep == "both" else subprocess.PIPE
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # never leave the job behind, even when the test fails
        out, err = proc.communicate()
        text = out if keep == "both" else err
        message = f"{Path(argv[0]).name} still ran after {limit_s:.0f} s:\n{text[-4000:]}"
        raise SessionTimeoutError(message, text) from None
    return SessionRun(proc.returncode, out if keep == "both" else err, time.time())
