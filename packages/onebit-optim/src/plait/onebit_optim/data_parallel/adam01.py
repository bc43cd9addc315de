"""0/1 Adam (Lu et al., arXiv 2202.06009): adaptive variance freezing and 1-bit local steps.

Adam without bias correction (as 0/1 Adam defines it): ``p <- p - lr (m / (sqrt(v) + eps) + wd p)``.
There is no full-precision warm-up; the schedule has two phases.

**Variance phase** (steps ``1..var_freeze_step``). The variance is updated only on *variance
steps*, which all-reduce the gradient in full precision; every other step exchanges the gradient
in 1 bit (worker and server error feedback) and updates only the momentum. Variance steps start
every step and their interval doubles after every ``var_update_scaler`` of them, so they become
rare as the variance settles.

**Local-step phase** (after ``var_freeze_step``). The variance is frozen. Each rank steps on its
own gradient; every ``local_step_interval`` steps the ranks synchronise: the parameter change
since the last synchronisation is exchanged in 1 bit, the parameters become the last
synchronised ones plus the averaged change, and the momentum becomes the averaged accumulated
momentum ``-u / sum(lr)`` with ``u = change x denom`` (the frozen denominator ``sqrt(v) + eps``).
The interval doubles every ``local_step_scaler`` steps, up to ``local_step_clipper``. The error
buffers are zeroed when this phase starts: they held gradient error, and now carry the error of
the exchanged parameter change.

**Variance floor.** Wherever the variance divides the momentum it is at least
``config.variance_floor`` of its tensor's mean (:mod:`plait.onebit_optim.rules.variance_floor`): in the
variance phase in the denominator only, and raised in place when the variance freezes. Elements
the variance steps never or rarely saw (unseen embedding rows) would otherwise step by
``|m| / eps`` and diverge, even at W=1. Where no element is below it, this is the published
algorithm bit for bit.

Differences from DeepSpeed's implementation, on purpose:

* The synchronisation restarts from a stored copy of the last synchronised parameters
  (``anchor``) instead of subtracting the accumulated change again, so replicas are bitwise
  equal after every synchronisation (subtracting leaves each rank its own rounding). It costs
  the same memory: the anchor replaces DeepSpeed's momentum accumulator.
* DeepSpeed exchanges ``u`` and divides the result by the denominator. The denominator is equal
  on every rank, so with exact communication both give the same average; but 1 bit gives every
  element of a chunk the same magnitude, and where the frozen variance is ~0 (embedding rows of
  tokens the variance phase never saw, an attention key bias, whose gradient is ~0) the
  denominator is ~eps, so that error divided by it moved parameters by up to ``1/eps`` times it
  and the local steps diverged to inf/NaN. Exchanging the change keeps the error on the scale of
  the changes; in the momentum it is multiplied by the denominator, which is small exactly there.
  The price: where 1-bit gradient steps (``var_update_scaler`` below the run's length) left the
  momentum of such elements noisy, their changes are the largest of their tensor and set its 1-bit
  scale, so the first synchronisation moves the whole tensor by about their size (README, "Why
  this setting").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from plait.onebit_optim.config import ZeroOneAdamConfig
from plait.onebit_optim.data_parallel.base import CompressedOptimizer, name_of, pick_config, run_closure
from plait.onebit_optim.rules.adam01 import resynchronise_, zero_one_update_
from plait.onebit_optim.rules.variance_floor import floor_variance_


class ZeroOneAdam(CompressedOptimizer):
    """0/1 Adam for a model replicated on every rank (do not wrap it in DDP).

    Args:
        params: parameters or param groups.
        lr, betas, eps: as Adam's.
        weight_decay: decoupled weight decay added to the update.
        config: the schedule (:class:`ZeroOneAdamConfig`).
        process_group: the data-parallel group.
        momentum_masks: ``{parameter: 0/1 mask}`` applied to everything exchanged in 1 bit.
        onebit_config: another name for ``config``, as :class:`~plait.onebit_optim.OnebitAdam`'s
            (for ``zero_shard`` and the framework strategies, which have a ``config`` of their own).

    Raises:
        ValueError: invalid hyperparameters, config or masks.
    """

    CONFIG = ZeroOneAdamConfig

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, config: ZeroOneAdamConfig | None = None,
                 process_group: Any | None = None, momentum_masks: dict[torch.Tensor, torch.Tensor] | None = None,
                 onebit_config: ZeroOneAdamConfig | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, config=pick_config(name_of(self), config, onebit_config),
                         process_group=process_group,
                         momentum_masks=momentum_masks)
        self.var_interval, self.var_counter = 1, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.lr_sums = [0.0] * len(self.param_groups)

    @property
    def frozen(self) -> bool:
        """Whether the local-step phase has started (the last step was past ``var_freeze_step``)."""
        return self.step_count > self.config.var_freeze_step

    def onebit_state(self) -> dict[str, Any]:
        """The step counter and the two schedules' counters."""
        return {"step_count": self.step_count, "var_interval": self.var_interval, "var_counter": self.var_counter,
                "local_step_interval": self.local_step_interval, "local_step_counter": self.local_step_counter,
                "lr_sums": list(self.lr_sums)}

    def load_onebit_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`onebit_state`."""
        self.step_count = state["step_count"]
        self.var_interval, self.var_counter = state["var_interval"], state["var_counter"]
        self.local_step_interval = state["local_step_interval"]
        self.local_step_counter = state["local_step_counter"]
        self.lr_sums = list(state["lr_sums"])

    def is_variance_step(self, step: int) -> bool:
        """Whether step ``step`` (1-based, in the variance phase) all-reduces and updates the variance."""
        return step % self.var_interval == 0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of the current phase.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = run_closure(closure)
        self.step_count += 1
        if not self.frozen:
            self._variance_phase_step()
        else:
            if self.step_count == self.config.var_freeze_step + 1:
                self._enter_local_phase()
            for index, group in enumerate(self.param_groups):
                self._local_step(index, group)
            self.local_step_counter += 1
            if self.local_step_counter == self.config.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.config.local_step_clipper, self.local_step_interval * 2)
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _variance_phase_step(self) -> None:
        variance_step = self.is_variance_step(self.step_count)
        if variance_step:
            self.average_gradients_()
        for index, group in enumerate(self.param_groups):
            params = self.params_with_grad(group)
            if not params:
                continue
            if not variance_step:
                self.exchange_momentum_(index, [p.grad for p in params], params)
            for p in params:
                state = self._state(p)
                state["step"] += 1
                zero_one_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], group, variance=variance_step,
                                 variance_floor=self.config.variance_floor)
            self.check_finite(index, params)
        if variance_step:
            self.var_counter += 1
            if self.var_counter == self.config.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2

    def _enter_local_phase(self) -> None:
        for index, group in enumerate(self.param_groups):
            self.exchange(index).reset_errors()
            for p in group["params"]:
                state = self._state(p)
                state["anchor"] = p.detach().clone()
                # Frozen from here on: floored once, in place, so local steps and
                # resynchronisations divide by the same floored denominator.
                floor_variance_(state["exp_avg_sq"], self.config.variance_floor)

    def _local_step(self, index: int, group: dict[str, Any]) -> None:
        params = self.params_with_grad(group)
        if not params:
            return
        for p in params:
            state = self._state(p)
            state["step"] += 1
            zero_one_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], group, variance=False)
        self.lr_sums[index] += group["lr"]
        if self.step_count % self.local_step_interval == 0:
            self._synchronise(index, group, params)

    def _synchronise(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        # The change, not u = change x denom, goes through the 1-bit exchange: the 1-bit error of
        # u divided by a denominator near eps would move a parameter by up to 1/eps times it
        # (module docstring). Here the error stays on the scale of the changes.
        states = [self.state[p] for p in params]
        changes = [p - s["anchor"] for p, s in zip(params, states)]
        self.exchange_momentum_(index, changes, params)
        for p, state, change in zip(params, states, changes):
            resynchronise_(p, state["exp_avg"], state["exp_avg_sq"], state["anchor"], change, group["eps"],
                           self.lr_sums[index])
        self.lr_sums[index] = 0.0
        self.check_finite(index, params)  # replicas again: every rank raises together
