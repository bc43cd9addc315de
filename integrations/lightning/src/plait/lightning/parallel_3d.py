"""The Trainer strategy's model-parallel mesh: ``tp_size``, ``pp_size`` or both (3-D parallelism).

With ``tp_size`` alone the mesh is ``(data_parallel, tensor_parallel)``
(:mod:`plait.lightning.tensor_parallel`), with ``pp_size`` alone ``(data_parallel,
pipeline_parallel)`` (:mod:`plait.lightning.pipeline_parallel`). With both it is
``(data_parallel, pipeline_parallel, tensor_parallel)``, the order torchtitan and
``plait bench parallel-3d`` use: ``tensor_parallel`` innermost (its ranks exchange activations
every layer), then the pipeline stages, then the data-parallel replicas. The composition is the
plain-torch one of plait-zero-sharding, unchanged:

* ``configure_model`` builds this rank's stage (by ``self.device_mesh["pipeline_parallel"]``) and
  applies its TP plan with ``parallelize_module(stage, self.device_mesh["tensor_parallel"], plan)``;
* the strategy shards the stage's TP shards with ``zero_shard`` over
  ``self.device_mesh["data_parallel"]`` (each stage over its own dp group);
* ``training_step`` runs torch's schedule through
  :class:`~plait.zero_sharding.pipelining.ZeroPipelineStage` with
  :func:`plait.lightning.pipeline_parallel.pipeline_step`.

A pipeline of tp groups, ``tp_size x pp_size`` consecutive ranks, shares its batches: the sampler
splits over the data-parallel ranks only (:func:`sampler_kwargs`).
"""

from __future__ import annotations

from typing import Any

from plait.lightning import pipeline_parallel, tensor_parallel

MESH_DIM_NAMES = ("data_parallel", "pipeline_parallel", "tensor_parallel")
__all__ = ["MESH_DIM_NAMES", "build_mesh", "check_world_size", "sampler_kwargs"]


def check_world_size(tp_size: int, pp_size: int, world_size: int) -> None:
    """Refuse a ``tp_size``, ``pp_size`` or ``tp_size x pp_size`` that does not divide the world
    size (``devices x num_nodes``); runs before the launcher starts any process.

    Raises:
        ValueError: naming the field (or both, for the product), the world size and the sizes
            that would work.
    """
    tensor_parallel.check_world_size(tp_size, world_size)
    pipeline_parallel.check_world_size(pp_size, world_size)
    if world_size % (tp_size * pp_size):
        choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"tp_size={tp_size} x pp_size={pp_size} = {tp_size * pp_size} does not divide the world size "
                         f"{world_size} (devices x num_nodes); make the product one of {choices}.")


def build_mesh(tp_size: int, pp_size: int, world_size: int, device_type: str) -> Any:
    """The strategy's mesh for ``tp_size``/``pp_size`` (see the module docstring), or ``None`` when
    both are 1. Collective.

    Raises:
        ValueError: the sizes do not divide ``world_size``.
    """
    if pp_size == 1:
        return tensor_parallel.build_mesh(tp_size, world_size, device_type) if tp_size > 1 else None
    if tp_size == 1:
        return pipeline_parallel.build_mesh(pp_size, world_size, device_type)
    from torch.distributed.device_mesh import init_device_mesh

    check_world_size(tp_size, pp_size, world_size)
    return init_device_mesh(device_type, (world_size // (tp_size * pp_size), pp_size, tp_size),
                            mesh_dim_names=MESH_DIM_NAMES)


def sampler_kwargs(kwargs: dict[str, Any], tp_size: int, pp_size: int, global_rank: int) -> dict[str, Any]:
    """A strategy's ``distributed_sampler_kwargs`` under ``tp_size``/``pp_size``: the sampler splits
    over the data-parallel ranks only (the ``tp_size x pp_size`` ranks of one pipeline read the
    same batch)."""
    group = tp_size * pp_size
    if group > 1:
        kwargs = {**kwargs, "num_replicas": kwargs["num_replicas"] // group, "rank": global_rank // group}
    return kwargs
