"""Sequence parallelism (``sp_size``) and expert parallelism (``ep_size``) under the HF Trainer.

The Trainer adds both as zero-sharding extensions (``composition.ShardingExtension``) once the
process group exists, so they compose with ZeRO as any extension does (sequence parallel at
order 10, MoE at 20, ZeRO last), on the mesh :func:`build_mesh` makes (``dp x ep x sp``, sp
innermost: an sp group is consecutive ranks). The extensions are the feature packages' own (the
Lightning strategies use the same ones); this module translates the Trainer's settings:

* :func:`SequenceParallel` (plait-ulysses-sp): the Trainer shards its data over every rank as
  without sp; each micro-batch of an sp group is gathered and every rank keeps its slice of the
  sequence of the whole group batch (ulysses-sp's ``shard_batch``: true position ids, labels
  shifted before slicing). The same tokens as without sp are trained on per step, each by one
  rank, so the Trainer's sizes (``num_items_in_batch``, total batch size, epochs) stay as they
  are, and the curve is the same Trainer's without sp. The HF model gets Ulysses attention
  (``apply_ulysses``) and a loss on the pre-shifted labels.
* :func:`ExpertParallel` (plait-moe-layers): HF sparse-MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE)
  are converted to plait MoE layers (``convert_hf_moe``, same parameters, same logits), each rank
  keeps ``E / ep`` experts of each layer (``apply_expert_parallel``), and ``regroup`` splits the
  Trainer's optimizer groups into dense ones (sharded over every rank) and expert ones (sharded
  over the expert-data-parallel group, named by their global tensors). Checkpoints and
  ``save_model()`` name every converted parameter as the HF model does (HF's ``gate`` for the
  plait router), so ``from_pretrained`` loads the export.
"""

from __future__ import annotations

import importlib.util
from typing import Any

INSTALL = {"sp_size": ("plait.ulysses_sp", "plait-ulysses-sp", "sp"),
           "ep_size": ("plait.moe_layers", "plait-moe-layers", "moe")}


def check_installed(field: str, value: int) -> None:
    """Raise now when ``sp_size``/``ep_size`` above 1 needs a package that is not installed.

    Raises:
        ImportError: with the pip line.
    """
    module, package, extra = INSTALL[field]
    if value > 1 and importlib.util.find_spec(module) is None:
        raise ImportError(f"PlaitConfig.{field}={value} needs {package}, which is not installed: pip install "
                          f"{package}  (or: pip install 'plait-transformers[{extra}]')")


def check_world_size(sp_size: int, ep_size: int, world_size: int) -> None:
    """Refuse sizes that do not divide the world size (:func:`plait.kernels.mesh.check_parallel_world`).

    Raises:
        ValueError: naming the field, the world size and the sizes that would work.
    """
    from plait.kernels.mesh import check_parallel_world

    check_parallel_world(sp_size, ep_size, world_size, field_prefix="PlaitConfig.", world="the launcher's processes")


def build_mesh(sp_size: int, ep_size: int, device_type: str) -> Any:
    """The ``DeviceMesh`` ``("dp", ["ep",] ["sp"])`` (:func:`plait.kernels.mesh.parallel_mesh`), or
    ``None`` when both sizes are 1. Collective."""
    from plait.kernels.mesh import parallel_mesh

    return parallel_mesh(sp_size, ep_size, device_type=device_type)


def SequenceParallel(mesh: Any, config: Any = None) -> Any:  # noqa: N802 - a constructor, named as the extension
    """The Trainer's ``sp_size`` extension: plait-ulysses-sp's
    :class:`~plait.ulysses_sp.zero_extension.SequenceParallelExtension` with the Trainer's settings.

    Errors name ``PlaitConfig.sp_size``. The Trainer shards its data over every rank, so batches
    are ``"per_rank"``: each micro-batch of an sp group is gathered and every rank keeps its slice
    of the group's batch (``split``), and the Trainer's ``num_items_in_batch`` is the loss's
    divisor (see the module docstring).

    Args:
        mesh: the mesh with an ``sp`` dimension.
        config: a ``plait.ulysses_sp.UlyssesConfig`` (``None``: its defaults).
    """
    from plait.ulysses_sp.zero_extension import SequenceParallelExtension

    return SequenceParallelExtension(mesh, config, setting="PlaitConfig.sp_size", batches="per_rank")


def ExpertParallel(mesh: Any) -> Any:  # noqa: N802 - a constructor, named as the extension
    """The Trainer's ``ep_size`` extension: plait-moe-layers'
    :class:`~plait.moe_layers.zero_extension.ExpertParallelExtension` (errors name
    ``PlaitConfig.ep_size``; HF sparse-MoE blocks converted, their ``hf_names`` used by ``save_model``).

    Args:
        mesh: the mesh with an ``ep`` dimension.
    """
    from plait.moe_layers.zero_extension import ExpertParallelExtension

    return ExpertParallelExtension(mesh, setting="PlaitConfig.ep_size")
