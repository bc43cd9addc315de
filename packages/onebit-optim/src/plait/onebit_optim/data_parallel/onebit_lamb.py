"""LAMB, and 1-bit LAMB (Li et al., arXiv 2104.06069): LAMB whose momentum crosses the network in 1 bit.

LAMB (without bias correction, as 1-bit LAMB defines it) scales each tensor's Adam-style update
``u = m / (sqrt(v) + eps) + wd p`` by a trust ratio ``clamp(||p|| / ||u||, min_coeff, max_coeff)``.
:class:`Lamb` is that optimizer, plain (use it with DDP); it is 1-bit LAMB's warm-up and the
reference the tests compare against.

:class:`OnebitLamb` runs :class:`Lamb`'s update for ``freeze_step`` steps on DDP-averaged
gradients while keeping an exponential moving average of each tensor's trust ratio (the frozen
coefficient). After warm-up the variance ``v`` freezes; each step exchanges the group's momentum in
1 bit (one flat buffer, worker and server error feedback), reconstructs the averaged gradient
from the momentum change to keep a *fresh* variance estimate, and scales the frozen coefficient
by how far the fresh variance moved: ``factor = max(denominator / fresh denominator)``, mixed
towards 1 by the share of the update that is weight decay, clamped to
``[factor_min, factor_max]`` and to ``+-factor_threshold`` of the previous step's factor.

When the variance freezes it is raised to its floor (``config.variance_floor`` of each tensor's
mean, :mod:`plait.onebit_optim.rules.variance_floor`), as 1-bit Adam's. The trust ratio bounds the
norm of each tensor's step, so an element with a frozen variance near 0 cannot explode the
loss as in 1-bit Adam; it takes most of its tensor's step instead (``m / eps`` dwarfs the rest),
and the loss drifts up (on an LM with mostly unseen embedding rows, 7.9 to 10-15 within 12
steps). Where no element is below the floor, this is the published algorithm bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from plait.onebit_optim.config import OnebitLambConfig
from plait.onebit_optim.data_parallel.base import (
    CompressedOptimizer,
    FreezePointOwner,
    check_hyperparameters,
    name_of,
    pick_config,
    run_closure,
)
from plait.onebit_optim.rules.lamb import exact_norm, frozen_lamb_direction, lamb_state, lamb_update_
from plait.onebit_optim.rules.settle import FreezePoint, variance_sums
from plait.onebit_optim.rules.variance_floor import floor_variance_


class Lamb(torch.optim.Optimizer):
    """Plain LAMB (1-bit LAMB's warm-up; use it with DDP). Arguments as :class:`OnebitLamb`'s.

    Raises:
        ValueError: invalid hyperparameters.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, max_coeff: float = 10.0, min_coeff: float = 0.01):
        check_hyperparameters("Lamb", lr, betas, eps, weight_decay)
        OnebitLambConfig(max_coeff=max_coeff, min_coeff=min_coeff)  # the same validation
        self.max_coeff, self.min_coeff = max_coeff, min_coeff
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step of every parameter with a gradient.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    lamb_update_(p, self.state[p], group, self.max_coeff, self.min_coeff)
        return loss


class OnebitLamb(FreezePointOwner, CompressedOptimizer):
    """1-bit LAMB for a model replicated on every rank (do not wrap it in DDP).

    Args:
        params: parameters or param groups.
        lr, betas, eps: as LAMB's.
        weight_decay: added to the update before the trust ratio (LAMB's decoupled decay).
        config: the 1-bit settings (:class:`OnebitLambConfig`).
        process_group: the data-parallel group.
        momentum_masks: ``{parameter: 0/1 mask}`` applied to the exchanged momentum.
        onebit_config: another name for ``config``, as :class:`~plait.onebit_optim.OnebitAdam`'s
            (for ``zero_shard`` and the framework strategies, which have a ``config`` of their own).

    Raises:
        ValueError: invalid hyperparameters, config or masks.
    """

    CONFIG = OnebitLambConfig

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, config: OnebitLambConfig | None = None,
                 process_group: Any | None = None, momentum_masks: dict[torch.Tensor, torch.Tensor] | None = None,
                 onebit_config: OnebitLambConfig | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, config=pick_config(name_of(self), config, onebit_config),
                         process_group=process_group,
                         momentum_masks=momentum_masks)
        self.freeze_point = FreezePoint(name_of(self), self.config.freeze_step, self.config.settle)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step: LAMB on averaged gradients during warm-up, then the 1-bit exchange.

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
            for group in self.param_groups:
                for p in self.params_with_grad(group):
                    self._warmup_update(p, group)
            self.freeze_point.after_warmup_step(self.step_count, lambda: variance_sums(
                [(p, self.state[p], group["betas"][1]) for group in self.param_groups
                 for p in self.params_with_grad(group)]))
        else:
            if self.step_count == self.freeze_point.step + 1:
                self._freeze_variance()
            for index, group in enumerate(self.param_groups):
                self._compressed_step(index, group)
        return loss

    def _freeze_variance(self) -> None:
        """Raise every frozen variance to its floor (once, at the first compressed step, before the
        fresh variance is started from it)."""
        for group in self.param_groups:
            for p in self.params_with_grad(group):
                floor_variance_(lamb_state(self.state[p], p)["exp_avg_sq"], self.config.variance_floor)

    def _warmup_update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        cfg, state = self.config, self.state[p]
        coeff = lamb_update_(p, state, group, cfg.max_coeff, cfg.min_coeff)
        frozen = state.get("lamb_coeff_freeze", 0.0)
        state["lamb_coeff_freeze"] = cfg.coeff_beta * frozen + (1 - cfg.coeff_beta) * coeff
        state["last_factor"] = 1.0

    def _compressed_step(self, index: int, group: dict[str, Any]) -> None:
        params = self.params_with_grad(group)
        if not params:
            return
        beta1 = group["betas"][0]
        states = [lamb_state(self.state[p], p) for p in params]
        previous = [s["exp_avg"].clone() for s in states]
        for p, state in zip(params, states):
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
        self.exchange_momentum_(index, [s["exp_avg"] for s in states], params)
        for p, state, last in zip(params, states, previous):
            self._frozen_update(p, state, last, group)

    def _frozen_update(self, p: torch.Tensor, state: dict[str, Any], last_momentum: torch.Tensor,
                       group: dict[str, Any]) -> None:
        cfg, weight_decay = self.config, group["weight_decay"]
        denom, prelim, update = frozen_lamb_direction(p, state, state["exp_avg"], last_momentum, group)
        factor = (denom / state["exp_avg_sq_fresh"].sqrt().add_(group["eps"])).max().item()
        if weight_decay:
            update_norm = exact_norm(update)
            ratio = min(1.0, exact_norm(prelim) / update_norm) if update_norm > 0 else 1.0
            factor = factor * ratio + (1 - ratio)
        factor = min(max(factor, cfg.factor_min), cfg.factor_max)
        last = state.get("last_factor", 1.0)
        factor = min(max(factor, last * (1 - cfg.factor_threshold)), last * (1 + cfg.factor_threshold))
        state["last_factor"] = factor
        p.add_(update, alpha=-group["lr"] * state.get("lamb_coeff_freeze", 1.0) * factor)
