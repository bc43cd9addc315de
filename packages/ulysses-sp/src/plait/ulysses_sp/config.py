"""The package's one config object and the way it finds its sequence-parallel group."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

SUPPORTED_INNER = ("sdpa", "eager", "fpdt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UlyssesConfig:
    """How Ulysses sequence parallelism is applied to a model.

    Attributes:
        sp_dim: name of the ``DeviceMesh`` dimension that holds the sequence-parallel ranks.
        inner_attention: the attention implementation run on the head-sharded tensors for HF
            models (``"sdpa"`` or ``"eager"``, or ``"fpdt"``: plait's FPDT attention over sequence
            chunks with their q/k/v on the host, :mod:`plait.ulysses_sp.fpdt`); ``None`` keeps the
            model's current one.
        tiled_mlp_chunks: split every decoder MLP into this many sequence chunks, recomputed in
            backward (:class:`plait.ulysses_sp.TiledMLP`); ``None`` or ``1`` leaves MLPs alone.
        fpdt_chunk: tokens per sequence chunk of ``inner_attention="fpdt"`` (each block of scores
            is ``fpdt_chunk x fpdt_chunk`` per head); read only with that inner attention.
    """

    sp_dim: str = "sp"
    inner_attention: str | None = None
    tiled_mlp_chunks: int | None = None
    fpdt_chunk: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.sp_dim, str) or not self.sp_dim:
            raise ValueError(f"UlyssesConfig.sp_dim={self.sp_dim!r} must be a mesh dimension name such as 'sp'.")
        if self.inner_attention is not None and self.inner_attention not in SUPPORTED_INNER:
            raise ValueError(
                f"UlyssesConfig.inner_attention={self.inner_attention!r} is not supported; use one of "
                f"{SUPPORTED_INNER} or None (keep the model's)."
            )
        chunks = self.tiled_mlp_chunks
        if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
            raise ValueError(f"UlyssesConfig.tiled_mlp_chunks={chunks!r} must be a positive int or None.")
        if not isinstance(self.fpdt_chunk, int) or isinstance(self.fpdt_chunk, bool) or self.fpdt_chunk < 1:
            raise ValueError(f"UlyssesConfig.fpdt_chunk={self.fpdt_chunk!r} must be a positive int (tokens per chunk).")


@dataclasses.dataclass(frozen=True)
class SPGroup:
    """The sequence-parallel process group and this rank's place in it.

    Attributes:
        group: the process group (``None`` = the default group).
        rank: this rank's index inside the group (which sequence slice it holds).
        size: ranks in the group (``sp``).
    """

    group: Any
    rank: int
    size: int


def sp_group(mesh: Any, *, sp_dim: str = "sp") -> SPGroup:
    """Find the sequence-parallel group.

    Args:
        mesh: a ``DeviceMesh`` with a dimension named ``sp_dim``, a 1-D ``DeviceMesh``, a
            process group, or ``None`` for the default (world) group.
        sp_dim: the mesh dimension name.

    Returns:
        The :class:`SPGroup`.

    Raises:
        ValueError: a multi-dimensional mesh without ``sp_dim`` (the message lists its names).
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("Ulysses needs torch.distributed initialised first (torchrun or init_process_group).")
    if mesh is None or isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        names = mesh.mesh_dim_names or ()
        if sp_dim in names:
            group = mesh.get_group(sp_dim)
        elif mesh.ndim == 1:
            group = mesh.get_group()
        else:
            raise ValueError(
                f"the mesh has dimensions {names} but no {sp_dim!r}; build it with "
                f"plait.kernels.mesh.make_mesh(dp=-1, {sp_dim}=N) or pass sp_dim=<its name>."
            )
    return SPGroup(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))
