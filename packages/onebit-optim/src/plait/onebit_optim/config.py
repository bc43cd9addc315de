"""The frozen, keyword-only settings of the three compressed optimizers.

Hyperparameters that torch optimizers take per parameter group (``lr``, ``betas``, ``eps``,
``weight_decay``) stay constructor arguments, so learning-rate schedulers and param groups work
as with ``torch.optim.AdamW``. What is particular to compressed communication lives here, once,
validated before any work starts. Names follow DeepSpeed's configuration keys, so a DeepSpeed
``"optimizer": {"params": {...}}`` block translates key for key (:func:`config_from_dict`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from plait.onebit_optim.grad_control import LossScaling, check_loss_scaling, check_max_grad_norm
from plait.onebit_optim.settle import SettleConfig, check_freeze_step


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name}={value!r} must be an integer >= {minimum}; pass e.g. {max(minimum, 100)}.")


def _check_positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name}={value!r} must be a finite number > 0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnebitAdamConfig:
    """Settings of :class:`~plait.onebit_optim.OnebitAdam`.

    Attributes:
        freeze_step: steps of plain (full-precision, all-reduced) Adam before the variance is
            frozen and the momentum is exchanged in 1 bit (at least 1), or ``"auto"``: freeze
            once the variance has settled (``settle``; :mod:`plait.onebit_optim.settle`).
            DeepSpeed's papers use 15-25% of the run; a fixed step before the variance has
            settled logs a WARNING with the measured change. ``"auto"`` works in plain data
            parallel and under ZeRO-1/2 (:mod:`plait.onebit_optim.zero_settle`).
        settle: how "settled" is measured, for ``"auto"`` and for the warning.
        max_grad_norm: clip the gradient to this global norm before the optimizer uses it
            (``None``: no clipping). During warm-up the averaged gradient, with
            ``torch.nn.utils.clip_grad_norm_`` (bit for bit DDP + clipping); after the freeze each
            rank's own, by the RMS over ranks of their norms
            (:mod:`plait.onebit_optim.grad_control`). Plain data parallel only (under ZeRO use
            ``ZeroConfig.max_grad_norm``).
        loss_scaling: dynamic loss scaling for fp16 (``None``: off), ``GradScaler``'s semantics:
            call ``optimizer.scale_loss(loss).backward()``; a step whose gradient is not finite
            on any rank is skipped on every rank and the scale backs off. Plain data parallel
            only (under ZeRO use its fp16 compute dtype).
        variance_floor: when the variance freezes, every element's variance is raised to at
            least this fraction of its tensor's mean, so an element the warm-up never or rarely
            saw (an unseen embedding row) cannot step by ``|m| / eps``
            (:mod:`plait.onebit_optim.variance_floor`). Where no element is below it, the update
            is the published algorithm bit for bit. ``0`` turns it off. In ``[0, 1]``.
    """

    freeze_step: int | str = 100
    variance_floor: float = 0.001
    settle: SettleConfig = SettleConfig()
    max_grad_norm: float | None = None
    loss_scaling: LossScaling | None = None

    def __post_init__(self) -> None:
        # At least one step: the frozen variance of zero steps is zero and every update would be m / eps.
        check_freeze_step("OnebitAdamConfig", self.freeze_step)
        _check_settle("OnebitAdamConfig", self.settle)
        check_max_grad_norm("OnebitAdamConfig", self.max_grad_norm)
        check_loss_scaling("OnebitAdamConfig", self.loss_scaling)
        _check_ratio("OnebitAdamConfig", "variance_floor", self.variance_floor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnebitLambConfig:
    """Settings of :class:`~plait.onebit_optim.OnebitLamb`.

    Attributes:
        freeze_step: steps of plain LAMB before the variance and the scaling coefficient freeze
            (at least 1), or ``"auto"`` as :class:`OnebitAdamConfig`'s (plain data parallel and
            ZeRO-1/2).
        settle: how "settled" is measured, for ``"auto"`` and the early-freeze warning.
        max_grad_norm: gradient clipping, as :class:`OnebitAdamConfig`'s (plain data parallel only).
        loss_scaling: dynamic fp16 loss scaling, as :class:`OnebitAdamConfig`'s (plain data
            parallel only).
        max_coeff: upper bound of LAMB's per-tensor trust ratio ``||p|| / ||update||``.
        min_coeff: lower bound of that ratio.
        coeff_beta: the frozen coefficient is an exponential moving average of the warm-up
            ratios with this decay (0 <= coeff_beta < 1).
        factor_max: upper bound of the compression-stage factor that rescales the frozen
            coefficient by how far the fresh variance estimate has moved.
        factor_min: lower bound of that factor.
        factor_threshold: the factor may change by at most this fraction per step.
        variance_floor: when the variance freezes, every element's variance is raised to at
            least this fraction of its tensor's mean, as 1-bit Adam's (an unseen embedding row
            would otherwise take most of its tensor's update, whose norm the trust ratio fixes).
            Where no element is below it, the update is the published algorithm bit for bit.
            ``0`` turns it off. In ``[0, 1]``.
    """

    freeze_step: int | str = 100
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1
    variance_floor: float = 0.001
    settle: SettleConfig = SettleConfig()
    max_grad_norm: float | None = None
    loss_scaling: LossScaling | None = None

    def __post_init__(self) -> None:
        owner = "OnebitLambConfig"
        check_freeze_step(owner, self.freeze_step)
        _check_settle(owner, self.settle)
        check_max_grad_norm(owner, self.max_grad_norm)
        check_loss_scaling(owner, self.loss_scaling)
        _check_ratio(owner, "variance_floor", self.variance_floor)
        for name in ("max_coeff", "min_coeff", "factor_max", "factor_min", "factor_threshold"):
            _check_positive(owner, name, getattr(self, name))
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"{owner}.min_coeff={self.min_coeff} exceeds max_coeff={self.max_coeff}; swap them.")
        if self.factor_min > self.factor_max:
            raise ValueError(f"{owner}.factor_min={self.factor_min} exceeds factor_max={self.factor_max}; swap them.")
        if not (isinstance(self.coeff_beta, int | float) and 0 <= self.coeff_beta < 1):
            raise ValueError(f"{owner}.coeff_beta={self.coeff_beta!r} must be in [0, 1); pass e.g. 0.9.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroOneAdamConfig:
    """Settings of :class:`~plait.onebit_optim.ZeroOneAdam` (0/1 Adam, arXiv 2202.06009).

    Attributes:
        var_freeze_step: the last step whose variance may be updated; after it every step is a
            local step and only the synchronisation steps communicate.
        var_update_scaler: the interval between variance updates (which all-reduce the gradient
            in full precision; the other steps exchange it in 1 bit) doubles after this many
            variance updates.
        local_step_scaler: after the variance is frozen, the interval between synchronisations
            doubles every this many steps...
        local_step_clipper: ...up to at most this many steps.
        variance_floor: every element's variance, wherever it divides the momentum, is at
            least this fraction of its tensor's mean (raised in place when the variance
            freezes), so elements the variance steps never or rarely saw cannot step by
            ``|m| / eps`` (:mod:`plait.onebit_optim.variance_floor`). Where no element is below
            it, the update is the published algorithm bit for bit. ``0`` turns it off. In ``[0, 1]``.
    """

    var_freeze_step: int = 100_000
    var_update_scaler: int = 16
    local_step_scaler: int = 32_678
    local_step_clipper: int = 16
    variance_floor: float = 0.01

    def __post_init__(self) -> None:
        owner = "ZeroOneAdamConfig"
        _check_int(owner, "var_freeze_step", self.var_freeze_step, 0)
        for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            _check_int(owner, name, getattr(self, name), 1)
        _check_ratio(owner, "variance_floor", self.variance_floor)


CONFIGS = {"OnebitAdam": OnebitAdamConfig, "OnebitLamb": OnebitLambConfig, "ZeroOneAdam": ZeroOneAdamConfig}


def _check_settle(owner: str, settle: object) -> None:
    if not isinstance(settle, SettleConfig):
        raise ValueError(f"{owner}.settle={settle!r} must be a SettleConfig; pass e.g. SettleConfig(threshold=0.02).")


def _check_ratio(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"{owner}.{name}={value!r} must be a number in [0, 1]; pass e.g. 0.01 (0 turns it off).")


def config_from_dict(kind: str, options: dict[str, Any]) -> Any:
    """Build a config from DeepSpeed-style keys (``{"freeze_step": 400, ...}``).

    Args:
        kind: ``"OnebitAdam"``, ``"OnebitLamb"`` or ``"ZeroOneAdam"``.
        options: the compression settings; keys a DeepSpeed file has that plait decides itself
            (``cuda_aware``, ``comm_backend_name``) are refused so nothing is silently ignored.

    Returns:
        The frozen config.

    Raises:
        ValueError: an unknown kind or an unknown option (the message lists the known ones).
    """
    if kind not in CONFIGS:
        raise ValueError(f"kind={kind!r} is not a compressed optimizer; pass one of {sorted(CONFIGS)}.")
    cls = CONFIGS[kind]
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"{cls.__name__}: unknown option(s) {unknown}; the known ones are {sorted(known)} "
            "(lr, betas, eps and weight_decay are the optimizer's own arguments; the communication "
            "backend is always plait.kernels.collectives)."
        )
    for key, nested in (("settle", SettleConfig), ("loss_scaling", LossScaling)):
        if isinstance(options.get(key), dict):  # a nested block of a JSON/YAML file
            options = {**options, key: nested(**options[key])}
    return cls(**options)
