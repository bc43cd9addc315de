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


@dataclasses.dataclass(frozen=True, kw_only=True)
class SettleConfig:
    """How "the variance has settled" is measured (:mod:`plait.onebit_optim.rules.settle`).

    Attributes:
        threshold: the variance has settled when the largest relative change of a tensor's
            summed bias-corrected variance over ``window`` steps is at most this (> 0).
        window: the number of steps the change is measured over (>= 1).
        min_step: ``freeze_step="auto"`` never freezes before this step (>= ``window + 1``, so
            the first decision sees a whole window).
        max_step: ``freeze_step="auto"`` freezes after this step even if the variance is still
            moving (>= ``min_step``).
    """

    threshold: float = 0.02
    window: int = 10
    min_step: int = 20
    max_step: int = 10_000

    def __post_init__(self) -> None:
        owner = "SettleConfig"
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) \
                or not math.isfinite(self.threshold) or self.threshold <= 0:
            raise ValueError(f"{owner}.threshold={self.threshold!r} must be a finite number > 0; pass e.g. 0.02.")
        for name, minimum in (("window", 1), ("min_step", self.window + 1 if _is_int(self.window) else 2),
                              ("max_step", self.min_step if _is_int(self.min_step) else 2)):
            value = getattr(self, name)
            if not _is_int(value) or value < minimum:
                raise ValueError(f"{owner}.{name}={value!r} must be an integer >= {minimum}"
                                 f"{' (window + 1)' if name == 'min_step' else ''}"
                                 f"{' (min_step)' if name == 'max_step' else ''}; pass e.g. {max(minimum, 20)}.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_freeze_step(owner: str, value: object) -> None:
    """Validate a ``freeze_step`` field: an integer >= 1 or ``"auto"``.

    Raises:
        ValueError: naming the field and the fix.
    """
    if value == "auto":
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{owner}.freeze_step={value!r} must be an integer >= 1 or 'auto' (freeze when the "
                         "variance has settled, see SettleConfig); pass e.g. 'auto' or 2000.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaling:
    """Dynamic loss scaling, with ``torch.amp.GradScaler``'s settings and semantics.

    Attributes:
        init_scale: the first scale (> 0).
        growth_factor: the scale is multiplied by this after ``growth_interval`` taken steps in a row (> 1).
        backoff_factor: the scale is multiplied by this on a skipped step (in (0, 1)).
        growth_interval: taken steps in a row before the scale grows (>= 1).
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        owner = "LossScaling"
        if not _finite(self.init_scale) or self.init_scale <= 0:
            raise ValueError(f"{owner}.init_scale={self.init_scale!r} must be a finite number > 0; pass e.g. 65536.")
        if not _finite(self.growth_factor) or self.growth_factor <= 1:
            raise ValueError(f"{owner}.growth_factor={self.growth_factor!r} must be a finite number > 1; pass e.g. 2.")
        if not _finite(self.backoff_factor) or not 0 < self.backoff_factor < 1:
            raise ValueError(f"{owner}.backoff_factor={self.backoff_factor!r} must be in (0, 1); pass e.g. 0.5.")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ValueError(f"{owner}.growth_interval={self.growth_interval!r} must be an integer >= 1; "
                             "pass e.g. 2000.")


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_max_grad_norm(owner: str, value: object) -> None:
    """Validate a ``max_grad_norm`` field (``None``, or a finite number > 0).

    Raises:
        ValueError: naming the field and the fix.
    """
    if value is not None and (not _finite(value) or value <= 0):
        raise ValueError(f"{owner}.max_grad_norm={value!r} must be None (no clipping) or a finite number > 0; "
                         "pass e.g. 1.0.")


def check_loss_scaling(owner: str, value: object) -> None:
    """Validate a ``loss_scaling`` field (``None`` or a :class:`LossScaling`).

    Raises:
        ValueError: naming the field and the fix.
    """
    if value is not None and not isinstance(value, LossScaling):
        raise ValueError(f"{owner}.loss_scaling={value!r} must be None or a LossScaling; pass e.g. LossScaling().")



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
            once the variance has settled (``settle``; :mod:`plait.onebit_optim.rules.settle`).
            DeepSpeed's papers use 15-25% of the run; a fixed step before the variance has
            settled logs a WARNING with the measured change. ``"auto"`` works in plain data
            parallel and under ZeRO-1/2 (:mod:`plait.onebit_optim.under_zero.settle`).
        settle: how "settled" is measured, for ``"auto"`` and for the warning.
        max_grad_norm: clip the gradient to this global norm before the optimizer uses it
            (``None``: no clipping). During warm-up the averaged gradient, with
            ``torch.nn.utils.clip_grad_norm_`` (bit for bit DDP + clipping); after the freeze each
            rank's own, by the RMS over ranks of their norms
            (:mod:`plait.onebit_optim.exchange.grad_control`). Plain data parallel only (under ZeRO use
            ``ZeroConfig.max_grad_norm``).
        loss_scaling: dynamic loss scaling for fp16 (``None``: off), ``GradScaler``'s semantics:
            call ``optimizer.scale_loss(loss).backward()``; a step whose gradient is not finite
            on any rank is skipped on every rank and the scale backs off. Plain data parallel
            only (under ZeRO use its fp16 compute dtype).
        variance_floor: when the variance freezes, every element's variance is raised to at
            least this fraction of its tensor's mean, so an element the warm-up never or rarely
            saw (an unseen embedding row) cannot step by ``|m| / eps``
            (:mod:`plait.onebit_optim.rules.variance_floor`). Where no element is below it, the update
            is the published algorithm bit for bit. ``0`` turns it off. In ``[0, 1]``.
        zero_param_sync: under ZeRO-1/2 only (plain data parallel ignores it): how the other
            ranks' parameter shards reach every rank after a compressed step. ``"gather"``:
            ZeRO's exact post-step all-gather of the updated parameters (``b P`` bytes per step).
            ``"update"``: every rank already decodes the whole synchronised momentum from the
            1-bit exchange, so it applies the same update to every shard of its own replica and
            nothing is gathered; bit for bit ``"gather"``, for fp32 compute (a master that is the
            shard of the replica), at the cost of the whole frozen variance on every rank (4 bytes
            per parameter, all-gathered once) and the whole update's arithmetic
            (:mod:`plait.onebit_optim.under_zero.replicated_update`).
    """

    freeze_step: int | str = 100
    variance_floor: float = 0.001
    settle: SettleConfig = SettleConfig()
    max_grad_norm: float | None = None
    loss_scaling: LossScaling | None = None
    zero_param_sync: str = "gather"

    def __post_init__(self) -> None:
        # At least one step: the frozen variance of zero steps is zero and every update would be m / eps.
        check_freeze_step("OnebitAdamConfig", self.freeze_step)
        _check_settle("OnebitAdamConfig", self.settle)
        check_max_grad_norm("OnebitAdamConfig", self.max_grad_norm)
        check_loss_scaling("OnebitAdamConfig", self.loss_scaling)
        _check_ratio("OnebitAdamConfig", "variance_floor", self.variance_floor)
        _check_param_sync("OnebitAdamConfig", self.zero_param_sync)


def _check_param_sync(owner: str, value: Any) -> None:
    if value not in ("gather", "update"):
        raise ValueError(f"{owner}.zero_param_sync={value!r} must be \"gather\" (ZeRO's exact parameter "
                         "all-gather) or \"update\" (every rank applies the decoded update to its whole replica); "
                         "pass one of them.")


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
        zero_param_sync: under ZeRO-1/2 only, as :class:`OnebitAdamConfig`'s: ``"gather"`` (ZeRO's
            exact post-step all-gather) or ``"update"``: every rank computes the whole update and
            its per-tensor norms from the synchronised momentum it decodes anyway, and applies it
            to its whole replica; bit for bit ``"gather"``, for fp32 compute, at the cost of the
            whole frozen and fresh variances and the last momentum on every rank (12 bytes per
            parameter) and the whole update's arithmetic
            (:mod:`plait.onebit_optim.under_zero.replicated_lamb`).
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
    zero_param_sync: str = "gather"

    def __post_init__(self) -> None:
        owner = "OnebitLambConfig"
        _check_param_sync(owner, self.zero_param_sync)
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
            ``|m| / eps`` (:mod:`plait.onebit_optim.rules.variance_floor`). Where no element is below
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
