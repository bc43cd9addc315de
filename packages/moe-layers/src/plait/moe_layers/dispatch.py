"""Token dispatch to the experts and combine, on one rank or across an expert-parallel group.

One rank: the kept (token, slot) assignments are sorted by expert, their tokens gathered, run
through the experts as one grouped GEMM, weighted and summed back per token. The sort, the gather
and the weighted sum are plait-kernels' token-permutation op unit
(:mod:`plait.kernels.ops.moe_permute`) and the experts its grouped GEMM
(:mod:`plait.kernels.ops.moe_grouped`): the ops plait-inference-kernels serves with.

Expert parallel (``ep`` ranks, rank ``r`` holding experts ``[r * E/ep, (r + 1) * E/ep)``):

1. the ``E`` per-expert row counts are exchanged first (one all-to-all of ``E`` int64), so each
   rank knows how many rows it will receive from whom: the exchange of rows is uneven;
2. rows go out in expert order, so the rows for rank ``r`` are one contiguous block (all-to-all,
   uneven splits);
3. the received rows (grouped by source rank, then expert) are regrouped by local expert, run,
   put back in arrival order and returned by the reverse all-to-all;
4. the combine weights and the sum over a token's slots are applied on the token's own rank.

Every exchange is named in plait's flight log (``MoE layer `layers.1.mlp` token dispatch
all-to-all``; backward adds ``(backward)``), so a rank that never enters one is named, with the
exchange, in the others' :class:`~plait.kernels.collectives.CollectiveError`.

Both all-to-alls are ``plait.kernels.collectives.all_to_all_rows`` (a custom op, one node of a
compiled graph) whose backward is the reverse exchange, so each rank's
backward returns gradient rows to where the tokens came from and the experts' weight gradients
collect every rank's contribution. Logical bytes per layer and rank (counted by the ledger):
forward ``8 E + (S + R) H b``, backward ``(S + R) H b``, with ``S`` the rows this rank sends
(its kept assignments), ``R`` the rows it receives, ``b`` the activation's bytes per element.

Under torch.compile, expert-parallel dispatch takes the custom ops of
:mod:`plait.moe_layers.dispatch_ops` instead (static, capacity-sized buffers, the same exchanges
and bytes): a compiled block holding the MoE layer is one graph with no recompiles. On one rank
(``ep_size=1``) it takes their static-shape local form (no ``nonzero``), also one graph.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.kernels import collectives
from plait.kernels.eager import eager_only
from plait.kernels.ops import combine_rows, permute_by_expert, permute_tokens
from plait.moe_layers.dispatch_ops import traced_dispatch_combine, traced_local_dispatch_combine
from plait.moe_layers.router import Routing


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: Any,
                    name: str = "MoE all-to-all") -> torch.Tensor:
    """Differentiable uneven all-to-all: send ``send[i]`` rows to rank ``i``, receive ``recv[i]``.

    Args:
        rows: ``[sum(send), ...]`` rows, the block for rank 0 first.
        send: rows to each rank of ``group``.
        recv: rows from each rank of ``group`` (from a count exchange).
        group: the process group.
        name: the exchange's name in plait's flight log (its backward adds ``(backward)``).

    Returns:
        ``[sum(recv), ...]`` rows, rank 0's block first.
    """
    return collectives.all_to_all_rows(rows, send, recv, group, name)


# Eager only: the split sizes of the row exchange are the other ranks' routing decisions, known only
# after this exchange, as Python ints. Under torch.compile, dispatch_combine takes the custom ops of
# dispatch_ops instead; the disable stays for a caller that compiles this function directly.
@eager_only
def _exchange_counts(counts: torch.Tensor, group: Any, ep_size: int,
                     label: str) -> tuple[torch.Tensor, list[int], list[int]]:
    """Step 1: per-expert counts from every rank, and the rows to send to / receive from each."""
    local = counts.numel() // ep_size
    recv_counts = torch.empty_like(counts)
    collectives.all_to_all_single(recv_counts, counts, group=group, name=f"{label} token-count exchange")
    return recv_counts, counts.view(ep_size, local).sum(1).tolist(), recv_counts.view(ep_size, local).sum(1).tolist()


def _expert_parallel(rows: torch.Tensor, counts: torch.Tensor, experts: torch.nn.Module, group: Any,
                     ep_size: int, label: str) -> torch.Tensor:
    """Steps 1-3 of the module docstring: rows sorted by global expert in, their outputs out."""
    local = counts.numel() // ep_size
    recv_counts, send, recv = _exchange_counts(counts, group, ep_size, label)
    received = all_to_all_rows(rows, send, recv, group, f"{label} token dispatch all-to-all")
    local_ids = torch.arange(local, device=rows.device).repeat(ep_size)
    order, local_counts = permute_by_expert(torch.repeat_interleave(local_ids, recv_counts), local)
    out = experts(permute_tokens(received, order), local_counts)
    back = out.new_zeros(out.shape).index_copy(0, order, out)
    return all_to_all_rows(back, recv, send, group, f"{label} token combine all-to-all")


def dispatch_combine(x: torch.Tensor, routing: Routing, experts: torch.nn.Module, num_experts: int,
                     group: Any | None = None, ep_size: int = 1, *,
                     label: str = "MoE layer") -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kept assignments of ``routing`` through ``experts`` and combine per token.

    Args:
        x: ``[T, H]`` tokens.
        routing: the router's decision for ``x``.
        experts: a module ``(rows sorted by local expert, counts) -> rows``.
        num_experts: ``E`` across the group.
        group: the expert-parallel process group, or ``None`` on one rank.
        ep_size: the group's size (``E / ep_size`` experts per rank).
        label: the layer's name in plait's flight log (``MoE layer `layers.1.mlp```).

    Returns:
        ``(out, load)``: ``out`` ``[T, H]`` in ``x``'s dtype and ``load`` ``[E]`` int64 kept
        assignments per expert from this rank's tokens.
    """
    if torch.compiler.is_compiling():
        # Static shapes and opaque exchanges (see dispatch_ops): one graph, no recompiles. Eager
        # keeps the path below, whose results are the reference.
        if ep_size > 1:
            return traced_dispatch_combine(x, routing, experts, num_experts, group, ep_size, label)
        return traced_local_dispatch_combine(x, routing, experts, num_experts)
    token, slot = routing.kept.nonzero(as_tuple=True)
    order, counts = permute_by_expert(routing.expert_ids[token, slot], num_experts)
    token = token[order]
    rows = permute_tokens(x, token)
    if ep_size > 1:
        out_rows = _expert_parallel(rows, counts, experts, group, ep_size, label)
    else:
        out_rows = experts(rows, counts)
    weights = routing.weights[token, slot[order]]
    return combine_rows(out_rows, token, weights, x.shape[0]).to(x.dtype), counts
