"""When a rank of a plait Lightning job fails, every process of the job ends: no orphans.

Lightning's script launcher (``devices=N`` with no external launcher) starts ranks 1..N-1 as
children of rank 0 (``subprocess.Popen``). Its observer thread kills everything when a *child*
exits non-zero, and its signal handlers pass Ctrl-C and SIGTERM on; but when rank 0 itself fails
(an exception, a collective's timeout) it exits and leaves its children running: a child waiting
in a collective, or hung, keeps its GPU until someone kills it by hand (see Lightning's
GitHub issues #8130 and #9303). Two guards close that gap, without a launcher of plait's own:

* rank 0's strategy, told of the exception by Lightning's ``on_exception`` hook, SIGKILLs the
  ranks it launched and reaps them, before Lightning's teardown (which could itself wait in a
  collective). Fabric has no such hook; there rank 0 does the same when its interpreter exits
  after an uncaught exception (:func:`reap_at_exit`). SIGKILL because a rank blocked inside a
  collective runs no Python signal handler; its exit code is then -9.
* every launched child asks the kernel to SIGKILL it when rank 0 exits (Linux
  ``PR_SET_PDEATHSIG``), which also covers a rank 0 that never ran Python again (SIGKILL, the
  OOM killer). So that this never cuts short a child still finishing a *successful* run, rank 0
  waits at exit for its children to end by themselves, up to the job's timeout, and only then
  kills what is left.

``PLAIT_LAUNCHER_PID`` (read only here) carries rank 0's pid to its children, so a child arms the
second guard only when its parent is that launcher, not under torchrun or SLURM.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Any

LAUNCHER_PID = "PLAIT_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
REAP_TIMEOUT_S = 10.0


def mark_launcher(launcher: Any, timeout_s: float) -> None:
    """In rank 0, right before Lightning starts its children: tell them who their launcher is,
    and have this process wait for them at exit (see :func:`reap_at_exit`)."""
    os.environ[LAUNCHER_PID] = str(os.getpid())
    atexit.register(reap_at_exit, launcher, timeout_s)


def reap_at_exit(launcher: Any, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the ranks ``launcher`` started to end, then kill the rest.

    Runs when rank 0's interpreter exits. After an unhandled exception it waits for nothing: the
    other ranks are then blocked in a collective rank 0 will never enter (the Trainer has already
    stopped them in ``on_exception``; Fabric, which has no such hook, relies on this).
    """
    procs: list[subprocess.Popen] = list(getattr(launcher, "procs", []) or [])
    failed = getattr(sys, "last_value", None) is not None  # set when the interpreter printed an uncaught error
    deadline = time.monotonic() + (0.0 if failed else timeout_s)
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    if any(proc.poll() is None for proc in procs):
        why = sys.last_value if failed else TimeoutError(f"ranks still running {timeout_s:.0f} s after rank 0 ended")
        stop_launched_ranks(launcher, why)


def launcher_pid() -> int | None:
    """The pid of the plait launcher that started this process, or ``None`` if it was not one."""
    raw = os.environ.get(LAUNCHER_PID, "")
    return int(raw) if raw.isdigit() and int(raw) == os.getppid() else None


def die_with_launcher() -> bool:
    """In a rank launched by rank 0: have the kernel SIGKILL this process when rank 0 exits.

    Returns:
        Whether the guard is armed (Linux, and this process was started by a plait launcher).
    """
    parent = launcher_pid()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # rank 0 died before the guard was armed: act as the guard would
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def stop_launched_ranks(launcher: Any, exception: BaseException | None = None) -> dict[int, int | None]:
    """Kill and reap the ranks ``launcher`` started (a no-op where it started none).

    Args:
        launcher: the strategy's launcher; only a script launcher's ``procs`` are touched.
        exception: what ended this rank: printed (type and message) before any rank is killed,
            as the traceback may never be (see the comment in the body).

    Returns:
        local rank -> exit code (``None`` if it could not be reaped within 10 s).
    """
    procs: list[subprocess.Popen] = list(getattr(launcher, "procs", []) or [])
    if procs and exception is not None:
        # Say why first: once a child is dead, Lightning's observer thread (polling every 5 s) may
        # SIGKILL this process before its traceback is printed, and the error naming the rank is lost.
        print(f"plait: rank 0 ended with {type(exception).__name__}: {exception}", file=sys.stderr, flush=True)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    codes: dict[int, int | None] = {}
    for local_rank, proc in enumerate(procs, start=1):
        try:
            codes[local_rank] = proc.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            codes[local_rank] = None
    if procs:
        why = type(exception).__name__ if exception is not None else "a failure"
        listed = ", ".join(f"local rank {r} (pid {p.pid}, exit code {codes[r]})" for r, p in zip(codes, procs))
        print(f"plait: rank 0 ended with {why}; stopped the ranks it launched: {listed}", file=sys.stderr,
              flush=True)
    return codes
