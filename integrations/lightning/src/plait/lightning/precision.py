"""The precision plugins of the plait strategies (Trainer and Fabric).

ZeRO owns the dtypes: it keeps fp32 masters and casts the compute parameters itself, and for
``16-mixed`` its own loss scaler scales the backward pass (agreed across ranks, so every rank skips
the same steps). The plugin therefore never converts the module; it only adds autocast around
forward (the "mixed" precisions), casts floating inputs (the "true" ones), and routes gradient
clipping to :meth:`ZeroOptimizer.clip_grad_norm_`, which knows the global norm across all shards.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from plait.lightning.config import PRECISIONS, normalize_precision


class _PlaitPrecisionMixin:
    """What both plugins share (Lightning keeps separate hierarchies for Trainer and Fabric)."""

    precision: str
    device_type: str

    def _init(self, precision: Any, device_type: str | None) -> None:
        self.precision = normalize_precision(precision)  # type: ignore[assignment]
        self.plan = PRECISIONS[self.precision]
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """No cast: ZeRO creates the compute-dtype parameters and keeps fp32 masters."""
        return module

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Modules are built in fp32 (the masters' dtype); ZeRO casts when it shards."""
        return contextlib.nullcontext()

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """See :meth:`module_init_context`."""
        return contextlib.nullcontext()

    def forward_context(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` for the mixed precisions, nothing otherwise."""
        if self.plan.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.plan.autocast)

    def convert_input(self, data: Any) -> Any:
        """Floating inputs in the compute dtype for the "true" precisions."""
        if not self.plan.cast_inputs:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.plan.compute_dtype)
                                   if torch.is_floating_point(t) else t)

    def convert_output(self, data: Any) -> Any:
        """Floating outputs back to the default dtype for the "true" precisions."""
        if not self.plan.cast_inputs:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(torch.get_default_dtype())
                                   if torch.is_floating_point(t) else t)

    def state_dict(self) -> dict[str, Any]:
        """Empty: the loss scaler travels with the sharded model state."""
        return {}


def _clip_by_norm(optimizer: Any, clip_val: float) -> None:
    if isinstance(optimizer, LightningOptimizer):
        # Manual optimization passes Lightning's wrapper, an instance of a subclass of the
        # ZeroOptimizer's class: its clip_grad_norm_ would record the clip on the wrapper, which
        # the inner optimizer's step() never reads (the step would not clip).
        optimizer = optimizer._optimizer
    clip = getattr(optimizer, "clip_grad_norm_", None)
    if clip is None:
        raise TypeError(f"{type(optimizer).__name__} is not a plait ZeroOptimizer; the plait strategies clip "
                        "gradients through the optimizer they built in setup.")
    clip(float(clip_val))


def _refuse_clip_by_value() -> None:
    raise ValueError("gradient_clip_algorithm='value' is not supported with ZeRO (each rank holds a shard of "
                     "the gradients); use gradient_clip_algorithm='norm'.")


class PlaitPrecision(_PlaitPrecisionMixin, TrainerPrecision):
    """Precision plugin of :class:`plait.lightning.PlaitStrategy`.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
        device_type: ``"cpu"`` or ``"cuda"`` for autocast (default: cuda when available).

    Raises:
        ValueError: an unsupported precision.
    """

    def __init__(self, precision: Any = "32-true", device_type: str | None = None) -> None:
        super().__init__()
        self._init(precision, device_type)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Clip the global norm across every shard (applied inside the coming ``step()``)."""
        _clip_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        """Refused: see :func:`plait.lightning.config.check_agreement`."""
        _refuse_clip_by_value()


class PlaitFabricPrecision(_PlaitPrecisionMixin, FabricPrecision):
    """Precision plugin of :class:`plait.lightning.PlaitFabricStrategy` (same arguments)."""

    def __init__(self, precision: Any = "32-true", device_type: str | None = None) -> None:
        super().__init__()
        self._init(precision, device_type)


def precision_name_of(plugin: Any) -> str:
    """The precision string of any Lightning precision plugin the connectors build.

    Raises:
        ValueError: a plugin plait cannot honour (double, half ``16-true``, transformer-engine,
            bitsandbytes, ...).
    """
    if isinstance(plugin, _PlaitPrecisionMixin):
        return plugin.precision
    name = getattr(plugin, "precision", None)
    if type(plugin).__name__ == "Precision" and name in (None, "32-true"):
        return "32-true"
    if type(plugin).__name__ in ("MixedPrecision", "HalfPrecision") and name is not None:
        return normalize_precision(name)
    raise ValueError(f"the plait strategies cannot use the precision plugin {type(plugin).__name__} "
                     f"(precision={name!r}); pass precision= one of {', '.join(PRECISIONS)} instead.")
