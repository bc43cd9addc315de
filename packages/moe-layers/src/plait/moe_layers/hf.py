"""Convert HF transformers MoE blocks to plait MoE layers and back (weights kept, logits unchanged).

Supported blocks (transformers 5.19-5.23, whose experts are stacked ``gate_up_proj [E, 2I, H]``
and ``down_proj [E, H, I]``, the layout plait uses, so no weight is copied):

* ``MixtralSparseMoeBlock``: softmax, top-k, renormalise; ``router_jitter_noise`` -> ``noise="jitter"``;
* ``Qwen3MoeSparseMoeBlock``: as Mixtral, renormalisation from ``norm_topk_prob``;
* ``Qwen2MoeSparseMoeBlock``: as Qwen3 plus a shared expert mixed in by a sigmoid gate
  (:class:`SharedExpertMoE` keeps HF's shared-expert modules as they are);
* ``PhimoeSparseMoeBlock`` (Phi-3.5-MoE, the GRIN authors' model): ``router_gradient="grin"`` with
  ``grin_eps`` = ``router_jitter_noise``; ``input_jitter_noise`` -> ``noise="jitter"`` (HF multiplies
  the input by the jitter twice in training, in the block and in its router; plait once).

The converted layer shares the HF parameters (same ``nn.Parameter`` objects), so training the
converted model trains the HF weights, and :func:`restore_hf_moe` puts the HF blocks back with
whatever was learned. Routing is dropless, as in HF; set ``capacity_factor`` etc. through
``overrides``. This module imports transformers only when called (it is an optional extra).
This adapter is listed in ``docs/patches.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from plait.moe_layers.config import MoEConfig
from plait.moe_layers.layer import MoE

SUPPORTED_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock",
                    "PhimoeSparseMoeBlock")
SUPPORTED_TRANSFORMERS = ((5, 19), (5, 24))  # [min, max): the stacked-experts layout of 5.x
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_ORIGINAL = "_plait_hf_original"


class SharedExpertMoE(nn.Module):
    """A plait :class:`MoE` plus Qwen2-MoE's shared expert: ``moe(x) + sigmoid(g x) * shared(x)``.

    Args:
        moe: the routed experts.
        shared_expert: HF's shared MLP (kept as is).
        shared_expert_gate: HF's ``Linear(H, 1)`` gate (kept as is).
    """

    def __init__(self, moe: MoE, shared_expert: nn.Module, shared_expert_gate: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., H]``."""
        return self.moe(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def _check_transformers() -> None:
    import transformers

    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= version < high:
        raise RuntimeError(
            f"plait.moe_layers.hf supports transformers {low[0]}.{low[1]} to <{high[0]}.{high[1]} (stacked "
            f"experts); found {transformers.__version__}. Install 'plait-moe-layers[hf]'."
        )


def _activation_name(config: Any) -> str:
    name = getattr(config, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"HF hidden_act={name!r} has no plait expert activation; supported: {sorted(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


def _routing_settings(block: nn.Module) -> dict[str, Any]:
    """The router's MoEConfig fields of an HF block (PhiMoE routes with GRIN, the others top-k)."""
    if hasattr(block, "router"):  # PhimoeSparseMoeBlock
        router = block.router
        return {"top_k": router.top_k, "router_gradient": "grin", "grin_eps": float(router.router_jitter_noise),
                "jitter": float(block.input_jitter_noise or 0.0)}
    gate = block.gate
    return {"top_k": gate.top_k, "renormalize": bool(getattr(gate, "norm_topk_prob", True)),
            "jitter": float(getattr(block, "jitter_noise", 0.0) or 0.0)}


def _plait_layer(block: nn.Module, config: Any, overrides: dict[str, Any]) -> MoE:
    gate, experts = (block.router if hasattr(block, "router") else block.gate), block.experts
    num_experts, two_inter, hidden = experts.gate_up_proj.shape
    routing = _routing_settings(block)
    jitter = routing.pop("jitter")
    settings = {
        "hidden_size": hidden, "num_experts": num_experts, "intermediate_size": two_inter // 2,
        "activation": _activation_name(config), **routing,
        **({"noise": "jitter", "noise_eps": jitter} if jitter > 0 else {}),
        **overrides,
    }
    layer = MoE(MoEConfig(**settings))
    layer.router.weight = gate.weight
    layer.experts.gate_up_proj = experts.gate_up_proj
    layer.experts.down_proj = experts.down_proj
    for param in (experts.gate_up_proj, experts.down_proj):
        param._plait_moe_expert = True
    # A fresh module is in training mode; the block's mode decides noise, sampling and capacity.
    return layer.to(device=gate.weight.device).train(block.training)


def convert_hf_moe(model: nn.Module, **overrides: Any) -> int:
    """Replace every supported HF sparse-MoE block of ``model`` with a plait layer (in place).

    Idempotent: converted blocks are skipped. Logits are unchanged (fp32 routing as HF does).

    Args:
        model: an HF ``PreTrainedModel`` (or any module containing supported blocks).
        **overrides: :class:`MoEConfig` fields to change, e.g. ``capacity_factor=1.25``.

    Returns:
        The number of blocks converted in this call.

    Raises:
        RuntimeError: unsupported transformers version.
        ValueError: no supported block found and none converted before, or an unknown activation.
    """
    _check_transformers()
    unknown = set(overrides) - {f.name for f in dataclasses.fields(MoEConfig)}
    if unknown:
        raise ValueError(f"convert_hf_moe: {sorted(unknown)} are not MoEConfig fields.")
    config = getattr(model, "config", None)
    targets = [(name, module) for name, module in model.named_modules() if type(module).__name__ in SUPPORTED_BLOCKS]
    if not targets and not _converted(model):
        raise ValueError(f"convert_hf_moe found no {' / '.join(SUPPORTED_BLOCKS)} in {type(model).__name__}.")
    for name, block in targets:
        layer: nn.Module = _plait_layer(block, config, overrides)
        if hasattr(block, "shared_expert"):
            layer = SharedExpertMoE(layer, block.shared_expert, block.shared_expert_gate)
        object.__setattr__(layer, _ORIGINAL, block)  # not a submodule: no duplicate parameters
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return len(targets)


def _converted(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if hasattr(module, _ORIGINAL)]


def restore_hf_moe(model: nn.Module) -> int:
    """Put the HF blocks back (they share the converted layers' parameters, so training is kept).

    Args:
        model: a model converted by :func:`convert_hf_moe`.

    Returns:
        The number of blocks restored.

    Raises:
        ValueError: a converted layer was made expert-parallel (its experts no longer match the
            HF block's full set).
    """
    restored = 0
    for name, layer in _converted(model):
        moe = layer.moe if isinstance(layer, SharedExpertMoE) else layer
        if moe.ep_size > 1:
            raise ValueError(f"restore_hf_moe: {name} is expert-parallel (ep_size={moe.ep_size}); gather its "
                             "experts (save a full checkpoint) before restoring the HF block.")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, getattr(layer, _ORIGINAL))
        restored += 1
    return restored

