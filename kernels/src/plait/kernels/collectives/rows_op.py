"""The differentiable all-to-all of dim-0 rows (Ulysses' sequence <-> head exchange, MoE's token
dispatch) as one ``torch.library`` custom op, ``plait::all_to_all_rows``, for torch.compile.

Why a custom op: the exchange goes through :func:`plait.kernels.collectives.all_to_all_single`,
whose flight log, byte ledger and hang diagnosis are Python-side bookkeeping that must run as
written on every call (:func:`plait.kernels.collectives.hangs.run` is compiler-disabled). Called
from a compiled block, that would split the block's graph at every exchange. As a custom op with
a shape-only fake, dynamo and AOTAutograd keep the exchange as one opaque node of the block's
graph (forward and backward), and its body, the bookkeeping included, runs eagerly on real
tensors: nothing about the log or the hang detection changes under compile.

The process group travels by its name (``ProcessGroup.group_name``), as in torch's functional
collectives: a custom op's schema takes no Python objects. The backward is the same exchange with
the split sizes swapped, named ``<name> (backward)`` in the flight log.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.collectives.ops import all_to_all_single


def _group(name: str) -> Any:
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("plait::all_to_all_rows", mutates_args=())
def _rows_op(rows: torch.Tensor, send: list[int], recv: list[int], group_name: str, name: str) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    all_to_all_single(out, rows, output_split_sizes=list(recv), input_split_sizes=list(send),
                      group=_group(group_name), name=name)
    return out


@_rows_op.register_fake
def _rows_fake(rows, send, recv, group_name, name):
    return rows.new_empty((sum(recv), *rows.shape[1:]))


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _, ctx.send, ctx.recv, ctx.group_name, ctx.name = inputs


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    back = _rows_op(grad, ctx.recv, ctx.send, ctx.group_name, f"{ctx.name} (backward)")
    return back, None, None, None, None


_rows_op.register_autograd(_backward, setup_context=_setup_context)


def all_to_all_rows(rows: torch.Tensor, send: list[int] | tuple[int, ...], recv: list[int] | tuple[int, ...],
                    group: Any | None = None, name: str = "all-to-all of rows") -> torch.Tensor:
    """Differentiable uneven all-to-all of dim-0 rows: ``send[j]`` rows go to rank ``j`` of
    ``group``, ``recv[j]`` come from it; traceable by torch.compile without a graph break.

    Args:
        rows: ``[sum(send), ...]``, the block for rank 0 first.
        send: rows sent to each rank, in rank order.
        recv: rows received from each rank, in rank order.
        group: the process group, or ``None`` for the default group.
        name: the exchange's name in plait's flight log (its backward adds ``(backward)``).

    Returns:
        ``[sum(recv), ...]``, the received rows in rank order.

    Raises:
        ValueError: ``rows`` does not have ``sum(send)`` rows, or a split list is not one entry per rank.
    """
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if len(send) != size or len(recv) != size:
        raise ValueError(f"all_to_all_rows: send ({len(send)}) and recv ({len(recv)}) need one entry per rank "
                         f"of the group ({size}).")
    if rows.shape[0] != sum(send):
        raise ValueError(f"all_to_all_rows: rows has {rows.shape[0]} rows but send sums to {sum(send)}.")
    return _rows_op(rows, [int(n) for n in send], [int(n) for n in recv], group.group_name, name)
