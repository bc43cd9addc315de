"""``FusedMoE``: an ``nn.Module`` holding a router and stacked experts, run by :func:`fused_moe`.

The module stores the experts the way the kernels read them (``w_gate_up [E, 2I, H]``,
``w_down [E, H, I]``), so a forward pass never restacks weights. :meth:`FusedMoE.load_experts`
copies per-expert projection matrices (as HF's Mixtral/Qwen-MoE blocks hold them) into that
layout once. :meth:`FusedMoE.moe_forward` is the method a serving engine calls with its own
router logits; it is the shape of a vLLM fused-MoE method's ``apply``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

from plait.inference_kernels.moe.fused_moe import ACTIVATIONS, fused_moe


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedMoEConfig:
    """Shape and routing of a fused MoE block.

    Attributes:
        num_experts: E, the number of experts (>= 1).
        hidden_size: H, the model width (>= 1).
        intermediate_size: I, each expert's MLP width (>= 1).
        top_k: experts per token, in ``[1, num_experts]``.
        renormalize: rescale each token's kept routing weights to sum to one (Mixtral: True).
        activation: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` applied to the gate projection.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    renormalize: bool = True
    activation: str = "silu"

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"FusedMoEConfig.{name}={value!r} must be a positive int.")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"FusedMoEConfig.top_k={self.top_k!r} must be an int in [1, num_experts={self.num_experts}]."
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"FusedMoEConfig.activation={self.activation!r} is not supported; use one of "
                f"{', '.join(ACTIVATIONS)}."
            )


class FusedMoE(nn.Module):
    """A Mixture-of-Experts MLP block: linear router, top-k routing, fused experts.

    Args:
        config: the block's :class:`FusedMoEConfig`.
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device.
    """

    def __init__(self, config: FusedMoEConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        factory = {"dtype": dtype, "device": device}
        self.gate = nn.Linear(h, e, bias=False, **factory)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h, **factory))
        self.w_down = nn.Parameter(torch.empty(e, h, i, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the experts like ``nn.Linear`` would each projection (uniform, 1/sqrt(fan_in))."""
        with torch.no_grad():
            bound_in = 1.0 / math.sqrt(self.config.hidden_size)
            bound_out = 1.0 / math.sqrt(self.config.intermediate_size)
            self.w_gate_up.uniform_(-bound_in, bound_in)
            self.w_down.uniform_(-bound_out, bound_out)

    @torch.no_grad()
    def load_experts(
        self,
        gate_weights: Sequence[torch.Tensor],
        up_weights: Sequence[torch.Tensor],
        down_weights: Sequence[torch.Tensor],
    ) -> None:
        """Copy per-expert projection matrices into the stacked layout.

        Args:
            gate_weights: E tensors ``[I, H]`` (``nn.Linear(H, I).weight``; Mixtral's ``w1``).
            up_weights: E tensors ``[I, H]`` (Mixtral's ``w3``).
            down_weights: E tensors ``[H, I]`` (Mixtral's ``w2``).

        Raises:
            ValueError: wrong number of experts or a matrix of the wrong shape.
        """
        e, h, i = self.config.num_experts, self.config.hidden_size, self.config.intermediate_size
        for name, mats, shape in (("gate_weights", gate_weights, (i, h)), ("up_weights", up_weights, (i, h)),
                                  ("down_weights", down_weights, (h, i))):
            if len(mats) != e:
                raise ValueError(f"{name} has {len(mats)} matrices; the block has {e} experts.")
            for index, mat in enumerate(mats):
                if tuple(mat.shape) != shape:
                    raise ValueError(f"{name}[{index}] has shape {tuple(mat.shape)}; expected {shape}.")
        for expert in range(e):
            self.w_gate_up[expert, :i].copy_(gate_weights[expert])
            self.w_gate_up[expert, i:].copy_(up_weights[expert])
            self.w_down[expert].copy_(down_weights[expert])

    def moe_forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Run the experts on ``[T, H]`` tokens given ``[T, E]`` router logits computed elsewhere.

        Returns:
            ``[T, H]`` in ``hidden.dtype``.

        Raises:
            ValueError: as :func:`~plait.inference_kernels.moe.fused_moe.fused_moe`.
        """
        return fused_moe(hidden, self.w_gate_up, self.w_down, router_logits, top_k=self.config.top_k,
                         renormalize=self.config.renormalize, activation=self.config.activation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Route and run ``[..., H]`` token states; returns the same shape.

        Raises:
            ValueError: the last dimension is not ``hidden_size``, or as :meth:`moe_forward`.
        """
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"FusedMoE expects [..., {self.config.hidden_size}] inputs, got {tuple(hidden.shape)}."
            )
        flat = hidden.reshape(-1, self.config.hidden_size)
        return self.moe_forward(flat, self.gate(flat)).view(hidden.shape)

    def extra_repr(self) -> str:
        c = self.config
        return (f"experts={c.num_experts}, hidden={c.hidden_size}, intermediate={c.intermediate_size}, "
                f"top_k={c.top_k}, activation={c.activation}")
