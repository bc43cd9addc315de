"""The MoE layer for plain torch: router, experts, dispatch/combine, optional residual MLP.

``MoE(config)(x)`` returns ``x``-shaped output, so the layer drops into any model in place of an
MLP (HF decoder layers included). The auxiliary losses of the last forward are on
``layer.last_losses`` and returned by ``layer(x, return_losses=True)``;
:func:`collect_losses` sums them over a whole model for the training loss.

Pyramid MoE (DeepSpeed-MoE's PR-MoE) is a model whose layers use different ``num_experts``: each
layer has its own :class:`MoEConfig`, and expert parallelism shards every layer by the same
``ep`` (each layer's expert count must be divisible by it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.moe_layers.config import MoEConfig
from plait.moe_layers.dispatch import dispatch_combine
from plait.moe_layers.experts import GatedExperts, ModuleExperts
from plait.moe_layers.router import MoELosses, Router, load_balancing_loss, router_z_loss


class DenseGatedMLP(nn.Module):
    """``down(act(gate x) * up x)``: the dense branch of a Residual MoE."""

    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., H]``."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(
            gate, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(act * up)


class MoE(nn.Module):
    """A Mixture-of-Experts layer (see the module docstring and :class:`MoEConfig`).

    Args:
        config: what the layer computes.
        experts: optional user expert modules (``[n, H] -> [n, H]`` each, exactly
            ``config.num_experts`` of them); by default the stacked gated MLP
            (:class:`~plait.moe_layers.experts.GatedExperts`) runs as grouped GEMMs.

    Raises:
        ValueError: ``experts`` does not hold ``config.num_experts`` modules.
    """

    def __init__(self, config: MoEConfig, *, experts: Sequence[nn.Module] | None = None) -> None:
        super().__init__()
        if experts is not None and len(experts) != config.num_experts:
            raise ValueError(
                f"MoE got {len(experts)} expert modules but MoEConfig.num_experts={config.num_experts}; "
                "pass exactly one module per expert."
            )
        self.config = config
        self.router = Router(config)
        self.experts: nn.Module = (ModuleExperts(experts) if experts is not None else
                                   GatedExperts(config.num_experts, config.hidden_size, config.intermediate_size,
                                                config.activation))
        if config.residual:
            self.dense = DenseGatedMLP(config.hidden_size, config.intermediate_size, config.activation)
            self.coefficient = nn.Linear(config.hidden_size, 2)
        self.ep_group: Any | None = None
        self.ep_size = 1
        self.last_losses: MoELosses | None = None
        # How this layer's collectives are named in plait's flight log (apply_expert_parallel
        # puts the module's path in it).
        self.comm_label = "MoE layer"

    def _counted(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """The assignments the load-balancing loss counts (``MoEConfig.aux_loss_choices``)."""
        return expert_ids[:, :1] if self.config.aux_loss_choices == "first" else expert_ids

    def forward(self, x: torch.Tensor, *, return_losses: bool = False) -> torch.Tensor | tuple[torch.Tensor, MoELosses]:
        """Route, run the experts and combine.

        Args:
            x: ``[..., H]`` tokens (any leading shape).
            return_losses: also return this forward's :class:`MoELosses`.

        Returns:
            ``x``-shaped output, or ``(output, losses)``.

        Raises:
            ValueError: the last dimension of ``x`` is not ``hidden_size``.
        """
        if x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"MoE input has last dimension {x.shape[-1]}; MoEConfig.hidden_size is "
                             f"{self.config.hidden_size}.")
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat)
        out, load = dispatch_combine(flat, routing, self.experts, self.config.num_experts, self.ep_group,
                                     self.ep_size, label=self.comm_label)
        if self.config.residual:
            mix = F.softmax(self.coefficient(flat), dim=-1)
            dense = self.dense(flat)
            dense = dense[0] if isinstance(dense, tuple) else dense  # an (output, bias) module as the dense MLP
            out = out * mix[:, :1] + dense * mix[:, 1:]
        self.last_losses = MoELosses(
            load_balancing=load_balancing_loss(routing.probs, self._counted(routing.expert_ids)),
            z_loss=router_z_loss(routing.logits), expert_load=load,
            kept=routing.kept,
        )
        out = out.view(x.shape)
        return (out, self.last_losses) if return_losses else out


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every :class:`MoE` inside ``model``, in module order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def collect_losses(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the load-balancing losses and of the z-losses of the last forward of every MoE layer.

    Typical use: ``loss = lm_loss + 0.01 * balance + 0.001 * z``.

    Args:
        model: a model containing :class:`MoE` layers.

    Returns:
        ``(load_balancing, z_loss)`` scalar tensors.

    Raises:
        ValueError: the model has no MoE layer, or one has not run a forward yet.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError("collect_losses: the model has no plait MoE layer; convert or build one first.")
    if any(layer.last_losses is None for layer in layers):
        raise ValueError("collect_losses: an MoE layer has not run a forward yet; call the model first.")
    balance = sum(layer.last_losses.load_balancing for layer in layers)
    z_loss = sum(layer.last_losses.z_loss for layer in layers)
    return balance, z_loss
