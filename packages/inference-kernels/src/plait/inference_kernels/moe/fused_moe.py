"""The fused MoE op: routing, token permutation, grouped expert GEMMs, weighted combine.

Two public entry points, shaped like vLLM's so its plugin can wrap them directly:

* :func:`fused_experts` takes already-routed tokens (``topk_weights``, ``topk_ids``) - the
  piece a serving engine's fused-MoE method calls after its own router;
* :func:`fused_moe` adds :func:`~plait.inference_kernels.moe.routing.topk_routing` in front.

Weight layout (vLLM's and Liger's): ``w_gate_up [E, 2I, H]`` with the gate projection in rows
``[0, I)`` and the up projection in rows ``[I, 2I)``; ``w_down [E, H, I]``. The expert MLP is
``down(act(gate(x)) * up(x))``.

The work is done by plait-kernels' MoE op units, the same ones plait-moe-layers trains with:
the token permutation (:mod:`plait.kernels.ops.moe_permute`) and the grouped gated-MLP GEMM
(:mod:`plait.kernels.ops.moe_grouped`), called with ``precision="fp32"``: serving computes
``act(gate) * up`` in fp32 and rounds it once (training keeps the input dtype, as HF does; the
argument is the one difference). Without gradients on the Triton backend one fused launch pair
runs (:func:`plait.kernels.ops.moe_grouped_triton.routed_experts_triton`: the permutation folded
into the GEMMs' loads and stores, the routing weight into the down GEMM). With gradients
on the Triton backend the op units run one after another - sort by expert, gather, grouped GEMMs,
combine in fp32 - each with its Triton backward. Elsewhere :func:`fused_experts_reference` (the CPU
path and the test baseline) runs the same steps with the op units' torch paths.
"""

from __future__ import annotations

import torch

from plait.inference_kernels.input_checks import (
    check_float,
    check_index,
    check_range,
    check_same,
)
from plait.inference_kernels.moe.routing import topk_routing
from plait.kernels.dispatch import TRITON, select_backend
from plait.kernels.ops import (
    combine_rows,
    combine_rows_reference,
    grouped_gated_mlp,
    permute_by_expert,
    permute_tokens,
    permute_tokens_reference,
)
from plait.kernels.ops.moe_grouped import ACTIVATIONS, run_grouped


def validate_experts(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    check_bounds: bool,
) -> None:
    """Refuse inconsistent fused-MoE inputs before any work (see :func:`fused_experts`)."""
    check_float("hidden", hidden, ndim=2)
    check_float("w_gate_up", w_gate_up, ndim=3)
    check_float("w_down", w_down, ndim=3)
    check_index("topk_ids", topk_ids, ndim=2)
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
        raise ValueError("topk_weights must be a floating-point tensor of shape [T, top_k].")
    check_same("dtype", hidden=hidden, w_gate_up=w_gate_up, w_down=w_down)
    check_same("device", hidden=hidden, w_gate_up=w_gate_up, w_down=w_down,
               topk_weights=topk_weights, topk_ids=topk_ids)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {', '.join(ACTIVATIONS)}.")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, gate_in = w_gate_up.shape
    if two_inter % 2 or gate_in != hidden_size:
        raise ValueError(
            f"w_gate_up has shape {tuple(w_gate_up.shape)}; it must be [E, 2*I, H] with H={hidden_size} "
            f"(gate rows first, then up rows)."
        )
    if tuple(w_down.shape) != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(
            f"w_down has shape {tuple(w_down.shape)}; it must be [E, H, I] = "
            f"{(num_experts, hidden_size, two_inter // 2)} to match w_gate_up and hidden."
        )
    if topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T, top_k] with T={num_tokens} (the rows of hidden)."
        )
    if check_bounds:
        check_range("topk_ids", topk_ids, 0, num_experts,
                    fix=f"expert ids index the {num_experts} experts of w_gate_up.")


def _routed(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, activation: str, *, permute, grouped, combine) -> torch.Tensor:
    """Sort by expert, gather (``permute``), grouped GEMMs (``grouped``), combine in fp32 (``combine``)."""
    top_k = topk_ids.shape[1]
    order, counts = permute_by_expert(topk_ids.reshape(-1), w_gate_up.shape[0])
    token_of_row = order // top_k
    rows = permute(hidden, token_of_row)
    out_rows = grouped(rows, counts.to(hidden.device), w_gate_up, w_down, activation, "fp32")
    return combine(out_rows, token_of_row, topk_weights.reshape(-1).index_select(0, order), hidden.shape[0])


def fused_experts_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Fused MoE over routed tokens with the torch paths of plait-kernels' op units, on any device.

    Permute (``permute_tokens_reference``), grouped GEMMs (the torch path of
    ``grouped_gated_mlp`` with ``precision="fp32"``, as the ``plait::grouped_gated_mlp`` custom op
    unless eager autograd is recording), combine in fp32 (``combine_rows_reference``); differentiable by
    autograd. The CPU path and the test baseline. Args and Returns: as :func:`fused_experts`
    (inputs are not validated here).
    """
    return _routed(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation,
                   permute=permute_tokens_reference, grouped=_grouped_torch, combine=combine_rows_reference)


def _grouped_torch(rows, counts, w_gate_up, w_down, activation, precision):
    return run_grouped(rows, counts, w_gate_up, w_down, activation, precision, use_triton=False)


def _grouped(rows, counts, w_gate_up, w_down, activation, precision):
    return grouped_gated_mlp(rows, counts, w_gate_up, w_down, activation=activation, precision=precision)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def fused_experts(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    check_bounds: bool = True,
) -> torch.Tensor:
    """Run the experts for already-routed tokens and combine their outputs.

    ``out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, j]``.

    Args:
        hidden: ``[T, H]`` fp32/bf16/fp16 token states (any strides).
        w_gate_up: ``[E, 2I, H]``, gate rows then up rows, same dtype as ``hidden``.
        w_down: ``[E, H, I]``, same dtype.
        topk_weights: ``[T, top_k]`` combine weights (any float dtype; used in fp32).
        topk_ids: ``[T, top_k]`` int32/int64 expert ids.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, erf) or ``"gelu_tanh"``.
        check_bounds: verify ``topk_ids`` lie in ``[0, E)`` (one small device-to-host read on CUDA;
            skipped automatically during CUDA-graph capture).

    Returns:
        ``[T, H]`` in ``hidden.dtype``.

    Raises:
        ValueError: unsupported dtype or activation, inconsistent shapes, dtypes or devices,
            out-of-range expert ids; raised before any kernel runs.
    """
    validate_experts(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, check_bounds)
    if hidden.shape[0] == 0:
        return hidden.new_empty(hidden.shape)
    backend = select_backend(hidden, w_gate_up, w_down)
    if backend == TRITON and not _needs_grad(hidden, w_gate_up, w_down, topk_weights):
        from plait.kernels.ops.moe_grouped_triton import routed_experts_triton

        return routed_experts_triton(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, "fp32")
    if backend == TRITON:
        # Gradients wanted: the op units one by one, each with its Triton backward.
        return _routed(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, permute=permute_tokens,
                       grouped=_grouped, combine=combine_rows)
    return fused_experts_reference(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    router_logits: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool = True,
    activation: str = "silu",
) -> torch.Tensor:
    """A whole MoE block after the router GEMM: top-k routing, then :func:`fused_experts`.

    Args:
        hidden: ``[T, H]`` token states.
        w_gate_up: ``[E, 2I, H]`` stacked gate and up projections.
        w_down: ``[E, H, I]`` stacked down projections.
        router_logits: ``[T, E]`` router outputs.
        top_k: experts per token.
        renormalize: make each token's kept weights sum to one (Mixtral); see
            :func:`~plait.inference_kernels.moe.routing.topk_routing`.
        activation: see :func:`fused_experts`.

    Returns:
        ``[T, H]`` in ``hidden.dtype``.

    Raises:
        ValueError: as :func:`fused_experts` and :func:`topk_routing`, plus a router whose expert
            count differs from the weights'.
    """
    check_float("router_logits", router_logits, ndim=2)
    if router_logits.shape[1] != w_gate_up.shape[0] or router_logits.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"router_logits has shape {tuple(router_logits.shape)}; it must be [T, E] = "
            f"[{hidden.shape[0]}, {w_gate_up.shape[0]}] to match hidden and w_gate_up."
        )
    weights, ids = topk_routing(router_logits, top_k, renormalize=renormalize)
    # Ids from topk_routing are in range by construction: skip the bounds check and its sync.
    return fused_experts(hidden, w_gate_up, w_down, weights, ids, activation=activation, check_bounds=False)
