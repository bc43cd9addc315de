"""DeepSpeed's learning-rate schedules as ordinary torch LR schedulers.

A ``ds_config`` ``scheduler`` block (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``OneCycle``) becomes one of these classes. They are ``torch.optim.lr_scheduler.LRScheduler``
subclasses, so Lightning, the HF Trainer and plain loops step them as any torch scheduler, and
their learning rates follow DeepSpeed's formulas step for step.

DeepSpeed counts ``last_batch_iteration`` from -1 (the lr before the first step) without
stepping in the constructor; torch schedulers step once in theirs, so here
``last_batch_iteration == last_epoch - 1``. ``state_dict()`` carries ``last_batch_iteration``
too and ``load_state_dict`` accepts DeepSpeed's own ``{"last_batch_iteration": n}``, so a
scheduler state saved by DeepSpeed resumes here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    if isinstance(value, list | tuple):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"scheduler.params.{name} has {len(value)} values for "
                             f"{len(optimizer.param_groups)} parameter groups; give one value or one per group.")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


def _check_warmup(warmup_type: str, warmup_num_steps: int) -> int:
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(f"scheduler.params.warmup_type={warmup_type!r} is unknown; use 'log' or 'linear'.")
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
        raise ValueError(f"scheduler.params.warmup_num_steps={warmup_num_steps!r} must be an integer >= 0.")
    return max(2, warmup_num_steps)  # DeepSpeed's floor: log(1) would divide by zero


def _warmup_fraction(iteration: int, warmup_type: str, warmup_steps: int) -> float:
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class _DeepSpeedSchedule(LRScheduler):
    """Shared bookkeeping: DeepSpeed's iteration index and its state-dict key."""

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's index of the last batch (-1 before the first ``step()``)."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        """Torch's hook: the lrs at the current iteration."""
        return self.lrs_at(self.last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        """Return the learning rate of every parameter group at DeepSpeed's ``iteration``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Return torch's scheduler state plus DeepSpeed's ``last_batch_iteration``."""
        state = super().state_dict()
        state["last_batch_iteration"] = self.last_batch_iteration
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by DeepSpeed's scheduler of the same name."""
        iteration = int(state_dict["last_batch_iteration"])
        if "last_epoch" in state_dict:
            super().load_state_dict({k: v for k, v in state_dict.items() if k != "last_batch_iteration"})
        self.last_epoch = iteration + 1
        lrs = self.lrs_at(iteration)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = list(lrs)


class WarmupLR(_DeepSpeedSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    Args:
        optimizer: the wrapped optimizer.
        warmup_min_lr: lr at the start (one value or one per group).
        warmup_max_lr: lr after warmup (one value or one per group).
        warmup_num_steps: steps of warmup (DeepSpeed uses at least 2).
        warmup_type: ``"log"`` (DeepSpeed's default) or ``"linear"``.

    Raises:
        ValueError: an unknown ``warmup_type``, a negative step count or mismatched group lists.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log") -> None:
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_type = warmup_type
        self.warmup_num_steps = _check_warmup(warmup_type, warmup_num_steps)
        super().__init__(optimizer)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_type, self.warmup_num_steps)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        """Return every group's lr at DeepSpeed's ``iteration``."""
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``.

    Args:
        optimizer: the wrapped optimizer.
        total_num_steps: the step at which the lr reaches 0.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type: as :class:`WarmupLR`.

    Raises:
        ValueError: as :class:`WarmupLR`, or ``total_num_steps`` not a positive integer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log") -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"scheduler.params.total_num_steps={total_num_steps!r} must be a positive integer.")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_type, self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Scale each group's own lr: warm up from ``warmup_min_ratio`` to 1, then cosine to ``cos_min_ratio``.

    Args:
        optimizer: the wrapped optimizer; its groups' current ``lr`` are the peaks.
        total_num_steps: the step at which the cosine reaches ``cos_min_ratio``.
        warmup_min_ratio: fraction of the peak at step 0.
        warmup_num_steps: steps of warmup (at least 1; DeepSpeed uses at least 2).
        cos_min_ratio: fraction of the peak at the end (and after it).
        warmup_type: ``"log"`` (DeepSpeed's default) or ``"linear"``.

    Raises:
        ValueError: an unknown ``warmup_type`` or ``warmup_num_steps`` not a positive integer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log") -> None:
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"scheduler.params.warmup_num_steps={warmup_num_steps!r} must be a positive integer.")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.warmup_num_steps = _check_warmup(warmup_type, warmup_num_steps)
        self.peak_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer)

    def ratio_at(self, iteration: int) -> float:
        """Return the fraction of the peak lr at DeepSpeed's ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            ratio = _warmup_fraction(iteration, self.warmup_type, self.warmup_num_steps)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        """Return every group's lr at DeepSpeed's ``iteration``."""
        ratio = self.ratio_at(iteration)
        return [peak * ratio for peak in self.peak_lrs]


class OneCycle(_DeepSpeedSchedule):
    """DeepSpeed's 1-cycle policy: lr up then down over one cycle (momentum the other way), then decay.

    Args:
        optimizer: the wrapped optimizer.
        cycle_min_lr, cycle_max_lr: the cycle's lr bounds (one value or one per group).
        decay_lr_rate: after the cycle, lr = ``cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)``.
        cycle_first_step_size: steps of the rising half (> 0).
        cycle_second_step_size: steps of the falling half (default: the first's).
        cycle_first_stair_count, cycle_second_stair_count: hold lr flat in this many stairs per half
            (0: continuous; the second defaults to the first).
        decay_step_size: the decay's step size (0: no decay after the cycle).
        cycle_momentum: also cycle ``betas[0]`` (only for optimizers with ``betas``); as in
            DeepSpeed, ``betas[1]`` is then set to 0.99.
        cycle_min_mom, cycle_max_mom, decay_mom_rate: the momentum counterparts.

    Raises:
        ValueError: a non-positive first half or a negative second half.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: Any, cycle_max_lr: Any,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000, cycle_second_step_size: Any = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Any = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: Any = 0.8, cycle_max_mom: Any = 0.9,
                 decay_mom_rate: float = 0.0) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ValueError(f"scheduler.params: cycle_first_step_size={cycle_first_step_size!r} must be > 0 and "
                             f"cycle_second_step_size={cycle_second_step_size!r} >= 0.")
        self.first_step_size, self.second_step_size, self.total_size = first, second, first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.decay_mom_rate = decay_mom_rate
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        if self.cycle_momentum:
            for group, mom in zip(optimizer.param_groups, self.min_moms, strict=True):
                group["betas"] = (mom, 0.99)
        super().__init__(optimizer)

    def _scale(self, iteration: int) -> float:
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # from the integer offset, as DeepSpeed does, so a boundary never loses a stair
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        """Return every group's lr at DeepSpeed's ``iteration``."""
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (iteration - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def moms_at(self, iteration: int) -> list[float]:
        """Return every group's ``betas[0]`` at DeepSpeed's ``iteration``."""
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (iteration - self.total_size + 1) / self.decay_step_size
        return [hi * factor for hi in self.max_moms]

    def step(self, epoch: Any = None) -> None:
        """Advance one batch: set every group's lr (and ``betas`` when cycling momentum)."""
        if epoch is None:
            super().step()
        else:
            super().step(epoch)
        if self.cycle_momentum and self.last_batch_iteration >= 0:
            for group, mom in zip(self.optimizer.param_groups, self.moms_at(self.last_batch_iteration), strict=True):
                group["betas"] = (mom, 0.99)


SCHEDULES: dict[str, type[_DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
}


def build_schedule(optimizer: torch.optim.Optimizer, block: dict[str, Any]) -> LRScheduler:
    """Build the scheduler a ``ds_config`` ``scheduler`` block names.

    Args:
        optimizer: the optimizer to schedule (its groups' lr are set now, as DeepSpeed does).
        block: ``{"type": name, "params": {...}}``.

    Returns:
        The torch LR scheduler.

    Raises:
        ValueError: an unknown ``type`` or a parameter the schedule does not take (named with its path).
    """
    name = block.get("type")
    if name not in SCHEDULES:
        raise ValueError(f"scheduler.type={name!r} is not supported; use one of {sorted(SCHEDULES)}, or build the "
                         "scheduler yourself and pass it as initialize(lr_scheduler=...).")
    params = dict(block.get("params") or {})
    params.pop("last_batch_iteration", None)  # resuming sets it from the checkpoint
    try:
        return SCHEDULES[name](optimizer, **params)
    except TypeError as exc:
        raise ValueError(f"scheduler.params for {name}: {exc}; see DeepSpeed's {name} for its parameters.") from exc
