"""When to freeze the variance: ``freeze_step="auto"`` and the early-freeze warning.

1-bit Adam and 1-bit LAMB freeze Adam's variance after a warm-up; DeepSpeed's papers freeze it
once it has stabilised, and a variance frozen before that is what makes a short warm-up train
badly or diverge. This module measures "stabilised" and acts on it.

**The statistic.** For every tensor ``i`` of the optimizer, after every warm-up step ``t``:
``s_i(t) = sum(v_i) / (1 - beta2^t)``, the sum of its bias-corrected variance (what Adam divides
by; summed in float64). Bias-corrected because the raw ``v`` grows like ``1 - beta2^t`` for the
first ~``1 / (1 - beta2)`` steps whatever the gradients do; the corrected one moves only when
the gradients' second moment does (LAMB's update is defined on the raw ``v``, but its trust
ratio cancels a tensor's common scale, so the corrected one is the right measure there too).
The relative change over a window of ``k = min(window, t - 1)`` steps is

``change(t) = max_i |s_i(t) - s_i(t - k)| / s_i(t)``  (over tensors with ``s_i(t) > 0``),

the largest over tensors, so a small tensor that is still moving is not hidden by a large one
that is not. The variance has *settled* at step ``t`` when ``change(t) <= threshold``.

**``freeze_step="auto"``**: the warm-up ends after the first step ``t >= min_step`` at which the
variance has settled, or after ``max_step``. **A fixed ``freeze_step``**: the statistic is
taken over the last ``window + 1`` warm-up steps only (no cost before), and if the variance has
not settled at the freeze, a WARNING names the step and the measured change, once.

**Communication: none in plain data parallel.** The warm-up averages the gradients before the
update, so every rank holds the same variance bit for bit, computes the same sums in the same
order, and takes the same decision without exchanging anything (``test_onebit_optim_settle.py``
counts 0 extra bytes and checks the decision on every rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from plait.onebit_optim.config import SettleConfig

logger = logging.getLogger("plait.onebit_optim")



def variance_sums(params_and_states: list[tuple[torch.Tensor, dict[str, Any], float]]) -> list[float]:
    """Every tensor's summed bias-corrected variance ``sum(v) / (1 - beta2^step)`` (float64).

    Args:
        params_and_states: ``(parameter, its optimizer state, its group's beta2)``, in a fixed
            order; the state holds ``exp_avg_sq`` and ``step`` (a tensor or an int).

    Returns:
        One sum per tensor, in that order (a single host synchronisation).
    """
    sums = []
    for _, state, beta2 in params_and_states:
        step = float(state["step"])
        sums.append(state["exp_avg_sq"].sum(dtype=torch.float64) / (1 - beta2 ** step))
    return torch.stack(sums).tolist() if sums else []


def relative_change(new: list[float], old: list[float]) -> float:
    """``max_i |new_i - old_i| / new_i`` over the tensors with ``new_i > 0`` (0 when there are none)."""
    changes = [abs(n - o) / n for n, o in zip(new, old) if n > 0]
    return max(changes, default=0.0)


class FreezePoint:
    """The step after which an optimizer's variance freezes: fixed, or decided when it has settled.

    Args:
        owner: the optimizer's name (for messages).
        freeze_step: the config's ``freeze_step`` (an int, or ``"auto"``).
        settle: how settling is measured.
    """

    def __init__(self, owner: str, freeze_step: int | str, settle: SettleConfig) -> None:
        self.owner = owner
        self.auto = freeze_step == "auto"
        self.settle = settle
        self.step: int | None = None if self.auto else int(freeze_step)
        self.history: list[list[float]] = []  # the last window + 1 observations
        self.last_change: float | None = None
        self.warned = False

    def frozen_after(self, step_count: int) -> bool:
        """Whether step ``step_count`` is past the freeze (a compressed step)."""
        return self.step is not None and step_count > self.step

    def _watching(self, step_count: int) -> bool:
        return self.auto or step_count >= self.step - self.settle.window

    def after_warmup_step(self, step_count: int, sums: Callable[[], list[float]]) -> None:
        """Observe the variance after warm-up step ``step_count``; decide or warn at the freeze.

        Args:
            step_count: the warm-up step just taken (1-based).
            sums: returns :func:`variance_sums` of the optimizer (called only when needed).
        """
        if not self._watching(step_count):
            return
        self.history.append(sums())
        del self.history[:-(self.settle.window + 1)]
        self.last_change = relative_change(self.history[-1], self.history[0]) if len(self.history) > 1 else None
        settled = self.last_change is not None and self.last_change <= self.settle.threshold
        if self.auto:
            if (settled and step_count >= self.settle.min_step) or step_count >= self.settle.max_step:
                self.step = step_count
                logger.info("%s: the variance freezes after step %d (relative change %s over %d steps, threshold %g).",
                            self.owner, step_count, _describe(self.last_change), len(self.history) - 1,
                            self.settle.threshold)
        elif step_count == self.step and not settled and not self.warned:
            self.warned = True
            logger.warning(
                "%s: freeze_step=%d freezes the variance before it has settled: its relative change over the last "
                "%d step(s) is %s (SettleConfig.threshold=%g). A variance frozen too early can make 1-bit training "
                "end far above Adam's loss or diverge; freeze later, or pass freeze_step='auto'.",
                self.owner, step_count, len(self.history) - 1, _describe(self.last_change), self.settle.threshold)

    def state_dict(self) -> dict[str, Any]:
        """The decision and the observations (so a resumed warm-up decides as the original would)."""
        return {"step": self.step, "history": [list(h) for h in self.history], "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a state without it, from before ``"auto"`` existed, keeps the config's)."""
        if self.auto:
            self.step = state["step"]
        self.history = [list(h) for h in state["history"]]
        self.warned = bool(state["warned"])



def _describe(change: float | None) -> str:
    return "not measurable (one step)" if change is None else f"{change:.3g}"
