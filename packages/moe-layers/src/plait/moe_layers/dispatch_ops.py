"""Expert-parallel token dispatch as ``torch.library`` custom ops: the form torch.compile traces.

Eager dispatch (:mod:`plait.moe_layers.dispatch`) reads the per-rank row counts back to Python
after the count exchange, takes ``nonzero`` of the kept assignments and ``repeat_interleave``\\ s by
the received counts: three data-dependent steps, each a graph break inside a compiled MoE block,
and a recompile for the changing row counts. Under compile the same exchange runs as three ops
that each keep their data-dependent work inside an opaque body, so a compiled block is one graph:

* ``plait::ep_route`` exchanges the ``E`` per-expert counts (one all-to-all of ``E`` int64, named
  ``<label> token-count exchange`` in the flight log) and returns the order that regroups the
  rows this rank receives by local expert, with the rows per local expert. Received rows live in
  a buffer of static capacity ``C = ep_size * N`` (``N = T * k``, this rank's assignments): the
  real rows first, zero padding after them, counted in the last local expert. So every shape in
  the graph is static and no graph is specialised on routing; the op refuses (``ValueError``) a
  step where more than ``C`` rows arrive, which needs ranks routing different token counts.
* ``plait::ep_dispatch_rows`` sends the first ``sum(counts)`` rows of a ``[N, H]`` buffer
  (sorted by expert, dropped assignments last) with uneven splits and regroups what arrives by
  local expert: ``[C, H]``. Its backward is ``ep_combine_rows`` of the gradient.
* ``plait::ep_combine_rows`` puts the experts' ``[C, H]`` outputs back in arrival order, returns
  the real rows to their ranks and writes them into a ``[N, H]`` buffer whose dropped rows are
  zeros. Its backward is ``ep_dispatch_rows`` of the gradient.

Cost of the static shapes: the last local expert also runs the ``C - R`` padding rows (zeros in,
zeros out, zero weight gradient), up to ``(ep_size - 1) * N`` rows more expert compute per layer
than eager at balanced routing; the bytes exchanged are eager's.

The row exchanges go through :func:`plait.kernels.collectives.all_to_all_single` with the eager
path's names (``token dispatch all-to-all``, ``token combine all-to-all``, ``(backward)`` added),
so the flight log, the byte ledger (only the kept rows travel: the same bytes as eager) and hang
detection see what they see in eager mode. The process group travels by name, as in torch's
functional collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.collectives import all_to_all_single
from plait.kernels.ops import combine_rows, permute_by_expert, permute_tokens


def _group(name: str) -> Any:
    return dist.distributed_c10d._resolve_process_group(name)


def _splits(counts: torch.Tensor, ep_size: int) -> list[int]:
    """Rows per rank of the group from ``[E]`` per-expert counts (experts in rank blocks)."""
    return counts.view(ep_size, -1).sum(1).tolist()


@torch.library.custom_op("plait::ep_route", mutates_args=())
def _route_op(counts: torch.Tensor, num_rows: int, group_name: str, ep_size: int,
              label: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recv_counts = torch.empty_like(counts)
    all_to_all_single(recv_counts, counts.contiguous(), group=_group(group_name),
                      name=f"{label} token-count exchange")
    capacity, received = ep_size * num_rows, int(recv_counts.sum())
    if received > capacity:
        raise ValueError(f"{label}: {received} rows arrive but a compiled graph holds {capacity} "
                         f"(ep_size x this rank's {num_rows} assignments); under torch.compile every rank "
                         "of the expert-parallel group must route the same number of tokens per step.")
    local = counts.numel() // ep_size
    local_ids = torch.arange(local, device=counts.device).repeat(ep_size)
    arrived = torch.repeat_interleave(local_ids, recv_counts)
    # Padding rows join the last local expert, after its real rows: zero rows in, zero rows out.
    padding = torch.full((capacity - received,), local - 1, dtype=torch.int64, device=counts.device)
    order, local_counts = permute_by_expert(torch.cat([arrived, padding]), local)
    return recv_counts, local_counts, order


@_route_op.register_fake
def _route_fake(counts, num_rows, group_name, ep_size, label):
    return (torch.empty_like(counts), counts.new_empty(counts.numel() // ep_size),
            counts.new_empty(ep_size * num_rows))


def _send_recv(counts: torch.Tensor, recv_counts: torch.Tensor, group_name: str) -> tuple[list[int], list[int]]:
    size = dist.get_world_size(_group(group_name))
    return _splits(counts, size), _splits(recv_counts, size)


@torch.library.custom_op("plait::ep_dispatch_rows", mutates_args=())
def _dispatch_op(rows: torch.Tensor, counts: torch.Tensor, recv_counts: torch.Tensor, order: torch.Tensor,
                 group_name: str, name: str) -> torch.Tensor:
    send, recv = _send_recv(counts, recv_counts, group_name)
    received = rows.new_zeros((order.shape[0], *rows.shape[1:]))
    all_to_all_single(received[:sum(recv)], rows[:sum(send)].contiguous(), output_split_sizes=recv,
                      input_split_sizes=send, group=_group(group_name), name=name)
    return received.index_select(0, order)


@_dispatch_op.register_fake
def _dispatch_fake(rows, counts, recv_counts, order, group_name, name):
    return rows.new_empty((order.shape[0], *rows.shape[1:]))


@torch.library.custom_op("plait::ep_combine_rows", mutates_args=())
def _combine_op(out: torch.Tensor, counts: torch.Tensor, recv_counts: torch.Tensor, order: torch.Tensor,
                num_rows: int, group_name: str, name: str) -> torch.Tensor:
    send, recv = _send_recv(counts, recv_counts, group_name)
    back = out.new_zeros(out.shape).index_copy(0, order, out)
    result = out.new_zeros((num_rows, *out.shape[1:]))
    all_to_all_single(result[:sum(send)], back[:sum(recv)], output_split_sizes=send, input_split_sizes=recv,
                      group=_group(group_name), name=name)
    return result


@_combine_op.register_fake
def _combine_fake(out, counts, recv_counts, order, num_rows, group_name, name):
    return out.new_empty((num_rows, *out.shape[1:]))


def _save_routing(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    rows, counts, recv_counts, order, *rest = inputs
    ctx.save_for_backward(counts, recv_counts, order)
    ctx.num_rows = rows.shape[0]
    ctx.group_name, ctx.name = rest[-2], rest[-1]


def _dispatch_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    counts, recv_counts, order = ctx.saved_tensors
    back = _combine_op(grad, counts, recv_counts, order, ctx.num_rows, ctx.group_name, f"{ctx.name} (backward)")
    return back, None, None, None, None, None


def _combine_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    counts, recv_counts, order = ctx.saved_tensors
    rows = _dispatch_op(grad, counts, recv_counts, order, ctx.group_name, f"{ctx.name} (backward)")
    return rows, None, None, None, None, None, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_save_routing)
_combine_op.register_autograd(_combine_backward, setup_context=_save_routing)


def _sorted_assignments(x: torch.Tensor, routing: Any,
                        num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every ``(token, slot)`` assignment's row, by expert, dropped ones last (expert id ``E``).

    Returns ``(rows [T*k, H], token [T*k], weights [T*k], counts [E + 1])``: the kept rows in
    eager's order (by expert, then token and slot, as eager's ``nonzero`` lists them), each row's
    token, its combine weight (0 for a dropped row) and the rows per expert with the dropped rows
    counted last.
    """
    top_k = routing.expert_ids.shape[1]
    kept = routing.kept.reshape(-1)
    expert = torch.where(kept, routing.expert_ids.reshape(-1), num_experts)
    order, counts = permute_by_expert(expert, num_experts + 1)
    token = torch.div(order, top_k, rounding_mode="floor")
    weights = torch.where(kept, routing.weights.reshape(-1), 0.0)[order]
    return permute_tokens(x, token), token, weights, counts


def traced_local_dispatch_combine(x: torch.Tensor, routing: Any, experts: torch.nn.Module,
                                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`plait.moe_layers.dispatch.dispatch_combine` on one rank with static shapes.

    Eager takes ``nonzero`` of the kept assignments (a data-dependent row count: a graph break
    under torch.compile). Here all ``T * k`` assignments keep their row, dropped ones sorted after
    every expert and counted in the last expert's segment so the counts still cover every row;
    their combine weight is 0, so the combine adds exact zeros beyond eager's sum. The last expert
    runs the dropped rows too (none when dropless): that extra compute is the cost of one graph.

    Args:
        x, routing, experts, num_experts: as ``dispatch_combine``.

    Returns:
        ``(out, load)`` as ``dispatch_combine``.
    """
    rows, token, weights, counts = _sorted_assignments(x, routing, num_experts)
    segments = torch.cat([counts[:num_experts - 1], counts[num_experts - 1:].sum(0, keepdim=True)])
    out_rows = experts(rows, segments)
    return combine_rows(out_rows, token, weights, x.shape[0]).to(x.dtype), counts[:num_experts]


def traced_dispatch_combine(x: torch.Tensor, routing: Any, experts: torch.nn.Module, num_experts: int,
                            group: Any, ep_size: int, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`plait.moe_layers.dispatch.dispatch_combine` at ``ep_size > 1`` with static shapes.

    Every ``(token, slot)`` assignment keeps its row in ``[T * k, H]`` buffers: dropped ones sort
    after every expert (expert id ``E``) and never leave the rank, their combine weight is 0. The
    kept rows are ordered as in eager (by expert, then token and slot), so the experts see the same
    rows and the combine adds only exact zeros beyond eager's sum.

    Args:
        x, routing, experts, num_experts, group, ep_size, label: as ``dispatch_combine``.

    Returns:
        ``(out, load)`` as ``dispatch_combine``.
    """
    rows, token, weights, counts = _sorted_assignments(x, routing, num_experts)
    counts = counts[:num_experts]
    recv_counts, local_counts, arrival = torch.ops.plait.ep_route(counts, rows.shape[0], group.group_name,
                                                                        ep_size, label)
    received = _dispatch_op(rows, counts, recv_counts, arrival, group.group_name, f"{label} token dispatch all-to-all")
    out = experts(received, local_counts)
    out_rows = _combine_op(out, counts, recv_counts, arrival, rows.shape[0], group.group_name,
                           f"{label} token combine all-to-all")
    return combine_rows(out_rows, token, weights, x.shape[0]).to(x.dtype), counts
