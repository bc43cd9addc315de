"""Named device meshes from sizes (``dp``, ``sp``, ``ep``, ...), refusing impossible ones early."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.kernels.collectives.hangs import group_timeout


def resolve_mesh_sizes(world_size: int, **sizes: int) -> dict[str, int]:
    """Check named sizes against ``world_size``; one size may be ``-1`` meaning "the rest".

    Args:
        world_size: the number of ranks the mesh must cover exactly.
        **sizes: dimension name -> size, outermost first (e.g. ``dp=2, sp=2``).

    Returns:
        name -> size with any ``-1`` resolved.

    Raises:
        ValueError: no dimensions, a size that is not a positive int (or a second -1), or a
            product that does not equal ``world_size``; the message names the sizes and the fix.
    """
    if not sizes:
        raise ValueError("make_mesh needs at least one named dimension, e.g. make_mesh(dp=-1).")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    bad = {name: size for name, size in sizes.items() if not isinstance(size, int) or isinstance(size, bool)
           or (size < 1 and size != -1)}
    if bad:
        raise ValueError(f"mesh sizes {bad} must be positive integers (or -1 for 'the rest of the ranks').")
    wildcards = [name for name, size in sizes.items() if size == -1]
    if len(wildcards) > 1:
        raise ValueError(f"only one mesh dimension may be -1, got {wildcards}; give the others explicit sizes.")
    known = math.prod(size for size in sizes.values() if size != -1)
    if wildcards:
        if world_size % known:
            raise ValueError(
                f"mesh sizes {sizes}: world size {world_size} is not divisible by {known}, so "
                f"{wildcards[0]}=-1 cannot be resolved; choose sizes whose product divides {world_size}."
            )
        sizes = {name: (world_size // known if size == -1 else size) for name, size in sizes.items()}
    elif known != world_size:
        raise ValueError(
            f"mesh sizes {sizes} multiply to {known} but the world size is {world_size}; "
            f"make the product equal {world_size} (or set one dimension to -1)."
        )
    return dict(sizes)


def check_parallel_world(sp_size: int, ep_size: int, world_size: int, *, field_prefix: str = "",
                         world: str = "") -> None:
    """Refuse an ``sp_size`` / ``ep_size`` (or their product) that does not divide ``world_size``:
    what every integration's ``sp_size``/``ep_size`` settings must meet (see :func:`parallel_mesh`).

    Args:
        sp_size, ep_size: the sequence- and expert-parallel sizes (1: off).
        world_size: the ranks the job runs on.
        field_prefix: put before the field names in the message (e.g. ``"PlaitConfig."``).
        world: what the world size counts, said after it (e.g. ``"devices x num_nodes"``).

    Raises:
        ValueError: naming the field, the world size and the sizes that would work.
    """
    choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
    said = f" ({world})" if world else ""
    for field, value in (("sp_size", sp_size), ("ep_size", ep_size)):
        if world_size % value:
            raise ValueError(f"{field_prefix}{field}={value} does not divide the world size {world_size}{said}; "
                             f"use one of {choices}.")
    if world_size % (sp_size * ep_size):
        raise ValueError(f"{field_prefix}sp_size={sp_size} x ep_size={ep_size} = {sp_size * ep_size} does not divide "
                         f"the world size {world_size}{said}; make the product one of {choices}.")


def parallel_mesh(sp_size: int, ep_size: int, *, device_type: str = "cpu") -> DeviceMesh | None:
    """The mesh of an integration's ``sp_size``/``ep_size``: ``("dp", "sp")``, ``("dp", "ep")``,
    ``("dp", "ep", "sp")``, or ``None`` when both are 1. ``sp`` is innermost, so an sp group is
    consecutive ranks (ulysses-sp's ``dp_coordinates``: ``global_rank // sp`` is the data replica).

    Collective: every rank calls it at the same point.
    """
    if sp_size == 1 and ep_size == 1:
        return None
    sizes = {**({"ep": ep_size} if ep_size > 1 else {}), **({"sp": sp_size} if sp_size > 1 else {})}
    return make_mesh(device_type=device_type, dp=-1, **sizes)


def make_mesh(*, device_type: str = "cpu", **sizes: int) -> DeviceMesh:
    """Build a named :class:`DeviceMesh` over the default process group.

    Example: ``make_mesh(dp=-1, sp=2)`` on 4 ranks gives a 2 x 2 mesh named ``("dp", "sp")``.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        **sizes: see :func:`resolve_mesh_sizes`.

    Raises:
        ValueError: impossible sizes (checked before any group is created).
        RuntimeError: the default process group is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs torch.distributed initialised first (torchrun or init_process_group).")
    resolved = resolve_mesh_sizes(dist.get_world_size(), **sizes)
    mesh = init_device_mesh(device_type, tuple(resolved.values()), mesh_dim_names=tuple(resolved))
    # A DeviceMesh's groups get torch's default timeout (30 minutes on gloo), not the job's: a
    # hung rank would hold the others that long in an sp or ep collective. Give them the job's.
    timeout = group_timeout()
    if timeout is not None:
        for name in resolved:
            dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(name))
    return mesh


_flat_groups: dict[tuple[int, tuple[str, ...]], tuple[DeviceMesh, Any]] = {}
_groups_by_layout: dict[tuple[tuple[int, ...], ...], Any] = {}


def _all_slices(mesh: DeviceMesh) -> list[list[int]]:
    """The rank grids (flattened) of every slice of the world that ``mesh`` is one of: just
    ``mesh.mesh`` when it covers the whole world; for a sub-mesh (``mesh["dp", "sp"]`` of a
    ``dp x sp x ep`` mesh), whose ``mesh.mesh`` holds only this rank's slice, the slices of all
    ranks, gathered over the default group and ordered by their lowest rank (identical everywhere)."""
    grid = mesh.mesh.reshape(-1).tolist()
    if len(grid) == dist.get_world_size():
        return [grid]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grid)
    slices = sorted({tuple(g) for g in gathered}, key=min)
    seen = [r for g in slices for r in g]
    if len(seen) != len(set(seen)) or sorted(seen) != list(range(dist.get_world_size())):
        raise ValueError(f"flat_group: the ranks' meshes {slices} are not slices of one mesh over the whole world; "
                         "call it with the same (sub-)mesh of a make_mesh(...) mesh on every rank.")
    return [list(g) for g in slices]


def flat_group(mesh: DeviceMesh, dims: Sequence[str]) -> Any:
    """This rank's process group over the named dimensions of ``mesh``, flattened (row-major in
    the mesh's order): ``flat_group(mesh, ("dp", "sp"))`` on a ``dp x sp x ep`` mesh is the group
    of ranks that share this rank's ``ep`` coordinate. ``mesh`` may be a sub-mesh covering only
    part of the world (``mesh["dp", "sp"]``): every rank still creates every group of the
    flattening, in the same order, with the same rank lists (the other ranks' slices are gathered).
    Built with ``torch.distributed.new_subgroups_by_enumeration``, cached per mesh and dimensions
    (and groups with the same layout are created once).

    Collective the first time for a given mesh and dimensions: every rank of the default group
    must call it at the same point.

    Args:
        mesh: a named ``DeviceMesh`` (a ``make_mesh`` mesh or a sub-mesh of one).
        dims: dimension names of ``mesh`` (one or more, each once).

    Returns:
        The process group of this rank.

    Raises:
        ValueError: no dimension, a repeated one, or a name the mesh does not have; ranks whose
            meshes are not slices of one mesh over the whole world.
    """
    names = tuple(mesh.mesh_dim_names or ())
    dims = tuple(dims)
    unknown = [d for d in dims if d not in names]
    if not dims or unknown or len(set(dims)) != len(dims):
        raise ValueError(f"flat_group(mesh, dims={dims}): name one or more distinct dimensions of the mesh, whose "
                         f"dimensions are {names}" + (f"; {unknown} are not among them." if unknown else "."))
    if len(dims) == 1:
        return mesh[dims[0]].get_group()
    key = (id(mesh), tuple(sorted(dims, key=names.index)))
    if key not in _flat_groups:
        keep = [names.index(d) for d in key[1]]
        rest = [i for i in range(len(names)) if i not in keep]
        shape = tuple(mesh.mesh.shape)
        size = math.prod(shape[i] for i in keep)
        layout = tuple(tuple(group) for part in _all_slices(mesh)
                       for group in torch.tensor(part).reshape(shape).permute(*rest, *keep).reshape(-1, size).tolist())
        if layout not in _groups_by_layout:  # the same on every rank, so a hit is too
            _groups_by_layout[layout], _ = dist.new_subgroups_by_enumeration([list(g) for g in layout],
                                                                             timeout=group_timeout())
        _flat_groups[key] = (mesh, _groups_by_layout[layout])  # the mesh is kept alive so its id is not reused
    return _flat_groups[key][1]


def complement_dims(mesh: DeviceMesh, dims: Sequence[str]) -> tuple[str, ...]:
    """The dimensions of ``mesh`` not in ``dims``, in the mesh's order (e.g. the dimensions a
    data-parallel engine replicates over when it shards over ``dims``)."""
    return tuple(name for name in (mesh.mesh_dim_names or ()) if name not in dims)
