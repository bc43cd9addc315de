"""PlaitStrategy: ZeRO stages 1/2/3 for the Lightning Trainer, on CPU (gloo) and GPU (NCCL).

Derived from Lightning's ``DDPStrategy`` for its process launching, rank bookkeeping and
collectives (``self.log(..., sync_dist=True)``, barriers), not from ``DeepSpeedStrategy`` (which
imports deepspeed). What differs from DDP:

* ``setup``: the optimizer from ``configure_optimizers`` is handed to ``zero_shard`` together
  with the LightningModule (sharded in place); LR schedulers are re-bound to the returned
  ``ZeroOptimizer``. ``configure_model`` runs under :func:`plait.zero_sharding.sharded_init`, so
  no rank ever materialises the whole model.
* steps run through a thin root module, so ``training_step``/``validation_step`` go through the
  LightningModule's ``__call__`` and ZeRO's stage-3 root hooks gather the top-level weights.
* checkpoints are universal-checkpoint directories (see :mod:`plait.lightning.checkpoint`),
  loadable at any number of devices.
* every input check (precision, clip settings against ZeroConfig, missing pieces) runs when
  the Trainer is built or right before the launcher starts processes.
* ``sp_size``/``ep_size`` (:mod:`plait.lightning.parallel`): a ``dp x sp`` or ``dp x ep`` mesh,
  Ulysses or expert parallelism applied as extensions before ZeRO, batches split along the
  sequence for the sp ranks (and the sampler sized to ``dp``).
* ``tp_size`` (:mod:`plait.lightning.tensor_parallel`): as Lightning's ``ModelParallelStrategy``, a
  ``(data_parallel, tensor_parallel)`` mesh is built before ``configure_model`` and given to the
  LightningModule as ``self.device_mesh``; the user applies ``parallelize_module`` on its
  ``"tensor_parallel"`` dimension and ZeRO shards over ``"data_parallel"``.
* ``pp_size`` (:mod:`plait.lightning.pipeline_parallel`): a ``(data_parallel, pipeline_parallel)``
  mesh given to the LightningModule before ``configure_model``, which builds this rank's stage;
  ZeRO shards it over ``"data_parallel"`` and ``training_step`` runs torch's pipeline schedule
  under manual optimization (``pipeline_step``). With ``tp_size`` too, a ``(data_parallel,
  pipeline_parallel, tensor_parallel)`` mesh (:mod:`plait.lightning.parallel_3d`).
* a failing rank leaves no orphans (:mod:`plait.lightning.failures`), and every training step
  sets the flight log's step, so a collective's error says at which step it failed.
* on SLURM with auto-requeue (Lightning's default there), the requeue signal's checkpoint is saved
  by every rank together at the next step boundary (:class:`plait.lightning.slurm.SlurmRequeue`),
  not from inside the signal handler; the requeued ``fit()`` resumes from it by itself.
* under ``torchrun --max-restarts`` the default group is joined through
  :func:`plait.kernels.collectives.init_process_group` (:func:`join_restart_safe`), so a restarted
  worker never reads the previous attempt's addresses and ``fit(ckpt_path="last")`` resumes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import shutil
import sys
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from plait.kernels import collectives
from plait.lightning import checkpoint as ckpt
from plait.lightning import failures, parallel, parallel_3d, pipeline_parallel
from plait.lightning.config import PlaitConfig, check_agreement
from plait.lightning.pieces import check_plan, shard_module, with_nodes
from plait.lightning.pipeline_checkpoint import carry_optimizer_steps
from plait.lightning.precision import PlaitPrecision, precision_name_of
from plait.lightning.slurm import SlurmRequeue
from plait.zero_sharding import ConstructedParameter, ZeroConfig, ZeroModule, sharded_init

_FROM_DIRECTORY = "plait_directory_checkpoint"


class _CheckedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, checking the Trainer's arguments before it starts any process."""

    def __init__(self, strategy: PlaitStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._plait_strategy = strategy

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Check, then launch as Lightning does."""
        if trainer is not None:
            self._plait_strategy.check_trainer(trainer)
        if not self.cluster_environment.creates_processes_externally:  # only the process that starts ranks
            failures.mark_launcher(self, (self._plait_strategy._timeout or default_pg_timeout).total_seconds())
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _CheckedMultiprocessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, checking the Trainer's arguments first."""

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Check, then launch as Lightning does."""
        if trainer is not None:
            self._strategy.check_trainer(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ShardedRoot(nn.Module):
    """The module Lightning calls for every step: forwards to the LightningModule's ``__call__``
    (which Lightning's forward redirection points at ``training_step`` etc.), so the hooks ZeRO
    registered on the LightningModule run around every step."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped LightningModule."""
        return self.module(*args, **kwargs)


def build_config(config: PlaitConfig | None, zero: ZeroConfig | None, *, offload: Any, extensions: tuple,
                 init_fn: Any, verify_on_load: bool, sp_size: int = 1, ep_size: int = 1,
                 tp_size: int = 1, pp_size: int = 1) -> PlaitConfig:
    """One PlaitConfig from either ``config=`` or its fields.

    Raises:
        ValueError: both were given.
    """
    if config is not None:
        if zero is not None or offload is not None or extensions or init_fn is not None or not verify_on_load \
                or sp_size != 1 or ep_size != 1 or tp_size != 1 or pp_size != 1:
            raise ValueError("pass config=PlaitConfig(...) or zero=/offload=/extensions=/init_fn=/verify_on_load=/"
                             "sp_size=/ep_size=/tp_size=/pp_size=, not both.")
        return config
    return PlaitConfig(zero=zero or ZeroConfig(), offload=offload, extensions=tuple(extensions), init_fn=init_fn,
                       verify_on_load=verify_on_load, sp_size=sp_size, ep_size=ep_size, tp_size=tp_size,
                       pp_size=pp_size)


def parallel_plan(plan: PlaitConfig, device_type: str, world_size: int) -> tuple[PlaitConfig, Any, Any]:
    """Build the mesh of ``plan.sp_size``/``plan.ep_size`` (collective) and add their extensions.

    Returns:
        ``(plan with the extensions, mesh or None, what ZeRO shards over)``: the ``dp x sp`` mesh
        (ZeRO's default ``shard_dims``) with sp alone, the world with ep (every rank is data
        parallel for the dense parameters; experts go to their own expert-data-parallel groups
        through the parameter groups).

    Raises:
        ValueError: a size that does not divide ``world_size``.
    """
    parallel.check_world_size(plan.sp_size, plan.ep_size, world_size)
    mesh = parallel.build_mesh(plan.sp_size, plan.ep_size, device_type)
    if mesh is None:
        return plan, None, None
    added: list[Any] = []
    if plan.sp_size > 1:
        added.append(parallel.SequenceParallel(mesh))
    if plan.ep_size > 1:
        added.append(parallel.ExpertParallel(mesh))
    plan = dataclasses.replace(plan, extensions=(*plan.extensions, *added))
    return plan, mesh, (mesh if plan.ep_size == 1 else None)


def join_restart_safe(strategy: Any) -> bool:
    """Join the default process group restart-safely when torchrun's agent store is in use.

    Lightning's strategies call ``torch.distributed.init_process_group`` themselves, whose store
    keys are the same in every torchrun attempt: a restarted rank could read the previous attempt's
    gloo addresses and fail (see :mod:`plait.kernels.collectives.restarts`). Under torchelastic
    (``TORCHELASTIC_USE_AGENT_STORE=True``) this joins first through
    :func:`plait.kernels.collectives.init_process_group`, with the strategy's backend, timeout and
    device; Lightning's own setup then finds the group initialized and keeps it. Elsewhere
    (Lightning's launcher, SLURM) it does nothing.

    Args:
        strategy: a Lightning Trainer or Fabric DDP-derived strategy (``_get_process_group_backend``,
            ``_timeout``, ``root_device``).

    Returns:
        Whether it joined the group.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    backend = strategy._get_process_group_backend()
    device = strategy.root_device
    collectives.init_process_group(backend, timeout=strategy._timeout or default_pg_timeout,
                                   device_id=device if device.type != "cpu" else None)
    if backend == "nccl":  # what Lightning's own init registers (torch warns about an undestroyed NCCL group)
        atexit.register(_destroy_dist_connection)
    return True


def rebind_schedulers(schedulers: list[Any], old: Any, new: Any) -> None:
    """Point LR schedulers built on the user's optimizer at the ZeroOptimizer (whose groups were
    copied from it, ``initial_lr`` included), keeping torch's step-order bookkeeping."""
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
    if schedulers and not hasattr(new.step, "_wrapped_by_lr_sched"):
        step = new.step

        @functools.wraps(step)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            new._opt_called = True
            return step(*args, **kwargs)

        tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        new.step = tracked


def move_module(module: nn.Module, device: torch.device) -> None:
    """Move a module to ``device``; with parameters built under ``sharded_init`` (sliced as they
    were constructed, or on the meta device) only its buffers move, and ZeRO puts the parameters on
    ``device`` when it shards."""
    if any(p.is_meta or isinstance(p, ConstructedParameter) for p in module.parameters()):
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta:
                    sub._buffers[name] = buf.to(device)
    else:
        module.to(device)


class PlaitStrategy(DDPStrategy):
    """ZeRO for the Lightning Trainer.

    Args:
        zero: the ZeRO settings (default ``ZeroConfig()``: stage 3).
        offload: ``"cpu"``/``"nvme"`` (needs plait-offload-io) or an ``OffloadConfig``.
        extensions: :class:`~plait.zero_sharding.composition.ShardingExtension` objects.
        init_fn: initialiser for modules built in ``configure_model``.
        verify_on_load: check checkpoint hashes on load.
        sp_size: Ulysses sequence parallelism over ``sp_size`` ranks (plait-ulysses-sp; 1: off).
        ep_size: expert parallelism over ``ep_size`` ranks (plait-moe-layers; 1: off).
        tp_size: tensor parallelism over ``tp_size`` ranks (1: off). ``configure_model`` then
            builds the model whole (no sliced construction) and applies
            ``parallelize_module(model, self.device_mesh["tensor_parallel"], plan)``; ZeRO shards
            the TP shards over ``self.device_mesh["data_parallel"]``. Its checkpoints name every
            piece by its place in the global tensor, so they resume at another ``tp_size`` or
            world size too; not with ``sp_size``/``ep_size`` yet.
        pp_size: pipeline stages (1: off). ``configure_model`` builds this rank's stage (from
            ``self.device_mesh["pipeline_parallel"]``), ZeRO shards it over
            ``self.device_mesh["data_parallel"]``, and ``training_step`` runs the schedule with
            :func:`plait.lightning.pipeline_parallel.pipeline_step` under manual optimization.
            Checkpoints hold the whole model's names given ``self.pipeline_name_map``
            (:mod:`plait.lightning.pipeline_checkpoint`). With ``tp_size`` too: 3-D parallelism
            (:mod:`plait.lightning.parallel_3d`); not with ``sp_size``/``ep_size`` yet.
        config: a whole :class:`PlaitConfig` instead of the fields above.
        accelerator: as for ``DDPStrategy``.
        parallel_devices: as for ``DDPStrategy``.
        cluster_environment: as for ``DDPStrategy``.
        checkpoint_io: as for ``DDPStrategy``.
        precision_plugin: as for ``DDPStrategy``.
        process_group_backend: as for ``DDPStrategy``.
        timeout: as for ``DDPStrategy``.
        start_method: as for ``DDPStrategy``.

    Raises:
        PieceMissingError: an offload setting without a usable plait-offload-io; ``sp_size > 1``
            without plait-ulysses-sp, ``ep_size > 1`` without plait-moe-layers.
        ValueError: contradictory settings (named, with the fix); ``sp_size``/``ep_size`` not
            dividing the world size (before the launcher starts processes); ``tp_size`` with
            ``sp_size``/``ep_size``.

    Example::

        trainer = L.Trainer(strategy=PlaitStrategy(zero=ZeroConfig(stage=2)), devices=2)
        trainer = L.Trainer(strategy=PlaitStrategy(sp_size=2), devices=4)     # dp 2 x sp 2
        trainer = L.Trainer(strategy=PlaitStrategy(tp_size=2), devices=4)     # dp 2 x tp 2
    """

    strategy_name = "plait"

    def __init__(self, zero: ZeroConfig | None = None, *, offload: Any = None, extensions: tuple = (),
                 init_fn: Any = None, verify_on_load: bool = True, config: PlaitConfig | None = None,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", sp_size: int = 1, ep_size: int = 1, tp_size: int = 1,
                 pp_size: int = 1) -> None:
        self.plait_config = build_config(config, zero, offload=offload, extensions=extensions, init_fn=init_fn,
                                         verify_on_load=verify_on_load, sp_size=sp_size, ep_size=ep_size,
                                         tp_size=tp_size, pp_size=pp_size)
        check_plan(self.plait_config, "32-true")
        # the dp x sp / dp x ep mesh (built in setup) or the dp x tp mesh (built in setup_environment)
        self.device_mesh: Any = None
        self._slurm_requeue: SlurmRequeue | None = None  # on SLURM with auto-requeue, from on_train_start
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)

    # ---- precision: whatever plugin the connector built becomes a PlaitPrecision -----------------
    @property
    def precision_plugin(self) -> PlaitPrecision:  # type: ignore[override]
        return self._precision_plugin if self._precision_plugin is not None else PlaitPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        name = precision_name_of(plugin)
        check_agreement(self.plait_config.zero, name)
        check_plan(self.plait_config, name)
        device = "cuda" if type(getattr(self, "_accelerator", None)).__name__ == "CUDAAccelerator" else None
        self._precision_plugin = plugin if isinstance(plugin, PlaitPrecision) else PlaitPrecision(name, device)

    # ---- checks right before processes start ----------------------------------------------------
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _CheckedScriptLauncher(self, self.cluster_environment, self.num_processes,
                                                    self.num_nodes)
        else:
            self._launcher = _CheckedMultiprocessingLauncher(self, start_method=self._start_method)

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse Trainer arguments that contradict the ZeroConfig (runs before any process starts).

        Raises:
            ValueError: naming both settings and the fix.
        """
        algorithm = getattr(trainer, "gradient_clip_algorithm", None)
        algorithm = getattr(algorithm, "value", algorithm)
        check_agreement(self.plait_config.zero, self.precision_plugin.precision,
                        gradient_clip_val=getattr(trainer, "gradient_clip_val", None),
                        gradient_clip_algorithm=algorithm if getattr(trainer, "gradient_clip_val", None) else None)
        check_plan(self.plait_config, self.precision_plugin.precision)
        parallel.check_world_size(self.plait_config.sp_size, self.plait_config.ep_size,
                                  self.num_processes * self.num_nodes)
        parallel_3d.check_world_size(self.plait_config.tp_size, self.plait_config.pp_size,
                                     self.num_processes * self.num_nodes)
        pipeline_parallel.check_trainer_clip(self.plait_config.pp_size, getattr(trainer, "gradient_clip_val", None))

    # ---- sequence parallelism: sp groups share batches, each rank keeps its slice of the sequence
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With ``sp_size > 1`` or ``tp_size > 1`` the sampler splits over the ``dp`` ranks only (an sp
        or tp group shares its batches)."""
        kwargs = parallel.sampler_kwargs(super().distributed_sampler_kwargs, self.plait_config.sp_size,
                                         self.global_rank)
        return parallel_3d.sampler_kwargs(kwargs, self.plait_config.tp_size, self.plait_config.pp_size,
                                          self.global_rank)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch; with ``sp_size > 1`` keep this rank's slice of the sequence
        (:func:`plait.lightning.parallel.split_batch`)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.plait_config.sp_size > 1 and self.device_mesh is not None:
            batch = parallel.split_batch(batch, self.device_mesh)
        return batch

    # ---- failures: no orphans, named steps -------------------------------------------------------
    def setup_environment(self) -> None:
        """Arm the die-with-rank-0 guard in launched ranks, then set up as DDP does. With
        ``tp_size``/``pp_size`` above 1, build their mesh (:func:`plait.lightning.parallel_3d.build_mesh`) and
        give it to the LightningModule (``self.device_mesh`` in ``configure_model``), as ModelParallelStrategy does."""
        failures.die_with_launcher()
        super().setup_environment()
        collectives.ensure_publisher()  # report from the start, before this rank's first collective
        if self.plait_config.tp_size > 1 or self.plait_config.pp_size > 1:  # (dp, [pp,] [tp]): parallel_3d
            self.device_mesh = parallel_3d.build_mesh(self.plait_config.tp_size, self.plait_config.pp_size,
                                                      self.world_size, self.root_device.type)
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self.device_mesh

    def setup_distributed(self) -> None:
        """Join the process group restart-safely under torchrun (:func:`join_restart_safe`), then
        as DDP does (which keeps a group already joined)."""
        join_restart_safe(self)
        super().setup_distributed()

    def on_exception(self, exception: BaseException) -> None:
        """Lightning's hook on any exception: on rank 0, kill the ranks it launched (else they
        would be left waiting in a collective with nobody to kill them)."""
        super().on_exception(exception)
        failures.stop_launched_ranks(self._launcher, exception)

    def on_train_start(self) -> None:
        """On SLURM with auto-requeue, take the requeue signal over from Lightning's handler
        (:class:`plait.lightning.slurm.SlurmRequeue`)."""
        super().on_train_start()
        self._slurm_requeue = SlurmRequeue.install(self.lightning_module.trainer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """At every batch start under SLURM auto-requeue: save and requeue if any rank was signalled."""
        super().on_train_batch_start(batch, batch_idx)
        if self._slurm_requeue is not None:
            self._slurm_requeue.at_batch_start()

    def on_train_end(self) -> None:
        """At the end of a finished fit (every rank reaches it), name the rank the others waited
        on most (:func:`plait.kernels.collectives.wait_summary`, a small collective), on rank 0."""
        super().on_train_end()
        if self._slurm_requeue is not None:
            self._slurm_requeue.uninstall()
        summary = collectives.wait_summary()
        if self.is_global_zero:
            print(f"plait: {summary}", file=sys.stderr, flush=True)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Record the step in the flight log, so a failing collective names it; then step as DDP."""
        collectives.set_step(self.lightning_module.trainer.global_step)
        return super().training_step(*args, **kwargs)

    # ---- setup ----------------------------------------------------------------------------------
    def model_to_device(self) -> None:
        """Move the LightningModule (only buffers when its parameters are still on meta)."""
        move_module(self.lightning_module, self.root_device)

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs the modules' own constructors, each rank keeping a slice of
        every parameter as it is built (bitwise the weights of a plain build with the same seed);
        ZeRO then shards them. With ``init_fn`` set, parameters go to the meta device instead and
        ZeRO initialises each module with it. With ``ep_size > 1`` the model is built whole (expert
        parallelism keeps a block of each layer's experts before ZeRO shards the rest), and so
        with ``tp_size > 1`` (``parallelize_module`` needs whole weights to cut its TP shards)."""
        if self.plait_config.ep_size > 1 or self.plait_config.tp_size > 1 or self.plait_config.pp_size > 1:
            yield  # with pp_size, each stage is built by its own ranks, not by the world together
            return
        with sharded_init(init="meta" if self.plait_config.init_fn is not None else "construct"):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the LightningModule and its optimizer (see the module docstring).

        Raises:
            ValueError: ``configure_optimizers`` returned other than one optimizer, or a model
                already sharded for evaluation is now fitted.
        """
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        module = self.lightning_module
        self.model_to_device()
        if self.plait_config.tp_size > 1 or self.plait_config.pp_size > 1:
            # mesh from setup_environment; ZeRO over its data-parallel ranks (each stage over its own)
            pipeline_parallel.check_module(module, self.plait_config.pp_size)
            plan, group = self.plait_config, self.device_mesh["data_parallel"]
        else:
            plan, self.device_mesh, group = parallel_plan(self.plait_config, self.root_device.type, self.world_size)
            plan = with_nodes(plan, self.num_nodes, self.num_processes, group)  # ZeRO-3's two hops across nodes
        clip = getattr(trainer, "gradient_clip_val", None) or None
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(f"configure_optimizers returned {len(self.optimizers)} optimizers; the plait "
                                 "strategies shard exactly one (put parameter groups in one optimizer).")
            original = self.optimizers[0]
            if isinstance(module, ZeroModule) and type(module.zero_optimizer.inner) is not type(original):
                raise ValueError("this LightningModule was sharded for evaluation (validate/test/predict) before "
                                 "fit; build a fresh model for training.")
            _, zero_optimizer = shard_module(module, original, plan, self.precision_plugin.precision,
                                             gradient_clip_val=clip, group=group)
            rebind_schedulers([c.scheduler for c in self.lr_scheduler_configs], original, zero_optimizer)
            self.optimizers = [zero_optimizer]
        else:
            # Evaluation only: shard with an optimizer that holds no state (SGD at lr 0).
            shard_module(module, torch.optim.SGD, plan, self.precision_plugin.precision, lr=0.0, group=group)
        self.model = ShardedRoot(module)
        self.setup_precision_plugin()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: backward passes inside keep gradients local."""
        module = self.lightning_module
        if isinstance(module, ZeroModule):
            with module.no_sync():
                yield
        else:
            yield

    # ---- checkpoints ----------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded model, so after ``setup``."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the model is saved sharded, under the checkpoint's ``model`` key."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's options and step count (moments travel with the sharded model)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return ckpt.optimizer_options(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Save a universal-checkpoint directory at ``filepath`` (collective; every rank writes its shard).

        Raises:
            TypeError: ``storage_options`` given.
        """
        if storage_options is not None:
            raise TypeError("the plait strategies save universal-checkpoint directories and take no storage_options.")
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        view = self._model_view()
        ckpt.save_directory(filepath, {ckpt.MODEL_KEY: view, ckpt.LIGHTNING_KEY: rest},
                            step=int(checkpoint.get("global_step", 0)), aliases=view.checkpoint_aliases())

    def _model_view(self) -> ckpt.ShardedModelView:
        """The sharded model as a checkpoint holds it: with ``pp_size > 1``, this stage's pieces
        under the whole model's names (:mod:`plait.lightning.pipeline_checkpoint`)."""
        if self.plait_config.pp_size > 1:
            from plait.lightning.pipeline_checkpoint import PipelineModelView

            return PipelineModelView(self.lightning_module)
        return ckpt.ShardedModelView(self.lightning_module)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a universal-checkpoint directory into the sharded model (any saved world size) and
        return Lightning's part of it. A checkpoint directory written by Lightning's
        ``DeepSpeedStrategy`` (ZeRO 1-3) resumes too (plait-universal-ckpt's importer reshards it to
        this world size and stage); a regular ``.ckpt`` file is read as usual (weights only)."""
        tag_dir = ckpt.deepspeed_tag(checkpoint_path)
        if tag_dir is not None and self.plait_config.pp_size > 1:
            raise ValueError(f"ckpt_path={str(checkpoint_path)!r} is a DeepSpeed checkpoint, which "
                             f"PlaitStrategy(pp_size={self.plait_config.pp_size}) does not read (its tensors carry the "
                             "whole model's names, a stage's do not); resume it once under a PlaitStrategy without "
                             "pp_size and save a plait checkpoint, then resume that one with pp_size and "
                             "self.pipeline_name_map set in configure_model.")
        if tag_dir is not None:
            loaded = ckpt.load_deepspeed_directory(self.lightning_module, tag_dir)
        elif not ckpt.is_directory_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        else:
            state: dict[str, Any] = {ckpt.MODEL_KEY: self._model_view(), ckpt.LIGHTNING_KEY: None}
            ckpt.load_directory(checkpoint_path, state, verify=self.plait_config.verify_on_load)
            loaded = dict(state[ckpt.LIGHTNING_KEY] or {})
            # a pipelined run counts its steps in manual optimization, most others in automatic
            carry_optimizer_steps(loaded, self.lightning_module.automatic_optimization)
        loaded["state_dict"] = {}
        loaded[_FROM_DIRECTORY] = True
        return loaded

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing for directory checkpoints (already loaded); whole tensors from a file otherwise."""
        if not checkpoint.get(_FROM_DIRECTORY):
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore optimizer options and step count (moments came with the model).

        Raises:
            ValueError: a file checkpoint's full optimizer state (it cannot be split into shards here).
        """
        if not checkpoint.get(_FROM_DIRECTORY):
            raise ValueError("this checkpoint is a regular Lightning file: its weights load into the plait strategy, "
                             "its optimizer state does not. Load weights only (LightningModule.load_from_checkpoint) "
                             "or resume from a plait checkpoint directory.")
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            ckpt.load_optimizer_options(optimizer, state)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint directory (rank 0)."""
        path = Path(filepath)
        if self.is_global_zero and (path.exists() or path.is_symlink()):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def teardown(self) -> None:
        """Unwrap the root; leave shards and optimizer state where ZeRO put them."""
        if self.lightning_module is not None:
            self.model = self.lightning_module
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def from_deepspeed(cls, config: Any, **kwargs: Any) -> PlaitStrategy:
        """The strategy for a Lightning DeepSpeed setup: a ``ds_config`` (dict or JSON path) or a name
        such as ``"deepspeed_stage_3"`` (see :mod:`plait.lightning.deepspeed_config`).

        Args:
            config: the DeepSpeed config or Lightning DeepSpeed strategy name.
            **kwargs: further ``PlaitStrategy`` arguments (not ``zero``/``offload``/``config``).

        Returns:
            The strategy.

        Raises:
            ValueError: a refused key (named by its dotted path) or an unknown name.
        """
        from plait.lightning.deepspeed_config import strategy_kwargs

        return cls(**strategy_kwargs(config), **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the ``plait_*`` names (see :mod:`plait.lightning.registry`)."""
        from plait.lightning.config import register_names

        register_names(strategy_registry, cls)
