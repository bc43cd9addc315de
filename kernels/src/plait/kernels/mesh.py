"""Named device meshes from sizes (``dp``, ``sp``, ``ep``, ...), refusing impossible ones early."""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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
    return init_device_mesh(device_type, tuple(resolved.values()), mesh_dim_names=tuple(resolved))
