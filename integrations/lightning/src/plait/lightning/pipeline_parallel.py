"""Pipeline parallelism (``pp_size``) for the Trainer strategy: ZeRO inside torch's own pipelining.

With ``PlaitStrategy(pp_size=N)`` the strategy builds a ``("data_parallel", "pipeline_parallel")``
``DeviceMesh`` before ``configure_model`` and gives it to the LightningModule as
``self.device_mesh``. The contract with the LightningModule:

* ``configure_model`` builds only this rank's stage (its layers of the whole model, chosen by
  ``self.device_mesh["pipeline_parallel"].get_local_rank()``), and ``forward`` is that stage's
  forward: activations in, activations out (the first stage takes the batch's inputs, the last
  gives what ``loss_fn`` takes). Every parameter of the LightningModule belongs to the stage; ZeRO
  shards them over ``device_mesh["data_parallel"]``, each stage over its own data-parallel group.
* The module trains with manual optimization (``self.automatic_optimization = False``): a
  pipeline schedule runs forward and backward over the microbatches itself, which Lightning's
  automatic loop (one forward returning the loss, then Lightning's backward) cannot drive.
  ``training_step`` calls :func:`pipeline_step`, which runs the schedule (GPipe or 1F1B through
  :class:`~plait.zero_sharding.pipelining.ZeroPipelineStage`: gradients reduced once per step), steps
  the optimizer and returns the step's loss on every rank.

``pipeline_parallel`` is the inner mesh dimension, so a pipeline is consecutive ranks
``[i * pp, (i + 1) * pp)`` that share their batches: the sampler splits over the data-parallel
ranks only (:func:`sampler_kwargs`).

Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=)``) hold the whole
model's names when ``configure_model`` also sets ``self.pipeline_name_map`` (the stage's parameter
name -> the whole model's, e.g. ``plait.universal_ckpt.layer_offset("stage.", first_layer)``), so
they resume bit for bit at the same layout, load at another ``(dp, pp)`` or without ``pp_size``,
and export whole weights; see :mod:`plait.lightning.pipeline_checkpoint`.

With ``tp_size`` too, the mesh is ``(data_parallel, pipeline_parallel, tensor_parallel)`` and
``configure_model`` applies the stage's TP plan on ``self.device_mesh["tensor_parallel"]`` (3-D
parallelism, :mod:`plait.lightning.parallel_3d`); the checkpoints above then hold each TP shard's
pieces by their place in the whole model's tensors.

Gradient clipping: ``pipeline_step(..., gradient_clip_val=v)`` clips by the global norm of the
whole model (every stage, tp and dp rank), as ``Trainer(gradient_clip_val=v)`` does without a
pipeline; Lightning refuses the Trainer argument under manual optimization, and so does the
strategy, before processes start (:func:`check_trainer_clip`).

Not supported with ``pp_size`` (refused before processes start, :func:`check_pp_size`):
``sp_size`` or ``ep_size`` above 1, and the Fabric strategy. Trainer-driven gradient accumulation
(manual optimization leaves it to ``training_step``) and validation through the pipeline are not
provided.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

MESH_DIM_NAMES = ("data_parallel", "pipeline_parallel")
SCHEDULES = ("gpipe", "1f1b")
__all__ = ["MESH_DIM_NAMES", "build_mesh", "check_module", "check_pp_size", "check_trainer_clip", "check_world_size",
           "pipeline_step", "sampler_kwargs"]


def check_pp_size(pp_size: Any, *, sp_size: int, ep_size: int, tp_size: int) -> None:
    """Refuse a bad ``pp_size`` and the combinations not composed in the strategy yet
    (``tp_size`` composes: 3-D parallelism, :mod:`plait.lightning.parallel_3d`).

    Raises:
        ValueError: ``pp_size`` is not a positive int, or is above 1 together with
            ``sp_size``/``ep_size`` above 1 (naming the fix).
    """
    del tp_size  # composes with pp_size (a (data_parallel, pipeline_parallel, tensor_parallel) mesh)
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"pp_size={pp_size!r} must be a positive int (1: off) dividing the world size.")
    others = {name: size for name, size in (("sp_size", sp_size), ("ep_size", ep_size)) if size > 1}
    if pp_size > 1 and others:
        raise ValueError(f"pp_size={pp_size} with {others}: pipeline parallelism does not compose with sequence or "
                         "expert parallelism in the plait Lightning strategy yet; use pp_size with tp_size only (the "
                         "other sizes 1), or compose them by hand with zero_shard (see plait-zero-sharding's README, "
                         "'Pipeline parallelism').")


def check_trainer_clip(pp_size: int, gradient_clip_val: Any) -> None:
    """Refuse ``Trainer(gradient_clip_val=...)`` under ``pp_size > 1`` before processes start
    (Lightning refuses it under manual optimization, but only inside every launched rank).

    Raises:
        ValueError: naming the Trainer argument and the fix (``pipeline_step``'s own).
    """
    if pp_size > 1 and gradient_clip_val:
        raise ValueError(f"Trainer(gradient_clip_val={gradient_clip_val!r}) with PlaitStrategy(pp_size={pp_size}): a "
                         "pipeline trains under manual optimization, where Lightning does not clip; remove it from "
                         "the Trainer and pass it to the step instead: pipeline_step(self, inputs, targets, ..., "
                         f"gradient_clip_val={gradient_clip_val!r}) (the whole model's global norm).")


def check_world_size(pp_size: int, world_size: int) -> None:
    """Refuse a ``pp_size`` that does not divide the world size (``devices x num_nodes``).

    Raises:
        ValueError: naming ``pp_size``, the world size and the sizes that would work.
    """
    if world_size % pp_size:
        choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"pp_size={pp_size} does not divide the world size {world_size} (devices x num_nodes); "
                         f"use one of {choices}.")


def build_mesh(pp_size: int, world_size: int, device_type: str) -> Any:
    """The ``(data_parallel, pipeline_parallel)`` mesh of ``world_size // pp_size`` x ``pp_size``
    ranks. Collective.

    Raises:
        ValueError: ``pp_size`` does not divide ``world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_world_size(pp_size, world_size)
    return init_device_mesh(device_type, (world_size // pp_size, pp_size), mesh_dim_names=MESH_DIM_NAMES)


def sampler_kwargs(kwargs: dict[str, Any], pp_size: int, global_rank: int) -> dict[str, Any]:
    """A strategy's ``distributed_sampler_kwargs`` under ``pp_size``: the sampler splits over the
    data-parallel ranks only (the stages of one pipeline read the same batch)."""
    if pp_size > 1:
        kwargs = {**kwargs, "num_replicas": kwargs["num_replicas"] // pp_size, "rank": global_rank // pp_size}
    return kwargs


def check_module(module: Any, pp_size: int) -> None:
    """Refuse a LightningModule the pipeline cannot drive, before sharding.

    Raises:
        ValueError: automatic optimization is on (naming the fix).
    """
    if pp_size > 1 and module.automatic_optimization:
        raise ValueError(f"PlaitStrategy(pp_size={pp_size}) runs a pipeline schedule, which does its own forward and "
                         "backward over the microbatches; set self.automatic_optimization = False in the "
                         "LightningModule and call plait.lightning.pipeline_parallel.pipeline_step(self, inputs, "
                         "targets, ...) in training_step.")


def _schedule(module: Any, n_microbatches: int, loss_fn: Callable, schedule: str) -> Any:
    """The stage and schedule of ``module``, built on its first step and kept on the module."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from plait.zero_sharding.pipelining import ZeroPipelineStage

    key = (n_microbatches, schedule, loss_fn)
    cached = getattr(module, "_plait_pipeline", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_step(schedule={schedule!r}): use one of {SCHEDULES}.")
    mesh = module.device_mesh
    if mesh is None or "pipeline_parallel" not in (mesh.mesh_dim_names or ()):
        raise ValueError("pipeline_step needs the LightningModule trained under PlaitStrategy(pp_size=N), N > 1 "
                         "(its device_mesh has no 'pipeline_parallel' dimension).")
    pp = mesh["pipeline_parallel"]
    stage = ZeroPipelineStage(module, pp.get_local_rank(), pp.size(), module.device, group=pp.get_group())
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    module._plait_pipeline = (key, runner)
    return runner


def pipeline_step(module: Any, inputs: torch.Tensor, targets: torch.Tensor, *, n_microbatches: int,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  schedule: str = "1f1b", gradient_clip_val: float | None = None) -> torch.Tensor:
    """One training step of the pipeline from ``training_step`` (manual optimization).

    Runs the schedule over ``n_microbatches`` microbatches of this data-parallel rank's batch (the
    first stage feeds ``inputs``, the last computes ``loss_fn(output, targets)`` per microbatch,
    and the gradients of the microbatches add up, as torch's schedules do), then steps and clears
    the optimizer through Lightning (``module.optimizers()``).

    Args:
        module: the LightningModule (its ``forward`` is this rank's stage).
        inputs: the batch's inputs (used by the first stage; every stage receives the batch).
        targets: the batch's targets (used by the last stage).
        n_microbatches: microbatches per step (must divide the batch).
        loss_fn: ``loss_fn(output, target)`` of one microbatch.
        schedule: ``"1f1b"`` (default) or ``"gpipe"``.
        gradient_clip_val: clip the gradients to this global norm before the step (``None``: no
            clipping); the norm is the whole model's, over every stage and tp and dp rank
            (Lightning's ``clip_gradients`` with ``"norm"``, which the plait strategy hands to
            ``ZeroOptimizer.clip_grad_norm_``). The norm before clipping is then the optimizer's
            ``last_grad_norm``.

    Returns:
        The step's loss (sum of the microbatch losses, detached), the same on every stage of the
        pipeline (sent from the last stage).

    Raises:
        ValueError: an unknown schedule, or a module not under ``PlaitStrategy(pp_size > 1)``.
    """
    runner = _schedule(module, n_microbatches, loss_fn, schedule)
    pp = module.device_mesh["pipeline_parallel"]
    rank, size = pp.get_local_rank(), pp.size()
    losses: list[torch.Tensor] = []
    if rank == 0:
        runner.step(inputs)
    elif rank == size - 1:
        runner.step(target=targets, losses=losses)
    else:
        runner.step()
    optimizer = module.optimizers()
    if gradient_clip_val is not None:
        module.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="norm")
    optimizer.step()
    optimizer.zero_grad()
    total = torch.stack([loss.detach() for loss in losses]).sum() if losses else torch.zeros((), device=inputs.device)
    last = dist.get_global_rank(pp.get_group(), size - 1)
    dist.broadcast(total, src=last, group=pp.get_group())
    return total
