"""plait's layers as vLLM out-of-tree custom ops (``CustomOp.register_oot``).

Each class subclasses vLLM's in-tree layer and keeps its ``__init__`` signature, so vLLM's
``CustomOp.__new__`` can build it wherever a model asks for the in-tree class. Dispatch:

* ``forward_cuda``: plait's public op (``plait.kernels.ops``), which runs its Triton kernel on
  CUDA tensors (and its torch reference where Triton is missing).
* ``forward_cpu``: per op, whichever of vLLM's own CPU path and plait's torch reference measured
  faster on the CPU machine (:data:`CPU_PATH`; ``PLAIT_VLLM_CPU_PATH`` overrides it for all ops).
* ``forward_native`` (what vLLM uses when the op is disabled, e.g. under Inductor with
  ``custom_ops=["none"]``, and what it compiles): vLLM's own, unchanged, so torch.compile sees
  the graph it was written for. (The MoE method is the exception, below: once it has kept the
  expert weights in plait's layout, every path runs plait's.)

Cases plait does not cover (vLLM's batch-invariant mode, RMSNorm's ``var_hidden_size``, rotary
with FlashInfer or AITER) fall through to vLLM's own method. After ``register_oot`` (which names a
class after its registry key), each class gets back its in-tree op name (``rms_norm``,
``silu_and_mul``, ...), so ``compilation_config.custom_ops`` entries such as ``-rms_norm`` keep
their meaning with plait installed.
"""

from __future__ import annotations

import logging

import torch
from vllm import envs
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from plait.inference_kernels import ACTIVATIONS as MOE_ACTIVATIONS
from plait.inference_kernels import fused_experts, fused_experts_reference
from plait.kernels.ops import apply_rotary, gelu_and_mul, rms_norm, silu_and_mul
from plait.kernels.ops.gated_activation import gated_activation_reference
from plait.kernels.ops.rms_norm import rms_norm_reference
from plait.vllm import settings

logger = logging.getLogger("plait.vllm")

CPU_PATH = {
    "RMSNorm": "vllm",
    "RMSNorm+residual": "plait",
    "SiluAndMul": "vllm",
    "GeluAndMul": "vllm",
    "RotaryEmbedding": "vllm",
    "UnquantizedFusedMoEMethod": "vllm",
}
"""Per op, the faster CPU implementation as measured by ``benchmarks/cpu_ops.py`` (figures in the
README): ``"vllm"`` (vLLM's own CPU path) or ``"plait"`` (plait's torch reference)."""


def use_plait_on_cpu(op: str) -> bool:
    """Whether ``op``'s ``forward_cpu`` runs plait's reference (``PLAIT_VLLM_CPU_PATH``, else :data:`CPU_PATH`).

    Each layer asks once, when it is built, so the forward pays no environment lookup.
    """
    choice = settings.cpu_path()
    if choice == "auto":
        choice = CPU_PATH[op]
    return choice == "plait"


class PlaitRMSNorm(RMSNorm):
    """vLLM's ``RMSNorm`` (optionally fused with the residual add) served by plait's ``rms_norm``.

    With a residual it returns ``(normed, x + residual)``, out of place: vLLM's models use the
    returned pair, never the inputs, after the call.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._plait_cpu = use_plait_on_cpu("RMSNorm")
        self._plait_cpu_residual = use_plait_on_cpu("RMSNorm+residual")

    def _plait_covers(self) -> bool:
        return self.variance_size_override is None and not envs.VLLM_BATCH_INVARIANT

    def _weight(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.data if self.has_weight else torch.ones_like(self.weight, dtype=x.dtype, device=x.device)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """plait's ``rms_norm`` (its Triton kernel on CUDA)."""
        if not self._plait_covers():
            return super().forward_cuda(x, residual)
        return rms_norm(x, self._weight(x), self.variance_epsilon, residual=residual)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The measured-faster CPU path: vLLM's, or plait's ``rms_norm_reference``."""
        plait_cpu = self._plait_cpu if residual is None else self._plait_cpu_residual
        if not (plait_cpu and self._plait_covers()):
            return super().forward_cpu(x, residual)
        return rms_norm_reference(x, self._weight(x), self.variance_epsilon, residual=residual)


class PlaitSiluAndMul(SiluAndMul):
    """vLLM's ``SiluAndMul`` (SwiGLU on a fused gate|up input) served by plait's ``silu_and_mul``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._plait_cpu = use_plait_on_cpu("SiluAndMul")

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """plait's ``silu_and_mul`` (its Triton kernel on CUDA)."""
        return silu_and_mul(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The measured-faster CPU path: vLLM's, or plait's reference."""
        if not self._plait_cpu:
            return super().forward_cpu(x)
        return gated_activation_reference(x, "silu")


class PlaitGeluAndMul(GeluAndMul):
    """vLLM's ``GeluAndMul`` (GeGLU, exact or tanh GELU) served by plait's ``gelu_and_mul``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._plait_cpu = use_plait_on_cpu("GeluAndMul")

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """plait's ``gelu_and_mul`` (its Triton kernel on CUDA)."""
        return gelu_and_mul(x, self.approximate)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The measured-faster CPU path: vLLM's, or plait's reference."""
        if not self._plait_cpu:
            return super().forward_cpu(x)
        return gated_activation_reference(x, "gelu" if self.approximate == "none" else "gelu_tanh")


class PlaitRotaryEmbedding(RotaryEmbedding):
    """vLLM's plain ``RotaryEmbedding`` (not its scaled subclasses) served by plait's ``apply_rotary``.

    Rotates q and k in place, as vLLM's own CUDA and CPU kernels do, from the layer's cos|sin
    cache (vLLM's layout is the one plait's op reads).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._plait_cpu = use_plait_on_cpu("RotaryEmbedding")

    def _plait_covers(self) -> bool:
        return not (self.use_flashinfer or self.use_aiter)

    def _apply(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None):
        cache = self._match_cos_sin_cache_dtype(query)
        return apply_rotary(query, key, cache, positions, head_size=self.head_size, rotary_dim=self.rotary_dim,
                            is_neox=self.is_neox_style, validate_positions=False)

    def forward_cuda(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        """plait's ``apply_rotary`` (its Triton kernel on CUDA), in place."""
        if not self._plait_covers():
            return super().forward_cuda(positions, query, key)
        return self._apply(positions, query, key)

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        """The measured-faster CPU path: vLLM's, or plait's in-place reference."""
        if not (self._plait_cpu and self._plait_covers()):
            return super().forward_cpu(positions, query, key)
        return self._apply(positions, query, key)


class PlaitUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method served by plait's ``fused_experts`` (Triton on CUDA).

    plait's kernel reads the expert weights in vLLM's checkpoint layout (``w13_weight`` ``[E, 2I, H]``,
    gate rows first; ``w2_weight`` ``[E, H, I]``), so a layer plait serves skips vLLM's weight
    processing (its CPU backend prepacks the weights into its own grouped-GEMM layout; others pad or
    shuffle them) and builds no vLLM kernel. That choice is made once per layer, in
    ``process_weights_after_loading``, and only where plait covers the layer: a gated activation
    plait has (silu, gelu, gelu_tanh), no bias, no expert map (expert parallelism), router weights
    applied after the experts, weights not pre-processed, and not a monolithic vLLM backend. On CPU
    it is also the measured choice (:data:`CPU_PATH`). Everything else stays vLLM's.

    Shared experts: without a vLLM kernel, ``mk_can_overlap_shared_experts`` is False, so vLLM's
    MoE runner runs them itself, outside this method, as it does for kernels that cannot overlap them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._plait_activation = str(getattr(self.moe.activation, "value", self.moe.activation)).lower()
        from vllm.platforms import current_platform

        wanted = use_plait_on_cpu("UnquantizedFusedMoEMethod") if current_platform.is_cpu() else True
        self._plait = (wanted and self._plait_activation in MOE_ACTIVATIONS and not self.moe.has_bias
                       and not super().is_monolithic)

    def process_weights_after_loading(self, layer) -> None:
        """Keep the loaded weights as they are for plait's kernel, or hand the layer to vLLM's processing."""
        from vllm.model_executor.utils import is_weights_pre_processed

        if self._plait and (getattr(layer, "expert_map", None) is not None
                            or getattr(layer, "apply_router_weight_on_input", False) or is_weights_pre_processed()):
            self._plait = False
        if not self._plait:
            super().process_weights_after_loading(layer)
            return
        super(UnquantizedFusedMoEMethod, self).process_weights_after_loading(layer)

    def _plait_experts(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        if x.is_cuda:
            return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                 activation=self._plait_activation, check_bounds=False)
        return fused_experts_reference(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                       self._plait_activation)

    def forward_native(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        """plait's experts where this layer kept plait's layout, else vLLM's kernel."""
        if not self._plait:
            return super().forward_native(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return self._plait_experts(layer, x, topk_weights, topk_ids)

    def forward_cuda(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        """plait's ``fused_experts`` (its Triton kernel), or vLLM's where plait does not cover the layer."""
        if not self._plait:
            return super().forward_cuda(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return self._plait_experts(layer, x, topk_weights, topk_ids)

    def forward_cpu(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        """plait's reference where chosen for this layer, else vLLM's CPU kernel."""
        if not self._plait:
            return super().forward_cpu(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return self._plait_experts(layer, x, topk_weights, topk_ids)


PLAIT_OPS: dict[str, type[CustomOp]] = {
    "RMSNorm": PlaitRMSNorm,
    "SiluAndMul": PlaitSiluAndMul,
    "GeluAndMul": PlaitGeluAndMul,
    "RotaryEmbedding": PlaitRotaryEmbedding,
    "UnquantizedFusedMoEMethod": PlaitUnquantizedFusedMoEMethod,
}
"""In-tree class name (vLLM's out-of-tree registry key) -> plait's class."""


def register_ops() -> tuple[str, ...]:
    """Put :data:`PLAIT_OPS` into vLLM's out-of-tree registry; a second call changes nothing.

    A key another plugin already holds is left to it (one warning): vLLM asserts on duplicates,
    and the first registrant wins.

    Returns:
        The keys that hold plait's classes after the call.
    """
    held = []
    for key, cls in PLAIT_OPS.items():
        current = op_registry_oot.get(key)
        if current is cls:
            held.append(key)
            continue
        if current is not None:
            logger.warning("plait.vllm: %s is already registered out of tree by %s.%s; plait leaves it there.",
                           key, current.__module__, current.__qualname__)
            continue
        in_tree_name = cls.name  # inherited from the in-tree class, e.g. "rms_norm"
        CustomOp.register_oot(_decorated_op_cls=cls, name=key)
        cls.name = in_tree_name  # register_oot renamed it to the key; keep custom_ops flags working
        held.append(key)
    return tuple(held)
