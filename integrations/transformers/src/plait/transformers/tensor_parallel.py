"""Tensor parallelism (``PlaitConfig.tp_size``) under the HF Trainer: the model's own ``tp_plan``,
plait ZeRO over the data-parallel ranks.

transformers 5.x applies a model's ``tp_plan`` itself in ``from_pretrained(distributed_config=
DistributedConfig(tp_size=N))``, but only on a ``(pp, fsdp, tp)`` mesh that spans the world, with
FSDP2 as its data parallelism. plait keeps the model's plan and its styles (transformers'
``apply_tensor_parallelism``, the same hooks and DTensor placements) and replaces FSDP2 with its
ZeRO, as :mod:`plait.zero_sharding.tensor_parallel` describes:

* the Trainer builds a ``("dp", "tp")`` mesh of ``world / tp_size`` x ``tp_size`` ranks (tp ranks
  consecutive), applies the plan on ``mesh["tp"]`` to the model it was given (built whole on every
  rank, the same weights everywhere), then ``zero_shard`` shards every TP shard over ``mesh["dp"]``;
* the ranks of a tp group must see the same batches, so the Trainer's data loaders are split over
  the dp ranks only (:func:`share_batches`), as Accelerate does for its own ``tp`` meshes. The
  Trainer's token count for the loss (``num_items_in_batch``, gathered over the world) then counts
  each batch ``tp_size`` times and its loss is multiplied by the world size, while ZeRO averages
  gradients over ``dp`` ranks only: the two factors cancel, so the gradient is that of one process
  on the global batch;
* checkpoints and ``save_model()`` hold whole tensors (plait-zero-sharding names TP pieces by their
  place in the global tensor), so they resume at another ``tp_size`` and load with ``from_pretrained``.
"""

from __future__ import annotations

from typing import Any

MESH_DIM_NAMES = ("dp", "tp")


def check_tp_size(tp_size: Any, sp_size: int, ep_size: int) -> None:
    """Refuse a bad ``PlaitConfig.tp_size`` and combinations not composed yet.

    Raises:
        ValueError: ``tp_size`` is not a positive int, or is above 1 with ``sp_size``/``ep_size``
            above 1 (naming the fix).
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"PlaitConfig.tp_size={tp_size!r} must be a positive int (1: off) dividing the world size.")
    if tp_size > 1 and (sp_size > 1 or ep_size > 1):
        raise ValueError(f"PlaitConfig.tp_size={tp_size} with sp_size={sp_size}, ep_size={ep_size}: tensor "
                         "parallelism does not compose with sequence or expert parallelism in the Trainer yet; use "
                         "tp_size alone or sp_size/ep_size alone.")


def check_world_size(tp_size: int, world_size: int) -> None:
    """Refuse a ``tp_size`` that does not divide the number of processes.

    Raises:
        ValueError: naming ``PlaitConfig.tp_size``, the world size and the sizes that would work.
    """
    if world_size % tp_size:
        choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"PlaitConfig.tp_size={tp_size} does not divide the launcher's {world_size} processes; use "
                         f"one of {choices}.")


def check_model(model: Any, tp_size: int) -> dict[str, str]:
    """The model's tensor-parallel plan, after checking that ``tp_size`` can split it.

    Args:
        model: the HF model the Trainer was given.
        tp_size: the tensor-parallel size.

    Returns:
        The plan (module pattern -> transformers' style name).

    Raises:
        ValueError: the model has no ``tp_plan``, or its attention heads (query or key/value) do
            not divide by ``tp_size``; both name the fix.
    """
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(f"PlaitConfig.tp_size={tp_size}: {type(model).__name__} has no tensor-parallel plan "
                         "(config.base_model_tp_plan is empty); use a model whose config defines one (Llama, Qwen, "
                         "Mistral...) or set tp_size=1.")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, field, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(f"PlaitConfig.tp_size={tp_size} does not divide the model's {field}={heads}: each tp "
                             "rank must hold whole heads; pick a tp_size dividing it.")
    return plan


def check_start(model: Any, tp_size: int, world_size: int) -> None:
    """Everything :func:`parallelize` would refuse, checked when the Trainer is built.

    Raises:
        ValueError: see :func:`check_world_size` and :func:`check_model`.
    """
    check_world_size(tp_size, world_size)
    if tp_size > 1:
        check_model(model, tp_size)


def parallelize(model: Any, tp_size: int, device_type: str) -> Any:
    """Build the mesh (collective), apply the model's plan on ``mesh["tp"]`` (in place).

    Returns:
        ``mesh["dp"]``, what ZeRO shards over.
    """
    import torch.distributed as dist

    mesh = build_mesh(tp_size, dist.get_world_size(), device_type)
    apply_tp_plan(model, mesh)
    return mesh["dp"]


def build_mesh(tp_size: int, world_size: int, device_type: str) -> Any:
    """The ``("dp", "tp")`` mesh of ``world_size // tp_size`` x ``tp_size`` ranks. Collective.

    Raises:
        ValueError: ``tp_size`` does not divide ``world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_world_size(tp_size, world_size)
    return init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=MESH_DIM_NAMES)


def apply_tp_plan(model: Any, mesh: Any) -> None:
    """Apply the model's own plan on ``mesh["tp"]`` with transformers' styles (in place): parameters
    become DTensors holding this rank's shards of the weights the model already has.

    Raises:
        ValueError: see :func:`check_model`.
    """
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = check_model(model, mesh["tp"].size())
    apply_tensor_parallelism(model, mesh["tp"], plan)


def share_batches(dataloader: Any, tp_size: int, rank: int) -> Any:
    """Make the ranks of each tp group load the same batches: Accelerate's prepared loader is split
    over ``world / tp_size`` data-parallel ranks instead of every rank (in place).

    Args:
        dataloader: a loader prepared by ``accelerator.prepare`` (its sampler or dataset shard).
        tp_size: the tensor-parallel size.
        rank: this process's global rank.

    Returns:
        ``dataloader``.

    Raises:
        ValueError: a loader that is not split by a ``BatchSamplerShard`` or ``IterableDatasetShard``
            (``dispatch_batches=True``), naming the fix.
    """
    if tp_size == 1:
        return dataloader
    shard = getattr(dataloader, "batch_sampler", None)
    if not hasattr(shard, "num_processes"):
        shard = getattr(dataloader, "dataset", None)
    if not hasattr(shard, "num_processes") or shard.num_processes % tp_size:
        raise ValueError(f"PlaitConfig.tp_size={tp_size}: the Trainer's data loader ({type(dataloader).__name__}) is "
                         "not split per process by Accelerate, so the ranks of a tp group cannot be given the same "
                         "batches; leave TrainingArguments.accelerator_config dispatch_batches unset (False).")
    if shard.num_processes > 1:
        shard.num_processes //= tp_size
        shard.process_index = rank // tp_size
    return dataloader
