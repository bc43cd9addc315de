"""The rank the others wait on, as Lightning metrics: a slow node found from the logs, without a profiler.

Every collective plait issues is in each rank's flight log with its entry time, and
:func:`plait.kernels.collectives.wait_summary` turns those logs into "rank R is the one the others
wait on most". :class:`StragglerMonitor` computes that summary every ``every_n_steps`` training
steps and logs it through the LightningModule's ``log_dict``, so it lands in whatever logger the
Trainer has (CSV, TensorBoard, W&B) and, with ``prog_bar=True``, in the progress bar:

* ``plait/slowest_rank``: the rank the others waited on most (-1 when nobody waited);
* ``plait/waited_on_s``: how long the others waited for it, over the collectives compared;
* ``plait/wait_s_rank<R>``: each rank's own time blocked in collectives.

The summary covers the collectives still in the flight log (``PLAIT_COLLECTIVE_HISTORY`` per
rank), so it describes the recent past, not the whole run.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from plait.kernels import collectives

PREFIX = "plait/"


def summary_metrics(summary: collectives.WaitSummary) -> dict[str, float]:
    """The metrics logged for ``summary`` (the names of the module docstring).

    Args:
        summary: from :func:`plait.kernels.collectives.wait_summary`.

    Returns:
        metric name -> value.
    """
    slowest = summary.slowest_rank
    metrics = {
        f"{PREFIX}slowest_rank": float(-1 if slowest is None else slowest),
        f"{PREFIX}waited_on_s": 0.0 if slowest is None else summary.waited_on_s[summary.ranks.index(slowest)],
    }
    metrics.update({f"{PREFIX}wait_s_rank{rank}": wait for rank, wait in zip(summary.ranks, summary.wait_s)})
    return metrics


class StragglerMonitor(Callback):
    """Log which rank the others wait on, every ``every_n_steps`` steps.

    Example::

        trainer = L.Trainer(strategy=PlaitStrategy(ZeroConfig(stage=3)), devices=8,
                            callbacks=[StragglerMonitor(every_n_steps=100)])

    Args:
        every_n_steps: how often (in optimizer steps) to compute and log the summary; each time is
            one small metadata all-gather over the ranks.
        prog_bar: also show ``plait/slowest_rank`` in the progress bar.

    Raises:
        ValueError: ``every_n_steps`` is not an int >= 1.
    """

    def __init__(self, every_n_steps: int = 50, *, prog_bar: bool = False) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"StragglerMonitor(every_n_steps={every_n_steps!r}) must be an int >= 1.")
        self.every_n_steps, self.prog_bar = every_n_steps, prog_bar
        self.last: collectives.WaitSummary | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Every ``every_n_steps`` steps (on every rank: the summary is a collective), log it."""
        if trainer.world_size < 2 or trainer.global_step == 0 or trainer.global_step % self.every_n_steps:
            return
        self.last = collectives.wait_summary()
        metrics = summary_metrics(self.last)
        slowest = metrics.pop(f"{PREFIX}slowest_rank")
        # The same values on every rank (the summary is gathered), so no sync_dist reduction.
        pl_module.log(f"{PREFIX}slowest_rank", slowest, on_step=True, on_epoch=False, prog_bar=self.prog_bar,
                      rank_zero_only=True)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)


__all__ = ["StragglerMonitor", "summary_metrics"]
