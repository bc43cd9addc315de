"""Thin wrappers over ``torch.distributed`` that every plait package uses.

Same semantics and argument order as torch's functions, keyword-only ``group``/``async_op``,
plus two things: record the op's logical bytes in the active :class:`ByteLedger`, and enter it
in the flight log (:mod:`plait.kernels.collectives.flight`) under the plait-level name the
caller gives (``name=``, or a :func:`~plait.kernels.collectives.named` block), so a failure names
the collective and the ranks that never entered it (:mod:`plait.kernels.collectives.hangs`).
An async op's handle comes back wrapped (:class:`~plait.kernels.collectives.hangs.TrackedWork`)
so its ``wait()`` is timed and named too. The wrappers add nothing else on purpose.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.kernels.collectives import flight, hangs
from plait.kernels.collectives.ledger import group_name, record, tensor_nbytes

ReduceOp = dist.ReduceOp

# Bound once at import: plait's calls go to torch's originals even while
# count_torch_distributed() has swapped the module attributes, so they are counted once.
_torch = {name: getattr(dist, name) for name in (
    "all_gather", "all_reduce", "all_to_all_single", "broadcast", "send", "recv", "isend", "irecv", "barrier",
)}
# torch 2.13 renamed the flat-tensor collectives (the old names warn); use whichever this torch has.
_torch["all_gather_into_tensor"] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_torch["reduce_scatter_tensor"] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The flight log names ops as the ledger does.
_FLIGHT_OP = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_to_all_single": "all_to_all", "isend": "send", "irecv": "recv"}


def flight_group(group: Any | None) -> str:
    """The flight log's name of ``group``: the ledger's (``world``, ``ranks[0,2]``), plus torch's
    own group name for every group but the default one (``world (group 3)``).

    Two process groups over the same ranks (ZeRO-3's reduce twin, an async checkpoint save's
    private group, a mesh dimension spanning the world) order their collectives independently: an
    async save's thread interleaves with the training loop differently on each rank. Numbered
    under one name, the same number would mean different collectives on different ranks. torch
    names groups in creation order, which every rank shares (every rank creates every group).
    """
    name = group_name(group)
    if group is None or group is dist.group.WORLD:
        return name
    try:
        return f"{name} (group {group.group_name})"
    except (AttributeError, RuntimeError):
        return name


def _issue(fn: str, name: str | None, /, *args: Any, **kwargs: Any) -> Any:
    """Call torch's ``fn`` through the flight log (numbered per group, named, timed, failures named)."""
    group = kwargs.get("group")
    return hangs.run(_FLIGHT_OP.get(fn, fn), group, flight_group(group), flight.current_label(name), None,
                     _torch[fn], *args, **kwargs)


def _issue_p2p(fn: str, name: str | None, peer: int, /, *args: Any, **kwargs: Any) -> Any:
    """Like :func:`_issue` for a send or receive: numbered per (sender, receiver) pair, since the
    other ranks of the group take no part in it."""
    group, me = kwargs.get("group"), dist.get_rank()
    pair = f"p2p {me}->{peer}" if fn in ("send", "isend") else f"p2p {peer}->{me}"
    return hangs.run(_FLIGHT_OP.get(fn, fn), group, pair, flight.current_label(name), [peer],
                     _torch[fn], *args, **kwargs)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, *, group: Any | None = None, async_op: bool = False,
    name: str | None = None,
) -> Any:
    """Gather equal-sized ``input`` from every rank into ``output`` (``world x input``).

    Counted bytes: ``output`` (the full gathered tensor).
    """
    record("all_gather", group, tensor_nbytes(output), output.dtype)
    return _issue("all_gather_into_tensor", name, output, input, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, *, group: Any | None = None, async_op: bool = False,
    name: str | None = None,
) -> Any:
    """Gather possibly differently-shaped tensors from every rank into ``tensor_list``.

    Counted bytes: the sum over ``tensor_list`` (everything this rank ends up holding).
    """
    record("all_gather", group, sum(tensor_nbytes(t) for t in tensor_list), tensor.dtype)
    return _issue("all_gather", name, tensor_list, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    op: Any = ReduceOp.SUM,
    group: Any | None = None,
    async_op: bool = False,
    name: str | None = None,
) -> Any:
    """Reduce ``input`` (``world x output``) across ranks; each rank keeps its slice in ``output``.

    Counted bytes: ``input`` (the full tensor being reduced).
    """
    record("reduce_scatter", group, tensor_nbytes(input), input.dtype)
    return _issue("reduce_scatter_tensor", name, output, input, op=op, group=group, async_op=async_op)


def all_reduce(
    tensor: torch.Tensor, *, op: Any = ReduceOp.SUM, group: Any | None = None, async_op: bool = False,
    name: str | None = None,
) -> Any:
    """Reduce ``tensor`` in place across ranks. Counted bytes: ``tensor``."""
    record("all_reduce", group, tensor_nbytes(tensor), tensor.dtype)
    return _issue("all_reduce", name, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any | None = None,
    async_op: bool = False,
    name: str | None = None,
) -> Any:
    """Exchange slices of dim 0 between all ranks, with optional uneven splits.

    Counted bytes: ``input`` (what this rank sends, its own slice included, as torch counts it).
    """
    record("all_to_all", group, tensor_nbytes(input), input.dtype)
    return _issue("all_to_all_single", name, output, input, output_split_sizes, input_split_sizes,
                  group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor, *, src: int, group: Any | None = None, async_op: bool = False, name: str | None = None
) -> Any:
    """Broadcast ``tensor`` from global rank ``src``. Counted bytes: ``tensor`` (on every rank)."""
    record("broadcast", group, tensor_nbytes(tensor), tensor.dtype)
    return _issue("broadcast", name, tensor, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, *, dst: int, group: Any | None = None, name: str | None = None) -> None:
    """Blocking point-to-point send to global rank ``dst``. Counted bytes: ``tensor``."""
    record("send", group, tensor_nbytes(tensor), tensor.dtype)
    _issue_p2p("send", name, dst, tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, *, src: int, group: Any | None = None, name: str | None = None) -> None:
    """Blocking receive from global rank ``src`` into ``tensor``. Counted bytes: ``tensor``."""
    record("recv", group, tensor_nbytes(tensor), tensor.dtype)
    _issue_p2p("recv", name, src, tensor, src=src, group=group)


def isend(tensor: torch.Tensor, *, dst: int, group: Any | None = None, name: str | None = None) -> Any:
    """Asynchronous :func:`send`; returns the work handle to ``wait()`` on."""
    record("send", group, tensor_nbytes(tensor), tensor.dtype)
    return _issue_p2p("isend", name, dst, tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, *, src: int, group: Any | None = None, name: str | None = None) -> Any:
    """Asynchronous :func:`recv`; returns the work handle to ``wait()`` on."""
    record("recv", group, tensor_nbytes(tensor), tensor.dtype)
    return _issue_p2p("irecv", name, src, tensor, src=src, group=group)


def barrier(*, group: Any | None = None, name: str | None = None) -> None:
    """Synchronise the group (moves no logical bytes, so nothing is recorded)."""
    _issue("barrier", name, group=group, async_op=False)
