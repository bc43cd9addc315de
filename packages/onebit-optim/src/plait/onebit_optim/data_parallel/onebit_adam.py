"""1-bit Adam (Tang et al., arXiv 2102.02888): Adam whose momentum crosses the network in 1 bit.

Steps ``1..freeze_step`` (warm-up) are exactly ``torch.optim.AdamW`` on gradients averaged with
DDP's arithmetic: the same torch kernel, so parameters equal DDP + AdamW bit for bit (and DDP +
Adam when ``weight_decay=0``). After warm-up the variance ``v`` is frozen, because Adam's
variance settles early and is what makes the momentum impossible to compress well while it
moves. Each later step:

1. ``m <- beta1 m + (1 - beta1) g_local`` (every rank starts from the same synchronised ``m``);
2. ``m <- compressed average of m`` (1 bit per element plus scales, worker and server error
   feedback: :func:`plait.kernels.collectives.compressed_allreduce`), then the momentum masks;
3. the AdamW update with the frozen variance: ``p <- p (1 - lr wd)``, then
   ``p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^freeze_step) + eps)``.

Bias correction continues the warm-up's: the variance's correction is frozen with the variance.
When it freezes, the variance is raised to its floor (``config.variance_floor`` of each tensor's
mean, :mod:`plait.onebit_optim.rules.variance_floor`), so elements the warm-up never saw cannot step
by ``|m| / eps``; where none is below it this is the published algorithm bit for bit.
Every rank ends the step with the same ``m`` and therefore the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from plait.onebit_optim.config import OnebitAdamConfig
from plait.onebit_optim.data_parallel.base import (
    CompressedOptimizer,
    FreezePointOwner,
    name_of,
    pick_config,
    run_closure,
)
from plait.onebit_optim.rules.adam import adam_state, adamw_step, frozen_variance_update
from plait.onebit_optim.rules.settle import FreezePoint, variance_sums
from plait.onebit_optim.rules.variance_floor import floor_variance_


class OnebitAdam(FreezePointOwner, CompressedOptimizer):
    """1-bit Adam for a model replicated on every rank (do not wrap it in DDP).

    Args:
        params: parameters or param groups.
        lr: learning rate (per group; schedulers work as usual).
        betas: ``(beta1, beta2)``.
        eps: added to the denominator.
        weight_decay: decoupled (AdamW-style) weight decay.
        config: the 1-bit settings (:class:`OnebitAdamConfig`).
        process_group: the data-parallel group (``None``: the default group).
        momentum_masks: ``{parameter: 0/1 mask}`` applied to the exchanged momentum.
        onebit_config: another name for ``config``, for calls through functions that take a
            ``config`` of their own (``zero_shard(model, OnebitAdam, ZeroConfig(stage=2),
            onebit_config=...)``, Lightning's plait strategies).

    Raises:
        ValueError: invalid hyperparameters, config or masks (naming the field and the fix).
    """

    CONFIG = OnebitAdamConfig

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, config: OnebitAdamConfig | None = None,
                 process_group: Any | None = None, momentum_masks: dict[torch.Tensor, torch.Tensor] | None = None,
                 onebit_config: OnebitAdamConfig | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, config=pick_config(name_of(self), config, onebit_config),
                         process_group=process_group,
                         momentum_masks=momentum_masks)
        self.freeze_point = FreezePoint(name_of(self), self.config.freeze_step, self.config.settle)

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (the last step taken was past the freeze step)."""
        return self.freeze_point.frozen_after(self.step_count)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step: warm-up AdamW, or the 1-bit momentum exchange and frozen-variance update.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = run_closure(closure)
        warmup = not self.freeze_point.frozen_after(self.step_count + 1)
        if warmup:
            self.average_gradients_()
        if not self.grad_control.prepare(self.all_params_with_grad(), averaged=warmup):
            return loss  # an overflow on some rank: every rank skips, nothing moves
        self.step_count += 1
        if warmup:
            for index, group in enumerate(self.param_groups):
                self._adamw_step(group)
                self.check_finite(index, self.params_with_grad(group))
            self.freeze_point.after_warmup_step(self.step_count, self._variance_sums)
        else:
            if self.step_count == self.freeze_point.step + 1:
                self._freeze_variance()
            for index, group in enumerate(self.param_groups):
                self._compressed_step(index, group)
                self.check_finite(index, self.params_with_grad(group))
        return loss

    def _freeze_variance(self) -> None:
        """Raise every frozen variance to its floor (once, at the first compressed step)."""
        for group in self.param_groups:
            for p in self.params_with_grad(group):
                floor_variance_(self._state(p)["exp_avg_sq"], self.config.variance_floor)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        return adam_state(self.state[p], p)

    def _variance_sums(self) -> list[float]:
        return variance_sums([(p, self._state(p), group["betas"][1])
                              for group in self.param_groups for p in self.params_with_grad(group)])

    def _adamw_step(self, group: dict[str, Any]) -> None:
        adamw_step(self.state, self.params_with_grad(group), group)

    def _compressed_step(self, index: int, group: dict[str, Any]) -> None:
        params = self.params_with_grad(group)
        if not params:
            return
        beta1 = group["betas"][0]
        states = [self._state(p) for p in params]
        momenta = [s["exp_avg"] for s in states]
        for p, m in zip(params, momenta):
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        self.exchange_momentum_(index, momenta, params)
        for p, state in zip(params, states):
            frozen_variance_update(p, state, group, self.freeze_point.step)
