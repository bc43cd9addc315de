"""The experts: the standard stacked gated MLP, or expert modules the user supplies.

Both kinds take rows already sorted by (local) expert plus the rows per expert and return one
output row per input row. Under expert parallelism each rank keeps a contiguous block of
``E / ep`` experts; ``first_expert`` records which, so a checkpoint can name each local expert by
its global index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.kernels.ops import grouped_gated_mlp

EXPERT_ATTR = "_plait_moe_expert"
"""Attribute set to ``True`` on every expert parameter (see :func:`plait.moe_layers.expert_parameters`)."""


def _mark(module: nn.Module) -> None:
    for param in module.parameters():
        setattr(param, EXPERT_ATTR, True)


class GatedExperts(nn.Module):
    """``E_local`` SwiGLU-style experts stored as two stacked weights, run as grouped GEMMs.

    Layout (HF transformers 5.x ``MixtralExperts``, vLLM): ``gate_up_proj [E, 2I, H]`` with gate
    rows first, ``down_proj [E, H, I]``.

    Args:
        num_experts: experts held by this module (all of them until sharded).
        hidden_size: ``H``.
        intermediate_size: ``I``.
        activation: see :data:`plait.kernels.ops.moe_grouped.ACTIVATIONS`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.num_experts = num_experts
        self.first_expert = 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Same scale as nn.Linear's default (kaiming-uniform, a=sqrt(5)) per expert.
        nn.init.uniform_(self.gate_up_proj, -1 / math.sqrt(hidden_size), 1 / math.sqrt(hidden_size))
        nn.init.uniform_(self.down_proj, -1 / math.sqrt(intermediate_size), 1 / math.sqrt(intermediate_size))
        _mark(self)

    @property
    def local_experts(self) -> int:
        """Experts held on this rank."""
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, H]`` sorted by local expert, ``counts`` ``[E_local]``; returns ``[N, H]``."""
        return grouped_gated_mlp(x, counts, self.gate_up_proj, self.down_proj, activation=self.activation)

    def shard(self, rank: int, size: int) -> None:
        """Keep only experts ``[rank * E/size, (rank + 1) * E/size)`` (in place, once)."""
        per_rank = self.local_experts // size
        start = rank * per_rank
        with torch.no_grad():
            self.gate_up_proj = nn.Parameter(self.gate_up_proj[start:start + per_rank].clone())
            self.down_proj = nn.Parameter(self.down_proj[start:start + per_rank].clone())
        self.first_expert = start
        _mark(self)


def _output(out: Any) -> torch.Tensor:
    """An expert's output tensor: ``(output, bias)`` experts (Megatron's) give the output, as DeepSpeed takes it."""
    return out[0] if isinstance(out, tuple) else out


class ModuleExperts(nn.Module):
    """Experts given as arbitrary modules mapping ``[n, H] -> [n, H]``, run one after another.

    Under torch.compile the experts run masked instead (see :meth:`forward`): each expert on every
    row, each row keeping its own expert's output. That needs row-wise experts (a row's output
    depends on that row only, as for MLPs) and costs ``E_local`` times the expert compute.

    Args:
        experts: one module per expert, all of them (sharding keeps a block).
    """

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(self.experts)
        self.first_expert = 0
        _mark(self)

    @property
    def local_experts(self) -> int:
        """Experts held on this rank."""
        return len(self.experts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """As :meth:`GatedExperts.forward`; an expert without rows still joins the graph (zero
        gradients, never ``None``, so gradient reductions see the same tensors on every rank)."""
        if torch.compiler.is_compiling():
            return self._masked(x, counts)
        outputs = []
        start = 0
        for expert, count in zip(self.experts, counts.tolist()):
            out = _output(expert(x[start:start + count]))
            if count == 0:
                out = out + 0 * sum(p.sum() for p in expert.parameters())
            outputs.append(out)
            start += count
        return torch.cat(outputs) if outputs else x

    def _masked(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The compiled form: every expert on all ``N`` rows, ``where`` keeps each row's own expert.

        Why: eager's segments have data-dependent sizes (``counts.tolist()``: a graph break, and a
        graph per distinct split). ``where`` selects, it does not add, so a row's output is its own
        expert's output bit for bit whenever the expert computes a row the same way in a batch of
        ``N`` as in its segment, and the other experts' outputs get exact zero gradients (so every
        expert still gets a gradient, as in eager).
        """
        ends = torch.cumsum(counts, 0)
        row_expert = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device), right=True).unsqueeze(-1)
        result = None
        for index, expert in enumerate(self.experts):
            out = _output(expert(x))
            result = torch.where(row_expert == index, out, 0.0 if result is None else result)
        return x if result is None else result

    def shard(self, rank: int, size: int) -> None:
        """Keep only experts ``[rank * E/size, (rank + 1) * E/size)`` (in place, once)."""
        per_rank = self.local_experts // size
        start = rank * per_rank
        self.experts = nn.ModuleList(list(self.experts)[start:start + per_rank])
        self.first_expert = start
