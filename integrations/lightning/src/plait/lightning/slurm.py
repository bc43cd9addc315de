"""SLURM auto-requeue under the plait strategies: the requeue checkpoint is saved by every rank at a step boundary.

On SLURM, Lightning 2.6 uses ``SLURMEnvironment(auto_requeue=True)`` by default. When the requeue
signal arrives (``SIGUSR1`` unless set otherwise; ``#SBATCH --signal=SIGUSR1@90`` sends it to every
task), its handler calls ``trainer.save_checkpoint(default_root_dir/hpc_ckpt_N.ckpt)`` and, on rank
0, ``scontrol requeue $SLURM_JOB_ID``. The requeued job's ``fit()`` (without ``ckpt_path``) resumes
from the highest ``hpc_ckpt_N`` by itself. Under a plait strategy the save is a collective
(every rank writes its shard of a universal-checkpoint directory), and two things break:

* the handler runs between two Python bytecodes wherever each rank happens to be, so the ranks'
  save collectives pair with *other ranks' training collectives* (a hang, or on gloo a silent mix
  of buffers of the same size);
* every rank picks ``N`` itself by listing ``default_root_dir``: once rank 0 has created
  ``hpc_ckpt_N.ckpt``, a slower rank picks ``N+1`` and the ranks write two halves of two checkpoints.

:class:`SlurmRequeue` keeps Lightning's behaviour and fixes both: its handler only records the
signal; at the start of every training batch the ranks learn whether any of them was signalled
(one 4-byte all-reduce per step, only under SLURM auto-requeue, named ``slurm requeue check`` in
plait's flight log); if so they all save to the path rank 0 chose, and rank 0 then requeues exactly
as Lightning does. Training goes on until SLURM ends the job, as under Lightning's own handler.

The requeue then ends the job: SLURM sends every task SIGTERM and, ``KillWait`` seconds later,
SIGKILL. Lightning's SIGTERM handler also runs a collective (a broadcast) inside the handler; under
a sharded strategy that broadcast can pair with a training collective and leave the ranks stuck
until the SIGKILL. So, unless another handler (plait's ``PreemptionCheckpoint``) has replaced
Lightning's already, SIGTERM too only sets Lightning's own flag: Lightning's loop broadcasts it at
the next batch start and every rank stops there (``SIGTERMException``, exit code 0).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

from plait.kernels import collectives

CHECK_NAME = "slurm requeue check"


def requeue_job_id() -> str:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an array task, else ``SLURM_JOB_ID``.

    Raises:
        RuntimeError: neither is set, or the id is not a SLURM job id.
    """
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job_id):
        raise RuntimeError(f"cannot requeue: SLURM_JOB_ID={job_id!r} is not a SLURM job id (set by sbatch/srun).")
    return job_id


class SlurmRequeue:
    """Lightning's SLURM auto-requeue, with the save moved from the signal handler to a step boundary.

    Built by :meth:`install` (which returns ``None`` unless the Trainer runs under a
    ``SLURMEnvironment`` with ``auto_requeue``); the strategy then calls :meth:`at_batch_start` on
    every rank at the start of every training batch.

    Args:
        trainer: the Trainer being fitted.
        requeue_signal: the signal SLURM sends before the time limit.
    """

    def __init__(self, trainer: pl.Trainer, requeue_signal: int) -> None:
        self.trainer, self.requeue_signal = trainer, requeue_signal
        self.signalled_at: float | None = None  # wall clock of this rank's signal
        self.saved_path: str | None = None
        self.requeue_rc: int | None = None  # scontrol's exit code (rank 0)
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls, trainer: pl.Trainer) -> SlurmRequeue | None:
        """Replace Lightning's requeue-signal handler (registered by the time ``on_train_start`` runs)
        with one that only records the signal, and Lightning's own SIGTERM handler with one that
        only sets its flag; ``None`` when not on SLURM with auto-requeue."""
        environment = trainer._accelerator_connector.cluster_environment
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue \
                or environment.requeue_signal is None or threading.current_thread() is not threading.main_thread():
            return None
        handler = cls(trainer, environment.requeue_signal)
        handler._previous[environment.requeue_signal] = signal.signal(environment.requeue_signal, handler._on_signal)
        if isinstance(signal.getsignal(signal.SIGTERM), _HandlersCompose):  # Lightning's, not a plait callback's
            handler._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler._on_sigterm)
        return handler

    def uninstall(self) -> None:
        """Give the signals back to the handlers that were there before :meth:`install`."""
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.time()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Lightning's flag, broadcast from rank 0 at the next batch start: every rank stops there.
        self.trainer._signal_connector.received_sigterm = True

    def at_batch_start(self) -> bool:
        """On every rank, at the start of a batch: if any rank was signalled, save and requeue.

        Returns:
            Whether this call saved the requeue checkpoint.
        """
        trainer = self.trainer
        pending = self.signalled_at is not None and self.saved_path is None
        if not collectives.any_rank(pending, device=trainer.strategy.root_device, name=CHECK_NAME):
            return False
        for logger in trainer.loggers:  # as Lightning's handler: the metrics so far are kept
            logger.finalize("finished")
        connector = trainer._checkpoint_connector
        path = connector.hpc_save_path(trainer.default_root_dir) if trainer.is_global_zero else None
        path = trainer.strategy.broadcast(path)  # one N for every rank
        trainer.save_checkpoint(path)
        self.saved_path = path
        if trainer.is_global_zero:
            self.requeue_rc = _scontrol_requeue(requeue_job_id())
            print(f"plait: SLURM requeue signal: step {trainer.global_step} saved to {path}; "
                  f"scontrol requeue exited {self.requeue_rc}", file=sys.stderr, flush=True)
        return True


def _scontrol_requeue(job_id: str) -> int:
    """``scontrol requeue JOB`` (as Lightning runs it); its exit code."""
    try:
        return subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:  # Lightning retries through a shell, where scontrol may be a shell function
        return subprocess.call(f"scontrol requeue {job_id}", shell=True)


__all__ = ["SlurmRequeue", "requeue_job_id"]
