"""A Lightning progress bar that counts the optimizer steps the run will reach.

Lightning's own bar counts batches per epoch, so a run bounded by ``max_steps`` shows figures such
as "40/10" (batches of a long epoch against a step limit) and an epoch total of ``-2`` (from
``max_epochs=-1``). :class:`StepProgressBar` shows ``global_step / max_steps`` instead whenever
``max_steps`` is set, and keeps Lightning's behaviour otherwise.

On a terminal it is a live tqdm bar. When its stream is not a terminal (a log file, a pipe, a
captured subprocess) it draws no bar at all, so no carriage-return updates reach the log, and
prints a few plain lines instead (about ``plain_lines`` over the run, plus the last step).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def step_total(trainer: L.Trainer) -> int | None:
    """The optimizer step the run ends at: ``trainer.max_steps`` when set (> 0), else ``None``."""
    max_steps = getattr(trainer, "max_steps", None)
    return int(max_steps) if max_steps is not None and max_steps > 0 else None


class StepProgressBar(TQDMProgressBar):
    """Progress in optimizer steps towards ``max_steps``; plain lines instead of a bar off a terminal.

    Args:
        refresh_rate: update the live bar every this many steps (a terminal only).
        stream: where progress goes; ``None`` means ``sys.stdout`` (looked up when used).
        plain_lines: about how many plain lines a run prints when ``stream`` is not a terminal;
            ``0`` prints none.
    """

    def __init__(self, refresh_rate: int = 1, *, stream: IO[str] | None = None, plain_lines: int = 10) -> None:
        self._stream = stream
        self._tty = _isatty(self.stream)
        # refresh_rate 0 makes every tqdm bar Lightning builds a disabled one: nothing is drawn.
        super().__init__(refresh_rate=refresh_rate if self._tty else 0)
        self._plain_lines = max(0, plain_lines)
        self._last_printed = -1
        self._started = 0.0

    @property
    def stream(self) -> IO[str]:
        """The stream progress is written to."""
        return self._stream if self._stream is not None else sys.stdout

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_stream"] = None  # streams do not pickle; a spawned rank uses its own stdout
        return state

    def _tqdm(self, desc: str, *, position: int, leave: bool, smoothing: float | None = None) -> Tqdm:
        extra = {} if smoothing is None else {"smoothing": smoothing}
        return Tqdm(desc=desc, position=position, disable=self.is_disabled, leave=leave, dynamic_ncols=True,
                    file=self.stream, bar_format=self.BAR_FORMAT, **extra)

    def init_sanity_tqdm(self) -> Tqdm:
        """The sanity-check bar, on :attr:`stream`."""
        return self._tqdm(self.sanity_check_description, position=2 * self.process_position, leave=False)

    def init_train_tqdm(self) -> Tqdm:
        """The training bar, on :attr:`stream`."""
        return self._tqdm(self.train_description, position=2 * self.process_position, leave=True, smoothing=0)

    def init_validation_tqdm(self) -> Tqdm:
        """The validation bar, on :attr:`stream`, under the training bar while fitting."""
        has_main_bar = self.trainer.state.fn != "validate"
        return self._tqdm(self.validation_description, position=2 * self.process_position + has_main_bar,
                          leave=not has_main_bar)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Open the bar; with ``max_steps`` its total is that step and it starts at the current step."""
        super().on_train_start(trainer, pl_module)
        self._started = time.perf_counter()
        self._last_printed = trainer.global_step
        total = step_total(trainer)
        if total is not None:
            bar = self.train_progress_bar
            bar.reset(total=total)
            bar.initial = bar.n = min(trainer.global_step, total)
            bar.set_description("Steps")
            if self._enabled and not self._tty and self._plain_lines and trainer.is_global_zero:
                print(f"training: step {trainer.global_step}/{total}", file=self.stream, flush=True)

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        """Per-epoch reset only without ``max_steps``; with it the bar runs across epochs."""
        if step_total(trainer) is None:
            super().on_train_epoch_start(trainer, *args)
        else:
            self.train_progress_bar.set_description(f"Steps (epoch {trainer.current_epoch})")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Advance to ``trainer.global_step`` (the bar) or print a plain line now and then (no terminal)."""
        total = step_total(trainer)
        if total is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        else:
            step = min(trainer.global_step, total)
            bar = self.train_progress_bar
            if self._should_update(step, total) and not bar.disable:
                bar.n = step
                bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar
        if not self._tty:
            self._plain_line(trainer, pl_module, total)

    def _plain_line(self, trainer: L.Trainer, pl_module: L.LightningModule, total: int | None) -> None:
        if not (self._enabled and self._plain_lines and trainer.is_global_zero):
            return
        step = trainer.global_step
        end = total if total is not None else None
        every = max(1, (end or 100) // self._plain_lines)
        if step == self._last_printed or not (step % every == 0 or step == end):
            return
        self._last_printed = step
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print(f"training: step {step}{'' if end is None else f'/{end}'} "
              f"({time.perf_counter() - self._started:.0f} s) {shown}".rstrip(), file=self.stream, flush=True)
