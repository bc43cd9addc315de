"""Mixture-of-Experts token permutation and the grouped gated-MLP GEMM, with backward.

A MoE layer hands each (token, slot) assignment to one expert. Two steps sit between the
router and the experts' GEMMs, and the same two are needed for training and for serving:

1. :func:`permute_by_expert` sorts the assignments by expert (stable, so within an expert the
   original order is kept) and counts the rows of each expert: the rows of one expert become one
   contiguous segment.
2. :func:`grouped_gated_mlp` runs every expert's gated MLP ``down(act(gate(x)) * up(x))`` on its
   segment, with the stacked weight layout of vLLM, Liger and HF transformers 5.x
   (``w_gate_up [E, 2I, H]``: gate rows then up rows; ``w_down [E, H, I]``).

The grouped path runs torch's grouped GEMM (``torch.nn.functional.grouped_mm``, forward and
backward, CPU and CUDA) over the segments' offsets: two GEMM calls for all experts, no padding.
Where that op is missing or its 16-byte stride rule is not met (``H`` or ``I`` times the element
size not a multiple of 16), the segments are scattered into one zero-padded
``[E, max_rows, H]`` buffer and run as two ``torch.bmm``; padding wastes work when the load is
very uneven, so that path falls back to the loop once the padded buffer would exceed
``MAX_PADDING_FACTOR`` times the real rows. The reference (:func:`grouped_gated_mlp_reference`,
the test oracle) loops over the experts with one GEMM pair per non-empty segment. All are built
from differentiable torch ops, so autograd gives the backward; every path keeps every expert's
weights in the graph, so an expert that got no rows receives a zero gradient rather than none
(distributed gradient reductions then see the same tensors on every rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_PADDING_FACTOR = 4
"""The grouped path pads to at most this many times the real rows, else it loops (see module doc)."""

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes torch's grouped GEMM takes; others (float64 in tests) use the padded path."""

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
"""Gate activations: SwiGLU (``silu``), GeGLU with erf (``gelu``) or tanh (``gelu_tanh``) GELU."""


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def permute_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order assignments by expert and count each expert's rows.

    Args:
        expert_ids: ``[N]`` integer expert id of each assignment, in ``[0, num_experts)``.
        num_experts: the number of experts (segments), so empty experts get a count of 0.

    Returns:
        ``(order, counts)``: ``order`` ``[N]`` int64 such that ``expert_ids[order]`` is sorted
        (stable), and ``counts`` ``[num_experts]`` int64 rows per expert.

    Raises:
        ValueError: ``expert_ids`` is not a 1-D integer tensor or ``num_experts < 1``.
    """
    if expert_ids.dim() != 1 or expert_ids.is_floating_point() or expert_ids.is_complex():
        raise ValueError(f"expert_ids must be a 1-D integer tensor, got {expert_ids.dtype} {tuple(expert_ids.shape)}.")
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1.")
    ids = expert_ids.to(torch.int64)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num_experts)
    return order, counts


def check_grouped_inputs(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor, activation: str) -> None:
    """Refuse inconsistent grouped-MLP inputs before any work (see :func:`grouped_gated_mlp`)."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"x must be [N, H], w_gate_up [E, 2I, H] and w_down [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}."
        )
    experts, two_inter, hidden = w_gate_up.shape
    if two_inter % 2 or hidden != x.shape[1] or tuple(w_down.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit x {tuple(x.shape)}: "
            f"need w_gate_up [E, 2I, H={x.shape[1]}] (gate rows first) and w_down [E, H, I]."
        )
    if counts.dim() != 1 or counts.numel() != experts:
        raise ValueError(f"counts must be [E={experts}] rows per expert, got shape {tuple(counts.shape)}.")
    if int(counts.sum()) != x.shape[0]:
        raise ValueError(f"counts sum to {int(counts.sum())} but x has {x.shape[0]} rows; they must match.")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {', '.join(ACTIVATIONS)}.")


def grouped_gated_mlp_reference(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                                w_down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Per-expert loop over contiguous segments (the oracle; inputs not validated).

    Args and Returns: as :func:`grouped_gated_mlp`.
    """
    inter = w_down.shape[2]
    outputs = []
    start = 0
    # unbind: one gradient stack per weight in backward (indexing w[e] would add a full-size
    # zero gradient per expert).
    for count, w_gu, w_d in zip(counts.tolist(), w_gate_up.unbind(0), w_down.unbind(0)):
        if count == 0:
            continue
        gate_up = F.linear(x[start:start + count], w_gu)
        act = _activate(gate_up[:, :inter], activation) * gate_up[:, inter:]
        outputs.append(F.linear(act, w_d))
        start += count
    if not outputs:
        # No rows: keep x and the weights in the graph so their gradients are zeros, not None.
        return x.new_zeros(0, w_down.shape[1]) + 0 * (x.sum() + w_gate_up.sum() + w_down.sum())
    return torch.cat(outputs)


def _padded_rows(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row index of each segment row inside the ``[E * max_rows]`` padded buffer."""
    max_rows = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    position = torch.arange(expert_of_row.numel(), device=counts.device) - starts[expert_of_row]
    return expert_of_row * max_rows + position, max_rows


def _grouped_mm_fits(x: torch.Tensor, inter: int) -> bool:
    """torch's grouped GEMM exists here and its operands meet its 16-byte stride rule."""
    size = x.element_size()
    return (hasattr(F, "grouped_mm") and x.dtype in GROUPED_MM_DTYPES and x.is_contiguous()
            and (x.shape[1] * size) % 16 == 0 and (inter * size) % 16 == 0)


def grouped_gated_mlp(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      *, activation: str = "silu") -> torch.Tensor:
    """Every expert's gated MLP on its contiguous segment of ``x``, as batched GEMMs.

    ``out[rows of e] = down_e(act(gate_e(x)) * up_e(x))`` where the rows of expert ``e`` are
    ``x[sum(counts[:e]) : sum(counts[:e+1])]`` (see :func:`permute_by_expert`).

    Args:
        x: ``[N, H]`` rows sorted by expert.
        counts: ``[E]`` integer rows per expert, summing to ``N``.
        w_gate_up: ``[E, 2I, H]``, gate rows then up rows.
        w_down: ``[E, H, I]``.
        activation: one of :data:`ACTIVATIONS`.

    Returns:
        ``[N, H]`` in ``x``'s dtype; differentiable in ``x`` and both weights.

    Raises:
        ValueError: inconsistent shapes, counts that do not sum to ``N``, an unknown activation.
    """
    check_grouped_inputs(x, counts, w_gate_up, w_down, activation)
    experts, hidden, inter = w_down.shape
    counts = counts.to(device=x.device, dtype=torch.int64)
    if _grouped_mm_fits(x, inter):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = F.grouped_mm(x, w_gate_up.transpose(1, 2), offs=offsets)
        act = _activate(gate_up[:, :inter], activation) * gate_up[:, inter:]
        return F.grouped_mm(act, w_down.transpose(1, 2), offs=offsets)
    rows, max_rows = _padded_rows(counts)
    if experts * max_rows > MAX_PADDING_FACTOR * max(x.shape[0], 1):
        return grouped_gated_mlp_reference(x, counts, w_gate_up, w_down, activation)
    padded = x.new_zeros(experts * max_rows, hidden).index_copy(0, rows, x).view(experts, max_rows, hidden)
    gate_up = torch.bmm(padded, w_gate_up.transpose(1, 2))
    act = _activate(gate_up[..., :inter], activation) * gate_up[..., inter:]
    out = torch.bmm(act, w_down.transpose(1, 2)).reshape(experts * max_rows, hidden)
    return out.index_select(0, rows)
