"""Checkpoint state of tensor-parallel (DTensor) parameters under ZeRO: where a piece sits globally.

A DTensor parameter's unit holds its local TP shard, and ZeRO's shard of the unit is a flat range
of that local tensor. In the global tensor the local TP shard is a box (per-dimension offsets
given by the placements), and a flat range of a box is not a flat range of the global tensor once
the box is cut along any dimension but the first (a ``RowwiseParallel`` weight is ``Shard(1)``).
So a TP piece is described as the boxes it covers (:func:`flat_range_boxes`): at most two partial
rows and one run of whole rows per dimension, each a contiguous run of the master and therefore a
view of it, so a checkpoint consumer loads into those views in place. Several pieces of one
tensor on a rank are keyed with :func:`plait.kernels.sharded_state.piece_key`, as the protocol says.

A parameter replicated over a mesh dimension (``Replicate()``: row-wise biases, norms) holds the
same values on each rank of that dimension; its pieces name those ranks as replicas, so only the
lowest writes them (:func:`replica_ranks`).

The whole-tensor paths (``state_dict()``, ``load_state_dict()``, ``export_full_weights``) use
:func:`full_value` (DTensor assembles the TP shards, a collective over the TP mesh) and
:func:`local_part` (this rank's box of a whole tensor, no communication).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from plait.kernels.sharded_state import ShardedTensor, ShardSpec, piece_key
from plait.zero_sharding.tensor_parallel import is_dtensor

Box = tuple[tuple[int, int], ...]


def tp_offsets(param: DTensor) -> tuple[int, ...]:
    """Where this rank's local shard of ``param`` starts in the global tensor, per dimension."""
    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(int(o) for o in offsets)


def replica_ranks(param: DTensor) -> tuple[int, ...]:
    """Global ranks of ``param``'s mesh holding the same local shard as this rank: those with the
    same coordinate on every ``Shard`` dimension (any coordinate on ``Replicate`` ones).

    Returns:
        Sorted ranks, this rank included; the lowest is the designated writer.
    """
    mesh = param.device_mesh
    coord = mesh.get_coordinate()
    index = tuple(coord[dim] if isinstance(p, Shard) else slice(None) for dim, p in enumerate(param.placements))
    return tuple(sorted(int(r) for r in mesh.mesh[index].reshape(-1).tolist()))


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[Box, int, int]]:
    """Split the flat range ``[lo, hi)`` of a row-major tensor of ``shape`` into boxes.

    Args:
        shape: the tensor's shape.
        lo, hi: the flat range, ``0 <= lo <= hi <= numel``.

    Returns:
        ``(box, start, stop)`` in order, where ``box`` gives ``(start, stop)`` per dimension and
        ``[start, stop)`` is the box's own flat range of the tensor (the boxes tile ``[lo, hi)``).
    """
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [(((lo, hi),) if shape else (), lo, hi)]
    inner = math.prod(shape[1:])
    whole_rest = tuple((0, size) for size in shape[1:])
    first_whole, end_whole = -(-lo // inner), hi // inner  # whole rows [first_whole, end_whole)
    if first_whole > end_whole:  # lo and hi inside one row
        return _in_row(shape, lo // inner, lo, hi)
    out = _in_row(shape, first_whole - 1, lo, first_whole * inner) if lo < first_whole * inner else []
    if first_whole < end_whole:
        out.append((((first_whole, end_whole), *whole_rest), first_whole * inner, end_whole * inner))
    if hi > end_whole * inner:
        out += _in_row(shape, end_whole, end_whole * inner, hi)
    return out


def _in_row(shape: tuple[int, ...], row: int, lo: int, hi: int) -> list[tuple[Box, int, int]]:
    """Boxes of ``[lo, hi)`` that lie within row ``row`` of dimension 0."""
    base = row * math.prod(shape[1:])
    return [(((row, row + 1), *box), start + base, stop + base)
            for box, start, stop in flat_range_boxes(shape[1:], lo - base, hi - base)]


def tp_pieces(name: str, kind: str, param: DTensor, values: torch.Tensor, param_range: tuple[int, int],
              dtype: torch.dtype | None = None) -> dict[str, ShardedTensor]:
    """The pieces of ``param``'s global tensor that ``values`` holds.

    Args:
        name: the pieces' tensor name (``model.<p>`` or ``optim.<state>.<p>``).
        kind: the protocol's kind (``parameter``, ``optimizer_state``).
        param: the DTensor parameter.
        values: this rank's flat piece (a view of the master or of optimizer state).
        param_range: ``(start, stop)`` of ``values`` within the flattened local TP shard.
        dtype: the pieces' dtype (default ``values.dtype``).

    Returns:
        ``piece_key(name, i) -> ShardedTensor``; each local tensor is a view of ``values``.
    """
    local_shape = tuple(param._local_tensor.shape)
    offsets = tp_offsets(param)
    replicas = replica_ranks(param)
    global_shape = tuple(param.shape)
    dtype = dtype or values.dtype
    if local_shape == global_shape:  # replicated on every mesh dimension: the flat range is global
        spec = ShardSpec(name=name, kind=kind, global_shape=global_shape, dtype=dtype, flat_range=param_range,
                         replica_ranks=replicas)
        return {name: ShardedTensor(spec, values)}
    out = {}
    lo = param_range[0]
    for index, (box, start, stop) in enumerate(flat_range_boxes(local_shape, *param_range)):
        where = tuple((a + off, b + off) for (a, b), off in zip(box, offsets))
        spec = ShardSpec(name=name, kind=kind, global_shape=global_shape, dtype=dtype, slices=where,
                         replica_ranks=replicas)
        extent = tuple(b - a for a, b in box)
        out[piece_key(name, index)] = ShardedTensor(spec, values[start - lo:stop - lo].view(extent))
    return out


def full_value(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``param`` given this rank's local shard ``local`` (collective over the
    TP mesh for a DTensor; ``local`` itself otherwise)."""
    if not is_dtensor(param):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride()).full_tensor()


def local_part(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's local TP shard of the whole tensor ``whole`` (no communication).

    Raises:
        ValueError: ``whole`` is not shaped like ``param``'s global tensor.
    """
    if not is_dtensor(param):
        return whole
    local_shape = tuple(param._local_tensor.shape)
    box = tuple(slice(off, off + size) for off, size in zip(tp_offsets(param), local_shape))
    return whole[box]

