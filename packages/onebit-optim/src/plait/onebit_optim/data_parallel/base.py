"""What the three compressed optimizers share: arguments, masks, the exchanges and their state.

A :class:`CompressedOptimizer` is a ``torch.optim.Optimizer`` for a model replicated on every
rank of a data-parallel group (DDP-style, but *not* wrapped in DDP: the optimizer owns the
exchange, because after warm-up it exchanges momentum instead of gradients). The user's loop is
unchanged: forward, ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``.

State: torch's per-parameter state (``exp_avg``, ``exp_avg_sq``, ... as torch's Adam names them)
plus, under the ``"onebit"`` key of :meth:`state_dict`, the step counters, the freeze state and
every group's error-feedback buffers, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from plait.kernels import collectives
from plait.onebit_optim.exchange.compressed import CompressedExchange, average_gradients, world_of
from plait.onebit_optim.exchange.grad_control import GradientControl
from plait.onebit_optim.rules.settle import FreezePoint

# How these optimizers compose with ZeRO-1/2: set by plait.onebit_optim.under_zero.compose, the floor
# above this one, when the package is imported (a lower floor never imports a higher one).
_zero_composition: Callable[..., Any] | None = None


def set_zero_composition(compose: Callable[..., Any]) -> None:
    """Install the function :meth:`CompressedOptimizer.compose_with_zero` delegates to.

    Args:
        compose: :func:`plait.onebit_optim.under_zero.compose.compose_with_zero`.
    """
    global _zero_composition
    _zero_composition = compose


def check_hyperparameters(owner: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Validate the per-group hyperparameters before any work.

    Raises:
        ValueError: naming the argument and the fix.
    """
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{owner}: lr={lr!r} must be a finite number >= 0; pass e.g. 1e-3.")
    if not (isinstance(betas, tuple | list) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"{owner}: betas={betas!r} must be two numbers in [0, 1); pass e.g. (0.9, 0.999).")
    if not (isinstance(eps, int | float) and eps > 0):
        raise ValueError(f"{owner}: eps={eps!r} must be > 0; pass e.g. 1e-8.")
    if not (isinstance(weight_decay, int | float) and weight_decay >= 0):
        raise ValueError(f"{owner}: weight_decay={weight_decay!r} must be >= 0.")


def name_of(optimizer: Any) -> str:
    """The class name of ``optimizer`` (for messages)."""
    return type(optimizer).__name__


def pick_config(owner: str, config: Any | None, onebit_config: Any | None) -> Any | None:
    """``config``, or its other name ``onebit_config`` (for calls through functions that take a
    ``config`` of their own: ``zero_shard``, Lightning's plait strategies).

    Raises:
        ValueError: both are given and differ.
    """
    if onebit_config is None:
        return config
    if config is not None and config != onebit_config:
        raise ValueError(f"{owner}: config and onebit_config differ; pass one of them.")
    return onebit_config


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """Call an optimizer ``step`` closure with gradients enabled (``None`` without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of :class:`OnebitAdam`, :class:`OnebitLamb` and :class:`ZeroOneAdam`.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        lr, betas, eps, weight_decay: the per-group hyperparameters (validated here).
        config: the subclass's frozen config (an instance of its ``CONFIG`` class; ``None``: defaults).
        process_group: the data-parallel group (``None``: the default group, or one process
            when torch.distributed is not initialised).
        momentum_masks: optional ``{parameter: mask}`` of 0/1 tensors shaped like the parameter;
            the exchanged momentum is multiplied by the mask, so elements whose gradient is
            always zero (padding embeddings) stay exactly zero, which 1 bit cannot say.

    Raises:
        ValueError: invalid hyperparameters, a config of another type, a mask of the wrong shape
            or for a parameter this optimizer does not hold, or a parameter that is not floating point.
    """

    CONFIG: type = object
    # Read by plait-zero-sharding (by name, no import): this optimizer exchanges (compressed)
    # momentum itself; under ZeRO it composes through compose_with_zero instead.
    owns_gradient_exchange = True

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 *, config: Any | None, process_group: Any | None = None,
                 momentum_masks: dict[torch.Tensor, torch.Tensor] | None = None) -> None:
        name = type(self).__name__
        check_hyperparameters(name, lr, betas, eps, weight_decay)
        self.config = config if config is not None else self.CONFIG()
        if not isinstance(self.config, self.CONFIG):
            raise ValueError(f"{name}: config must be a {self.CONFIG.__name__}, got {type(self.config).__name__}.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.process_group = process_group
        self.rank, self.world = world_of(process_group)
        self.step_count = 0
        self.exchanges: list[CompressedExchange | None] = [None] * len(self.param_groups)
        self.masks = self._check_masks(momentum_masks or {})
        # Clipping and loss scaling (1-bit Adam and LAMB's configs have them; 0/1 Adam's does not).
        self.grad_control = GradientControl(name, getattr(self.config, "max_grad_norm", None),
                                            getattr(self.config, "loss_scaling", None), process_group, self.world)
        # Not per-group options (torch copies defaults into groups only in __init__): kept here so
        # that code rebuilding an optimizer from its class and defaults (Lightning's plait
        # strategies, zero_shard) keeps the 1-bit settings and masks.
        self.defaults["onebit_config"] = self.config
        self.defaults["momentum_masks"] = momentum_masks

    @classmethod
    def compose_with_zero(cls, optimizer: Any, zero_config: Any, **kwargs: Any) -> Any:
        """Called by plait-zero-sharding's ``zero_shard`` (by name): the reducer and inner
        optimizer of 1-bit Adam under ZeRO-1/2, or a refusal naming what works
        (:func:`plait.onebit_optim.under_zero.compose.compose_with_zero`)."""
        if _zero_composition is None:  # only when this module was loaded outside its package
            raise RuntimeError("the ZeRO composition of the 1-bit optimizers is not installed; import "
                               "plait.onebit_optim (it imports plait.onebit_optim.under_zero.compose).")
        return _zero_composition(optimizer, zero_config, **kwargs)

    def _check_masks(self, masks: dict[torch.Tensor, torch.Tensor]) -> dict[int, torch.Tensor]:
        owned = {id(p): p for group in self.param_groups for p in group["params"]}
        for p in owned.values():
            if not p.is_floating_point():
                raise ValueError(f"{type(self).__name__}: parameter of dtype {p.dtype} is not floating point.")
        checked = {}
        for param, mask in masks.items():
            if id(param) not in owned:
                raise ValueError(
                    f"momentum_masks: a mask is given for a tensor of shape {tuple(param.shape)} that is not one of "
                    "this optimizer's parameters; key the dict by the parameters themselves.")
            if not isinstance(mask, torch.Tensor) or mask.shape != param.shape:
                got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(
                    f"momentum_masks: the mask of a parameter of shape {tuple(param.shape)} has shape {got}; "
                    "give a 0/1 tensor of exactly the parameter's shape.")
            checked[id(param)] = mask.to(device=param.device, dtype=torch.float32)
        return checked

    # -- clipping and loss scaling -----------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss x`` the current loss scale: call ``optimizer.scale_loss(loss).backward()``
        (``config.loss_scaling``; :mod:`plait.onebit_optim.exchange.grad_control`).

        Raises:
            RuntimeError: the config has no loss scaling.
        """
        return self.grad_control.scale_loss(loss)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1 without loss scaling)."""
        return float(self.grad_control.scale)

    def all_params_with_grad(self) -> list[torch.Tensor]:
        """Every parameter with a gradient this step, in param-group order."""
        return [p for group in self.param_groups for p in self.params_with_grad(group)]

    # -- the two exchanges ------------------------------------------------------------------

    def params_with_grad(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters that have a gradient this step.

        Raises:
            RuntimeError: some but not all of the group's parameters have one: the flat 1-bit
                buffer's layout must be the same on every rank and at every step.
        """
        params = [p for p in group["params"] if p.grad is not None]
        if params and len(params) != len(group["params"]):
            raise RuntimeError(
                f"{type(self).__name__}: {len(group['params']) - len(params)} parameter(s) of a group have no "
                "gradient this step; every rank must exchange the same layout. Freeze them with requires_grad=False "
                "before building the optimizer, or put them in a group of their own.")
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients.")
        return params

    def average_gradients_(self) -> None:
        """All-reduce every gradient to the data-parallel average (DDP's arithmetic)."""
        grads = [p.grad for group in self.param_groups for p in self.params_with_grad(group)]
        with collectives.named(f"{type(self).__name__} full-precision gradient average"):
            average_gradients(grads, group=self.process_group)

    def exchange(self, index: int) -> CompressedExchange:
        """Group ``index``'s 1-bit exchange, created on first use (no error buffers during warm-up)."""
        if self.exchanges[index] is None:
            params = self.param_groups[index]["params"]
            self.exchanges[index] = CompressedExchange(
                [p.numel() for p in params], group=self.process_group, device=params[0].device)
        return self.exchanges[index]

    def exchange_momentum_(self, index: int, tensors: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        """1-bit average of ``tensors`` (one per parameter of group ``index``), then the masks."""
        with collectives.named(f"{type(self).__name__} 1-bit exchange of param group {index}"):
            self.exchange(index).exchange_(tensors)
        for tensor, param in zip(tensors, params):
            mask = self.masks.get(id(param))
            if mask is not None:
                tensor.mul_(mask)

    def check_finite(self, index: int, params: list[torch.Tensor]) -> None:
        """Stop at the first parameter of group ``index`` that is no longer finite after a step.

        Called where every rank holds the same parameters (replicas), so every rank raises together
        instead of one rank leaving the others waiting in a collective. One host synchronisation.

        Raises:
            FloatingPointError: naming the optimizer, the parameter (group, position, shape) and the step.
        """
        if not params:
            return
        finite = torch.stack([torch.isfinite(p).all() for p in params])
        if bool(finite.all()):
            return
        position = int((~finite).nonzero()[0])
        raise FloatingPointError(
            f"{type(self).__name__}: parameter {position} of param group {index} (shape "
            f"{tuple(params[position].shape)}) is not finite after step {self.step_count}: the loss or the update "
            "diverged. Lower lr, freeze later (a longer warm-up) or raise config.variance_floor; resume from the "
            "last checkpoint.")

    # -- state ------------------------------------------------------------------------------

    def onebit_state(self) -> dict[str, Any]:
        """The counters of the subclass's schedule (overridden to add more)."""
        return {"step_count": self.step_count, "grad_control": self.grad_control.state_dict()}

    def load_onebit_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`onebit_state` returned."""
        self.step_count = state["step_count"]
        if "grad_control" in state:  # absent in states saved before clipping and loss scaling existed
            self.grad_control.load_state_dict(state["grad_control"])

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"onebit"``: counters and every group's error feedback."""
        out = super().state_dict()
        out["onebit"] = {
            "kind": type(self).__name__,
            "counters": self.onebit_state(),
            "exchanges": [None if ex is None else ex.state_dict() for ex in self.exchanges],
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` of the same optimizer kind on the same rank.

        Raises:
            ValueError: the ``"onebit"`` part is missing (a plain torch optimizer's state: the
                counters and error feedback would be lost) or belongs to another kind, rank or
                world size.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        if extra is None or extra.get("kind") != type(self).__name__:
            found = "none" if extra is None else extra.get("kind")
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state has no {type(self).__name__} part (found: {found}); "
                "load a state saved by the same optimizer, so its step counters and error feedback are restored.")
        super().load_state_dict(state_dict)
        self.load_onebit_state(extra["counters"])
        for index, saved in enumerate(extra["exchanges"]):
            if saved is None:
                self.exchanges[index] = None
            else:
                self.exchange(index).load_state_dict(saved)


class FreezePointOwner:
    """The members an optimizer with a :class:`FreezePoint` (``self.freeze_point``) shares: its
    ``freeze_step`` and the freeze point in the saved 1-bit state. Mixed in before the optimizer base."""

    freeze_point: FreezePoint

    @property
    def freeze_step(self) -> int | None:
        """The last warm-up step: ``config.freeze_step``, or with ``"auto"`` the step it chose
        (``None`` until the variance has settled)."""
        return self.freeze_point.step

    def onebit_state(self) -> dict[str, Any]:
        """The step counter and the freeze point (``"auto"``'s decision and observations)."""
        return {**super().onebit_state(), "freeze": self.freeze_point.state_dict()}  # type: ignore[misc]

    def load_onebit_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`onebit_state` (a state saved before the freeze point was kept loads too)."""
        super().load_onebit_state(state)  # type: ignore[misc]
        if "freeze" in state:
            self.freeze_point.load_state_dict(state["freeze"])
