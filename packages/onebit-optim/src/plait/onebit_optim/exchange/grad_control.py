"""Gradient clipping and dynamic loss scaling for 1-bit Adam and 1-bit LAMB in plain data parallel.

Both act on the gradients before the optimizer uses them, and both must be decided the same way
on every rank: a rank that skips a step alone, or clips by another factor, leaves the replicas
different for good.

**Warm-up** (gradients all-reduced first, as DDP does): the averaged gradients are equal on every
rank, so each rank unscales and checks them itself (torch's ``GradScaler`` arithmetic:
``_amp_foreach_non_finite_check_and_unscale_`` with ``1 / scale`` rounded as it rounds it) and
clips them with ``torch.nn.utils.clip_grad_norm_``. The step is then bit for bit DDP +
``GradScaler`` (``unscale_``, ``clip_grad_norm_``, ``step``, ``update``) + the optimizer. No bytes
beyond the gradient all-reduce.

**After the freeze** each rank holds only its own gradient (the momentum is exchanged, not the
gradient). Each rank unscales its own; one float64 all-reduce of ``[non-finite flag,
||g_rank||^2]`` (16 bytes a step) tells every rank whether any rank overflowed (then every rank
skips) and gives ``N = sqrt(mean over ranks of ||g_rank||^2)``. When ``N > max_grad_norm`` every
rank scales its local gradient by ``max_grad_norm / (N + 1e-6)``. ``N`` bounds the averaged
gradient's norm from above (by the triangle and mean-square inequalities; equal when the ranks'
gradients are equal), so the clipping is at least as strong as clipping the average, without
sending the gradient. It is the rule plait-zero-sharding's composition of these optimizers
uses after warm-up.

**A skipped step** (an inf/nan gradient on any rank) moves nothing: parameters, moments, error
feedback and the step counter (so the warm-up counts taken steps). The scale then follows
``GradScaler``: multiplied by ``backoff_factor`` on a skipped step, by ``growth_factor`` after
``growth_interval`` taken steps in a row (``torch._amp_update_scale_``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from plait.kernels import collectives
from plait.onebit_optim.config import LossScaling


class GradientControl:
    """The clipping and loss-scaling state of one optimizer (see the module docstring).

    Args:
        owner: the optimizer's name (messages, flight log).
        max_grad_norm: the clipping threshold, or ``None``.
        loss_scaling: the loss-scaling settings, or ``None``.
        group: the data-parallel process group.
        world: its size.
    """

    def __init__(self, owner: str, max_grad_norm: float | None, loss_scaling: LossScaling | None, group: Any,
                 world: int) -> None:
        self.owner, self.max_grad_norm, self.loss_scaling = owner, max_grad_norm, loss_scaling
        self.group, self.world = group, world
        self.enabled = max_grad_norm is not None or loss_scaling is not None
        init = loss_scaling.init_scale if loss_scaling is not None else 1.0
        self.scale = torch.full((), init, dtype=torch.float32)  # GradScaler's dtypes
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss x scale`` (what to call ``backward`` on), as ``GradScaler.scale``.

        Raises:
            RuntimeError: loss scaling is off.
        """
        if self.loss_scaling is None:
            raise RuntimeError(f"{self.owner}.scale_loss: config.loss_scaling is None; pass "
                               f"{self.owner}Config(loss_scaling=LossScaling()) to scale the loss, or call "
                               "loss.backward() directly.")
        return loss * self.scale.to(device=loss.device)

    def prepare(self, params: list[torch.Tensor], *, averaged: bool) -> bool:
        """Unscale, check and clip the gradients of ``params`` in place; whether the step is taken.

        Args:
            params: every parameter whose gradient the step will use.
            averaged: the gradients are the all-reduced average (warm-up), equal on every rank.

        Returns:
            ``False`` when some rank's gradient is not finite: skip the step (the scale backs off).
        """
        if not self.enabled or not params:
            return True
        grads = [p.grad for p in params]
        found_inf = torch.zeros((), dtype=torch.float32)
        if self.loss_scaling is not None:
            inv_scale = self.scale.double().reciprocal().float()  # GradScaler.unscale_'s rounding
            for same in _by_device_and_dtype(grads):
                torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
        if averaged:
            take = not bool(found_inf)
            if take and self.max_grad_norm is not None:
                self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        else:
            take = self._agree_and_clip_local(grads, found_inf)
        self._update_scale(found_inf if take else torch.ones((), dtype=torch.float32))
        if not take:
            self.skipped_steps += 1
        return take

    def _agree_and_clip_local(self, grads: list[torch.Tensor], found_inf: torch.Tensor) -> bool:
        """After the freeze: one float64 all-reduce of ``[flag, ||g_rank||^2]``; clip by the RMS norm."""
        local_sq = torch.stack([g.double().square().sum() for g in grads]).sum()
        stats = torch.stack([found_inf.double(), local_sq])
        if self.world > 1:
            collectives.all_reduce(stats, group=self.group,
                                   name=f"{self.owner} overflow flag and gradient norm all-reduce")
        if self.loss_scaling is not None and bool(stats[0] > 0):
            return False  # without loss scaling a non-finite gradient goes on, to check_finite's error
        norm = math.sqrt(float(stats[1]) / self.world)
        self.last_grad_norm = norm
        if self.max_grad_norm is not None and norm > self.max_grad_norm:
            coef = self.max_grad_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)
        return True

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        cfg = self.loss_scaling
        if cfg is not None:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, cfg.growth_factor,
                                     cfg.backoff_factor, cfg.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        """The scale, its growth tracker and the skipped-step count (resumed bit for bit)."""
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker),
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale.fill_(state["scale"])
        self.growth_tracker.fill_(state["growth_tracker"])
        self.skipped_steps = int(state["skipped_steps"])


def _by_device_and_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return list(groups.values())
