"""Dynamic loss scaling for fp16, with hysteresis, agreed across ranks by the optimizer.

The scaler only keeps the arithmetic; the decision whether a step overflowed is made by the
optimizer from one all-reduced flag, so every rank skips the same steps and the scale evolves
identically everywhere (it is replicated state and is checked like the parameters).
"""

from __future__ import annotations

import torch

from plait.zero_sharding.config import ZeroConfig


class LossScaler:
    """Loss scale state machine.

    Dynamic mode (``config.loss_scale == 0``): start at ``2 ** initial_scale_power``; after
    ``loss_scale_window`` consecutive good steps (``loss_scale_window_offset`` more for the first
    growth after the start or an overflow) multiply by ``growth_factor``; on an overflow
    skip the step and, once ``hysteresis`` overflows have been seen since the last growth,
    multiply by ``backoff_factor`` (never below ``min_loss_scale``). Static mode keeps
    ``loss_scale``. Without fp16 the scale is 1 and never changes.

    Args:
        config: the engine config.
        enabled: whether scaling applies (fp16 compute).
    """

    def __init__(self, config: ZeroConfig, *, enabled: bool) -> None:
        self.enabled = enabled
        self.dynamic = enabled and config.loss_scale == 0
        self.config = config
        self.scale = float(2 ** config.initial_scale_power) if self.dynamic else (config.loss_scale or 1.0)
        if not enabled:
            self.scale = 1.0
        # Counts from -offset where an offset delays the first growth (see ZeroConfig).
        self.good_steps = -config.loss_scale_window_offset
        self.hysteresis_left = config.hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Advance after a step (``overflow``: the step was skipped)."""
        if overflow:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = -self.config.loss_scale_window_offset
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.config.min_loss_scale, self.scale * self.config.backoff_factor)
            return
        self.good_steps += 1
        if self.good_steps >= self.config.loss_scale_window:
            self.scale *= self.config.growth_factor
            self.good_steps = 0
            self.hysteresis_left = self.config.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        """Everything needed to resume bit for bit."""
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])

    def as_tensor(self) -> torch.Tensor:
        """The state as a float64 tensor (for replica checks and the sharded state dict)."""
        return torch.tensor([self.scale, self.good_steps, self.hysteresis_left, self.skipped_steps],
                            dtype=torch.float64)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the loss scale.

    Applied to the model's outputs in fp16 mode, so ``loss.backward()`` runs scaled without the
    user calling anything: the loss (or whatever is differentiated) is computed from these
    outputs, and scaling the gradient at the outputs is the same as scaling the loss.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, scaler: LossScaler) -> torch.Tensor:
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scaler.scale, None
