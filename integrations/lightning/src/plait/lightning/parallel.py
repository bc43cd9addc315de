"""Sequence parallelism (``sp_size``) and expert parallelism (``ep_size``) for the plait strategies.

The strategy adds both as zero-sharding extensions (``composition.ShardingExtension``) once the
process group exists and the mesh is built, so they compose with ZeRO exactly as any extension
does (sequence parallel at order 10, MoE at 20, ZeRO last). The extensions are the feature
packages' own; this module only translates the strategy's settings:

* :func:`SequenceParallel`: plait-ulysses-sp's ``SequenceParallelExtension`` on a ``dp x sp``
  mesh (``make_mesh(dp=-1, sp=...)``, sp innermost, so ranks ``[i * sp, (i + 1) * sp)`` share their
  batches: :func:`sampler_kwargs`); batches are split along the sequence by :func:`split_batch`
  (the strategy calls it on every batch).
* :func:`ExpertParallel`: plait-moe-layers' ``ExpertParallelExtension`` on a ``dp x ep`` mesh.

Both packages are optional: they are found with ``importlib.util.find_spec`` and imported only
when ``sp_size``/``ep_size`` is above 1; missing, the strategy fails with the pip line
(:class:`~plait.lightning.pieces.PieceMissingError`) when it is built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from torch import nn

from plait.lightning.pieces import PieceMissingError

ULYSSES_INSTALL = "pip install plait-ulysses-sp"
MOE_INSTALL = "pip install plait-moe-layers"
__all__ = ["ExpertParallel", "SequenceParallel", "available", "build_mesh", "check_parallel_sizes", "check_world_size",
           "remove_sequence_parallel", "split_batch"]


def available(module: str) -> bool:
    """Whether the plait piece ``module`` (e.g. ``"plait.ulysses_sp"``) is importable."""
    return importlib.util.find_spec(module) is not None


def _require(module: str, install: str, field: str, value: int) -> None:
    if not available(module):
        package = install.split()[-1]
        raise PieceMissingError(f"{field}={value} needs {package}, which is not installed: {install}")


def check_parallel_sizes(sp_size: Any, ep_size: Any) -> None:
    """Refuse bad ``sp_size``/``ep_size`` values and missing packages (before any process starts).

    Raises:
        ValueError: not a positive int.
        PieceMissingError: plait-ulysses-sp (``sp_size > 1``) or plait-moe-layers (``ep_size > 1``)
            is not installed; the message has the pip line.
    """
    for field, value in (("sp_size", sp_size), ("ep_size", ep_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive int (1: off) dividing the world size.")
    if sp_size > 1:
        _require("plait.ulysses_sp", ULYSSES_INSTALL, "sp_size", sp_size)
    if ep_size > 1:
        _require("plait.moe_layers", MOE_INSTALL, "ep_size", ep_size)


def check_world_size(sp_size: int, ep_size: int, world_size: int) -> None:
    """Refuse an ``sp_size``/``ep_size`` (or their product) that does not divide the world size
    (:func:`plait.kernels.mesh.check_parallel_world`).

    Raises:
        ValueError: naming the field, the world size and the sizes that would work.
    """
    from plait.kernels.mesh import check_parallel_world

    check_parallel_world(sp_size, ep_size, world_size, world="devices x num_nodes")


def build_mesh(sp_size: int, ep_size: int, device_type: str) -> Any:
    """The strategy's ``DeviceMesh`` (:func:`plait.kernels.mesh.parallel_mesh`), or ``None``. Collective."""
    from plait.kernels.mesh import parallel_mesh

    return parallel_mesh(sp_size, ep_size, device_type=device_type)


def sampler_kwargs(kwargs: dict[str, Any], sp_size: int, global_rank: int) -> dict[str, Any]:
    """A strategy's ``distributed_sampler_kwargs`` under ``sp_size``: the sampler splits over the ``dp``
    ranks only, since the ranks of one sp group share their batches."""
    if sp_size > 1:
        kwargs = {**kwargs, "num_replicas": kwargs["num_replicas"] // sp_size, "rank": global_rank // sp_size}
    return kwargs


def split_batch(batch: Any, mesh: Any) -> Any:
    """This rank's part of a causal-LM batch for sequence parallelism
    (:func:`plait.ulysses_sp.zero_extension.model_inputs`).

    Args:
        batch: a mapping with ``input_ids`` ``[B, S]`` and optionally ``labels`` (``-100``: ignored),
            ``attention_mask``, ``position_ids``; every rank of the sp group holds the same one.
        mesh: the ``dp x sp`` mesh.

    Returns:
        The same kind of mapping with ``input_ids``, ``position_ids`` (true positions) and, when
        labels were given, ``labels`` *already shifted* for next-token prediction, each this rank's
        ``[B, S_padded / sp]`` slice; ``key_padding_mask`` ``[B, S_padded]`` when there is padding;
        ``attention_mask`` is dropped (the padding mask replaces it); other keys unchanged.

    Raises:
        ValueError: the batch is not a mapping with ``input_ids``.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"sp_size>1 splits batches along the sequence, so each batch must be a dict with "
                         f"'input_ids' (and 'labels'); got {kind}.")
    from plait.ulysses_sp.zero_extension import SEQUENCE_KEYS, model_inputs

    out = {k: v for k, v in batch.items() if k not in SEQUENCE_KEYS}
    out.update(model_inputs(batch, mesh))
    return type(batch)(out) if type(batch) is not dict and isinstance(batch, dict) else out


def SequenceParallel(mesh: Any, config: Any = None) -> Any:  # noqa: N802 - a constructor, named as the extension
    """The strategy's ``sp_size`` extension: plait-ulysses-sp's
    :class:`~plait.ulysses_sp.zero_extension.SequenceParallelExtension` with Lightning's settings
    (errors name ``sp_size``; every rank of an sp group loads the same batch, see :func:`sampler_kwargs`).

    Args:
        mesh: the ``dp x sp`` mesh.
        config: a ``plait.ulysses_sp.UlyssesConfig`` (``None``: its defaults).
    """
    from plait.ulysses_sp.zero_extension import SequenceParallelExtension

    return SequenceParallelExtension(mesh, config, setting="sp_size", batches="shared")


def remove_sequence_parallel(module: nn.Module) -> nn.Module:
    """Undo :func:`SequenceParallel` on the HF models inside ``module`` (for ``generate`` or a plain
    evaluation after training): :func:`plait.ulysses_sp.zero_extension.remove_sequence_parallel`.

    Returns:
        ``module``.
    """
    from plait.ulysses_sp.zero_extension import remove_sequence_parallel as remove

    return remove(module)


def ExpertParallel(mesh: Any) -> Any:  # noqa: N802 - a constructor, named as the extension
    """The strategy's ``ep_size`` extension: plait-moe-layers'
    :class:`~plait.moe_layers.zero_extension.ExpertParallelExtension` with Lightning's settings
    (errors name ``ep_size``).

    Args:
        mesh: the ``dp x ep`` mesh.
    """
    from plait.moe_layers.zero_extension import ExpertParallelExtension

    return ExpertParallelExtension(mesh, setting="ep_size")
