"""Preemption: SIGTERM to a plait Lightning job saves a checkpoint on every rank and ends the job cleanly.

SLURM, Kubernetes and spot instances send SIGTERM some seconds before SIGKILL. Lightning 2.6
already does most of what is needed, and this builds on it rather than beside it:

* its signal connector catches SIGTERM, passes it on to the ranks its launcher started and sets
  ``trainer.received_sigterm``; its training loop then stops every rank at the same point with a
  :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` (a ``SystemExit``: exit code 0);
* its :class:`~lightning.pytorch.callbacks.OnExceptionCheckpoint` saves a checkpoint from
  ``on_exception``, and a Trainer that has one resumes from the newest such checkpoint by itself
  (``fit()`` without ``ckpt_path`` means ``ckpt_path="last"``).

:class:`PreemptionCheckpoint` is that callback with what a sharded plait job still lacks:

* **any rank's SIGTERM stops every rank.** Lightning only acts on rank 0's flag (broadcast at each
  batch start); a preempted node that is not rank 0 would stop alone and leave the others in a
  collective. Here each rank's flag is OR-ed over the ranks after every ``check_every_n_steps``
  batches (one 4-byte all-reduce, named ``preemption check`` in plait's flight log), so all ranks
  stop together after the step they are in.
* **no collective inside the signal handler.** Lightning's handler broadcasts from inside the
  handler, which runs between two Python bytecodes wherever each rank happens to be; with async
  collectives in flight (ZeRO-3 prefetch) the ranks can pair that broadcast with different
  collectives. This callback's handler only sets the flag and passes the signal on.
* **only preemption saves, never over another checkpoint.** A hang or a crash leaves the ranks in
  no state to run a collective save, so only a ``SIGTERMException`` saves. The checkpoint goes to
  the Trainer's checkpoint directory (``ModelCheckpoint``'s, else ``default_root_dir/checkpoints``)
  as ``preempted.ckpt`` (a plait universal-checkpoint directory under a plait strategy); an
  existing path of that name is never overwritten (``preempted-v1.ckpt`` and so on instead).
* **every rank exits 0.** Rank 0 waits (up to ``grace_s``) for the ranks it launched to finish
  their own shutdown before Lightning's exception path would stop them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from plait.kernels import collectives
from plait.lightning.checkpoint import is_directory_checkpoint

NAME = "preempted"


class PreemptionCheckpoint(OnExceptionCheckpoint):
    """Save a checkpoint when the job is preempted (SIGTERM on any rank) and exit cleanly.

    Example::

        trainer = L.Trainer(strategy=PlaitStrategy(ZeroConfig(stage=3)), devices=2,
                            callbacks=[PreemptionCheckpoint("ckpts")])
        trainer.fit(model)  # restarted after a preemption, this resumes from ckpts/preempted.ckpt

    Args:
        dirpath: where to save. ``None``: the Trainer's checkpoint directory, found when saving.
            Give it explicitly for a restarted ``fit()`` to find the checkpoint by itself (the
            directory is needed before the Trainer is set up).
        filename: the checkpoint's name, without ``.ckpt``.
        check_every_n_steps: how often the ranks agree on whether one of them was signalled
            (each check is one tiny all-reduce; a preempted job then runs up to this many more steps).
        grace_s: how long rank 0 waits for the ranks it launched to exit after the save.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str = NAME, *,
                 check_every_n_steps: int = 1, grace_s: float = 30.0) -> None:
        if not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise ValueError(f"PreemptionCheckpoint(check_every_n_steps={check_every_n_steps!r}) must be an int >= 1.")
        super().__init__(os.fspath(dirpath) if dirpath is not None else "", filename)
        self.check_every_n_steps, self.grace_s = check_every_n_steps, grace_s
        self.signalled_at: float | None = None  # wall clock of this rank's SIGTERM
        self.saved_path: str | None = None
        self.save_seconds: float | None = None
        self.saved_at: float | None = None  # wall clock when this rank's part of the save returned
        self._trainer: pl.Trainer | None = None
        self._previous: Any = None

    # -- where --------------------------------------------------------------------------------

    @property
    def ckpt_path(self) -> str:
        """The checkpoint this callback saved, else the newest one of its name in ``dirpath``
        (what ``fit(ckpt_path="last")`` resumes from; a plait directory whose save never committed,
        cut short by SIGKILL, is passed over), else where it would save first; ``""``
        before a save without ``dirpath`` (so Lightning never takes a file of the working
        directory for it)."""
        if self.saved_path is not None:
            return self.saved_path
        if not self.dirpath:
            return ""
        found = [p for p in _own_paths(self.dirpath, self.filename) if os.path.exists(p) and not _unfinished(p)]
        if found:
            return max(found, key=os.path.getmtime)
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def checkpoint_dir(self, trainer: pl.Trainer) -> str:
        """``dirpath``, else the Trainer's checkpoint directory."""
        if self.dirpath:
            return os.fspath(self.dirpath)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return os.fspath(callback.dirpath)
        return os.path.join(trainer.default_root_dir, "checkpoints")

    # -- the signal ---------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Replace Lightning's SIGTERM handler (registered by now) with one that runs no collective."""
        self._trainer = trainer
        if threading.current_thread() is threading.main_thread() and sys.platform != "win32":
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        trainer = self._trainer
        if self.signalled_at is None:
            self.signalled_at = time.time()
            launcher = trainer.strategy.launcher if trainer is not None else None
            if launcher is not None:
                launcher.kill(signum)  # as Lightning's handler does: the ranks it started hear it too
        if trainer is not None:
            # Lightning's own flag: its loop raises SIGTERMException where it checks it.
            trainer._signal_connector.received_sigterm = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Every ``check_every_n_steps`` batches, set every rank's flag if any rank was signalled."""
        if trainer.world_size < 2 or trainer.global_step % self.check_every_n_steps:
            return
        if collectives.any_rank(bool(trainer.received_sigterm), device=trainer.strategy.root_device):
            trainer._signal_connector.received_sigterm = True

    # -- the save -----------------------------------------------------------------------------

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """On a preemption (and nothing else): save, then let the launched ranks finish first."""
        if not isinstance(exception, SIGTERMException):
            return
        started = time.time()
        directory = self.checkpoint_dir(trainer)
        path = trainer.strategy.broadcast(_free_path(directory, self.filename) if trainer.is_global_zero else None)
        trainer.save_checkpoint(path)
        self.saved_at = time.time()
        self.saved_path, self.save_seconds = path, self.saved_at - started
        if trainer.is_global_zero:
            since = f", {started - self.signalled_at:.1f} s after SIGTERM" if self.signalled_at else ""
            print(f"plait: preempted at step {trainer.global_step}: checkpoint saved to {path} in "
                  f"{self.save_seconds:.1f} s{since}", file=sys.stderr, flush=True)
        _wait_for_launched_ranks(trainer.strategy.launcher, self.grace_s)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Give SIGTERM back to Lightning's handler."""
        self._restore_handler()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Keep the checkpoint (Lightning's ``OnExceptionCheckpoint`` deletes its own here)."""
        self._restore_handler()

    def _restore_handler(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _own_paths(directory: str, filename: str) -> list[str]:
    """This callback's checkpoint names in ``directory``: ``NAME.ckpt``, ``NAME-v1.ckpt``, ..."""
    if not directory or not os.path.isdir(directory):
        return []
    stem, out = filename, []
    for entry in os.listdir(directory):
        if entry == f"{stem}.ckpt" or (entry.startswith(f"{stem}-v") and entry.endswith(".ckpt")
                                       and entry[len(stem) + 2:-5].isdigit()):
            out.append(os.path.join(directory, entry))
    return out


def _unfinished(path: str) -> bool:
    """Whether ``path`` is a universal-checkpoint directory whose save never committed: it holds
    only the hidden in-progress (``.tmp-*``) directory of a save that was killed."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return any(name.startswith(".tmp-") for name in names) and not is_directory_checkpoint(path)


def _free_path(directory: str, filename: str) -> str:
    """``directory/filename.ckpt``, or the first ``-vN`` version of it that does not exist yet."""
    os.makedirs(directory, exist_ok=True)
    path, version = os.path.join(directory, f"{filename}.ckpt"), 0
    while os.path.lexists(path):
        version += 1
        path = os.path.join(directory, f"{filename}-v{version}.ckpt")
    return path


def _wait_for_launched_ranks(launcher: Any, grace_s: float) -> None:
    """On the rank that launched others: wait up to ``grace_s`` for them to exit by themselves."""
    procs: list[subprocess.Popen] = list(getattr(launcher, "procs", []) or [])
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


__all__ = ["PreemptionCheckpoint"]
