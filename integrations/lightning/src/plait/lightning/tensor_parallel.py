"""Tensor parallelism (``tp_size``) for the Trainer strategy: ZeRO over torch's own TP.

As Lightning's ``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)`` does, the
strategy builds a ``("data_parallel", "tensor_parallel")`` ``DeviceMesh`` before ``configure_model``
and hands it to the LightningModule as ``self.device_mesh``; the user's ``configure_model``
applies ``parallelize_module(model, self.device_mesh["tensor_parallel"], plan)``. Instead of
``fully_shard`` on the data-parallel dimension, plait's ZeRO then shards every parameter's TP
shard over ``device_mesh["data_parallel"]`` (:mod:`plait.zero_sharding.tensor_parallel`).

``tensor_parallel`` is the inner mesh dimension, so a TP group is consecutive ranks
``[i * tp, (i + 1) * tp)`` and shares its batches: the sampler splits over the ``dp`` ranks only
(:func:`sampler_kwargs`).

Checkpoints are universal-checkpoint directories as without ``tp_size``: plait-zero-sharding
describes each TP shard's ZeRO pieces by their place in the global tensor, so a checkpoint saved
at ``dp x tp`` resumes at the same layout or at another ``tp_size`` / world size, and
``plait ckpt convert --to hf`` (or the module's ``state_dict()``) gives whole tensors.

Not yet composed: ``tp_size`` with ``sp_size``/``ep_size``, refused before any work with the fix
(:func:`check_tp_size`).
"""

from __future__ import annotations

from typing import Any

MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")
__all__ = ["MESH_DIM_NAMES", "build_mesh", "check_tp_size", "check_world_size", "sampler_kwargs"]


def check_tp_size(tp_size: Any, sp_size: int, ep_size: int) -> None:
    """Refuse a bad ``tp_size`` and the combinations not composed yet (before any process starts).

    Raises:
        ValueError: ``tp_size`` is not a positive int, or is above 1 together with
            ``sp_size``/``ep_size`` above 1 (naming the fix).
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a positive int (1: off) dividing the world size.")
    if tp_size > 1 and (sp_size > 1 or ep_size > 1):
        raise ValueError(f"tp_size={tp_size} with sp_size={sp_size}, ep_size={ep_size}: tensor parallelism does not "
                         "compose with sequence or expert parallelism in the plait strategies yet; use tp_size alone "
                         "(tp_size=N) or sp_size/ep_size alone (tp_size=1).")


def check_world_size(tp_size: int, world_size: int) -> None:
    """Refuse a ``tp_size`` that does not divide the world size (``devices x num_nodes``).

    Raises:
        ValueError: naming ``tp_size``, the world size and the sizes that would work.
    """
    if world_size % tp_size:
        choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"tp_size={tp_size} does not divide the world size {world_size} (devices x num_nodes); "
                         f"use one of {choices}.")


def build_mesh(tp_size: int, world_size: int, device_type: str) -> Any:
    """The ``(data_parallel, tensor_parallel)`` mesh of ``world_size // tp_size`` x ``tp_size``
    ranks, as Lightning's ``ModelParallelStrategy`` builds it. Collective.

    Raises:
        ValueError: ``tp_size`` does not divide ``world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_world_size(tp_size, world_size)
    return init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=MESH_DIM_NAMES)


def sampler_kwargs(kwargs: dict[str, Any], tp_size: int, global_rank: int) -> dict[str, Any]:
    """A strategy's ``distributed_sampler_kwargs`` under ``tp_size``: the sampler splits over the
    data-parallel ranks only (the ranks of one TP group hold the same batch)."""
    if tp_size > 1:
        kwargs = {**kwargs, "num_replicas": kwargs["num_replicas"] // tp_size, "rank": global_rank // tp_size}
    return kwargs
