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

Not yet composed: ``tp_size`` with ``sp_size``/``ep_size`` and checkpoints of a TP model (the
universal-checkpoint writer would name TP shards by global names); both are refused before any
work with the fix (:func:`check_tp_size`, :func:`check_no_checkpointing`).
"""

from __future__ import annotations

from typing import Any

MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")
# What a user can do instead of saving a checkpoint of a TP model today (named in every refusal).
CHECKPOINT_FIX = ("pass Trainer(enable_checkpointing=False) and do not call trainer.save_checkpoint; to keep the "
                  "weights, gather them on every rank and let DTensor assemble the TP shards: inside "
                  "`with module.gathered_parameters():` take p.full_tensor() of each DTensor parameter.")
__all__ = ["CHECKPOINT_FIX", "MESH_DIM_NAMES", "build_mesh", "check_no_checkpointing", "check_tp_size",
           "check_world_size", "sampler_kwargs"]


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


def check_no_checkpointing(trainer: Any, tp_size: int) -> None:
    """Refuse a Trainer that would save checkpoints of a TP model (a ``ModelCheckpoint``
    callback, which ``enable_checkpointing=True`` adds by default).

    Raises:
        NotImplementedError: ``tp_size > 1`` and the Trainer has a checkpoint callback.
    """
    if tp_size > 1 and getattr(trainer, "checkpoint_callbacks", None):
        raise NotImplementedError(f"PlaitStrategy(tp_size={tp_size}) cannot save checkpoints of a tensor-parallel "
                                  f"model yet, and this Trainer has a ModelCheckpoint callback; {CHECKPOINT_FIX}")


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
