"""Preemption for any training loop: SIGTERM on any rank stops every rank after the same step.

SLURM, Kubernetes and spot instances send SIGTERM some seconds before SIGKILL, often to one node
only. A plain ``torchrun`` loop, or a Lightning Fabric one, then needs every rank to finish the step
it is in, save together and exit 0, so that the restarted job resumes from that checkpoint.
:class:`PreemptionGuard` is the part that is the same everywhere::

    guard = PreemptionGuard().install()              # replaces the SIGTERM handler until uninstall()
    manager = CheckpointManager(CheckpointConfig(root="ckpts"))   # plait.universal_ckpt
    start = manager.restore(state) or 0             # resumes a preempted (or killed) run by itself
    for step in range(start, steps):
        train_step(step)
        if guard.should_stop():                     # every rank gets the same answer
            manager.save(state, step=step + 1)
            manager.wait()
            break                                   # exit 0: the job finished what it could

Two rules make it safe under ZeRO-3 and async collectives:

* **the signal handler only sets a flag.** It runs between two Python bytecodes wherever the main
  thread happens to be (inside a backward hook, between a prefetch and its wait); a collective
  there could pair with a different collective on another rank.
* **the ranks agree at a step boundary.** Each rank's flag is OR-ed over the group by one 4-byte
  all-reduce, named ``preemption check (SIGTERM on any rank)`` in the flight log, every
  ``check_every_n_steps`` calls, so a rank that was not signalled stops at the same step as one
  that was.

The guard makes SIGTERM non-fatal, which a *hung* rank must not get away with: torchrun's agent
stops the other workers with SIGTERM when one fails, and a rank stuck in its data loader would
then linger until the agent's SIGKILL. So the first signal also starts a ``grace_s`` timer: a
process that is still alive when it runs out ends itself (exit code ``128 + signal``, as a shell
reports a process the signal killed). A save cut short that way leaves the previous committed
checkpoint in place (universal checkpoints commit atomically).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.collectives.ops import ReduceOp, all_reduce

CHECK_NAME = "preemption check (SIGTERM on any rank)"


def any_rank(flag: bool, *, group: Any | None = None, device: torch.device | str = "cpu",
             name: str = CHECK_NAME) -> bool:
    """Whether ``flag`` is set on any rank of ``group``: one named 4-byte all-reduce (MAX).

    Every rank of ``group`` must call it at the same point of its loop. Without an initialized
    process group (or with one rank) it returns ``flag`` and communicates nothing.

    Args:
        flag: this rank's answer.
        group: the process group (``None``: the default group).
        device: where the 4-byte tensor lives (``cuda`` for NCCL).
        name: the collective's name in the flight log.

    Returns:
        The OR of every rank's ``flag``.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return flag
    vote = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(vote, op=ReduceOp.MAX, group=group, name=name)
    return bool(vote.item() > 0)


class PreemptionGuard:
    """Catches SIGTERM (or other signals) and tells every rank, at a step boundary, to stop.

    Args:
        check_every_n_steps: how often :meth:`should_stop` asks the other ranks (one 4-byte
            all-reduce per check; a preempted job runs up to this many more steps).
        signals: the signals that mean "preempted" (``SIGTERM`` by default; add ``SIGUSR1`` for
            a SLURM ``--signal`` warning).
        group: the process group whose ranks stop together (``None``: the default group).
        device: where the check's tensor lives (``"cpu"`` for gloo, ``"cuda"`` for NCCL).
        grace_s: seconds from the first signal after which a process still running ends itself
            (``None``: never). 20 s by default: inside the 30 s that SLURM (``KillWait``),
            Kubernetes (``terminationGracePeriodSeconds``) and torchrun's agent give before
            SIGKILL, with the rest left for the launcher to see the exit. Raise it when a save
            takes longer (and the scheduler's grace time with it).

    Raises:
        ValueError: ``check_every_n_steps`` is not an int >= 1, ``signals`` is empty, or
            ``grace_s`` is not a positive number or None.
    """

    def __init__(self, *, check_every_n_steps: int = 1, signals: tuple[int, ...] = (signal.SIGTERM,),
                 group: Any | None = None, device: torch.device | str = "cpu", grace_s: float | None = 20.0) -> None:
        if not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise ValueError(f"PreemptionGuard(check_every_n_steps={check_every_n_steps!r}) must be an int >= 1.")
        if not signals:
            raise ValueError("PreemptionGuard(signals=()) catches nothing; pass e.g. (signal.SIGTERM,).")
        if grace_s is not None and not (isinstance(grace_s, (int, float)) and grace_s > 0):
            raise ValueError(f"PreemptionGuard(grace_s={grace_s!r}) must be a number of seconds > 0, or None "
                             "for no limit.")
        self.check_every_n_steps, self.signals = check_every_n_steps, tuple(signals)
        self.group, self.device, self.grace_s = group, device, grace_s
        self._timer: threading.Timer | None = None
        self.signalled_at: float | None = None  # wall clock of this rank's first signal
        self.stopped_at: float | None = None  # wall clock when should_stop() first said True
        self.calls = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionGuard:
        """Replace the handlers of ``signals`` with one that only sets this guard's flag.

        Returns:
            The guard itself (``guard = PreemptionGuard().install()``).

        Raises:
            RuntimeError: called outside the main thread (Python delivers signals only there).
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard.install() must run in the main thread (signal handlers live there).")
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`, and stop the
        grace timer (call it once the save is done)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionGuard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    @property
    def signalled(self) -> bool:
        """Whether this rank received one of ``signals``."""
        return self.signalled_at is not None

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag and a timer: no I/O, no collective (see the module docstring).
        if self.signalled_at is None:
            self.signalled_at = time.time()
            if self.grace_s is not None:
                self._timer = threading.Timer(self.grace_s, self._grace_over, args=(signum,))
                self._timer.daemon = True
                self._timer.start()

    def _grace_over(self, signum: int) -> None:
        print(f"plait: still running {self.grace_s:g} s after signal {signum} (PreemptionGuard grace_s); "
              "exiting without finishing", file=sys.stderr, flush=True)
        os._exit(128 + signum)  # from this thread: the main one may be stuck in a collective or a loader

    def should_stop(self) -> bool:
        """Call once per step on every rank, at the same point: whether every rank should stop now.

        Every ``check_every_n_steps``-th call asks the other ranks (a collective); the calls in
        between answer from earlier checks only, so the ranks always agree.

        Returns:
            True on every rank once any rank has been signalled (and stays True).
        """
        self.calls += 1
        if self.stopped_at is not None:
            return True
        if self.calls % self.check_every_n_steps:
            return False
        if any_rank(self.signalled, group=self.group, device=self.device):
            self.stopped_at = time.time()
            if self.signalled:
                print(f"plait: signal received {self.stopped_at - self.signalled_at:.2f} s ago; every rank stops "
                      "after this step", file=sys.stderr, flush=True)
        return self.stopped_at is not None


__all__ = ["CHECK_NAME", "PreemptionGuard", "any_rank"]
