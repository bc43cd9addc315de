"""PlaitFabricStrategy: ZeRO stages 1/2/3 for Lightning Fabric (Fabric's own strategy hierarchy).

Usage::

    fabric = L.Fabric(strategy="plait_zero3", devices=2, precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module(empty_init=True):      # parameters on meta; ZeRO materialises shards
        model = MyModel()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    ...
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})   # a directory
    fabric.load("ckpt", state)                                                    # any device count

The model and its optimizer must be set up together (``fabric.setup(model, optimizer)``): ZeRO
builds the optimizer over the shards it creates. ``fabric.setup(model)`` alone shards for
evaluation only.

``sp_size``/``ep_size`` build a ``dp x sp`` / ``dp x ep`` mesh and apply Ulysses / expert
parallelism before ZeRO (:mod:`plait.lightning.parallel`); with ``sp_size > 1`` the user's loop
passes each batch through ``fabric.strategy.split_batch(batch)`` (the sequence slice of this rank)
and ``fabric.setup_dataloaders`` samples over the ``dp`` ranks only.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from plait import universal_ckpt
from plait.kernels import collectives
from plait.lightning import checkpoint as ckpt
from plait.lightning import failures, parallel
from plait.lightning.config import PlaitConfig, check_agreement
from plait.lightning.pieces import check_plan, shard_module, with_nodes
from plait.lightning.precision import PlaitFabricPrecision, precision_name_of
from plait.lightning.strategy import build_config, join_restart_safe, move_module, parallel_plan, rebind_schedulers
from plait.universal_ckpt.directory import resolve
from plait.zero_sharding import ZeroConfig, ZeroModule, ZeroOptimizer, sharded_init


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: accumulate gradients locally."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """ZeRO's ``no_sync`` when enabled.

        Raises:
            TypeError: the module was not set up by a plait strategy.
        """
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, ZeroModule):
            raise TypeError(f"no_backward_sync needs a module set up by the plait strategy, got "
                            f"{type(module).__name__}.")
        return module.no_sync()


def _for_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """ZeroOptimizers become their small options view, sharded models their checkpoint view;
    everything else is saved as it is."""
    def view(value: Any) -> Any:
        if isinstance(value, ZeroOptimizer):
            return ckpt.OptimizerOptions(value)
        if isinstance(value, ZeroModule):
            return ckpt.ShardedModelView(value)
        return value

    return {k: view(v) for k, v in state.items()}


class _GuardedScriptLauncher(_SubprocessScriptLauncher):
    """Fabric's script launcher; the process that starts the other ranks marks itself as their
    launcher first (see :mod:`plait.lightning.failures`: no orphans when it fails)."""

    def __init__(self, timeout_s: float, *args: Any) -> None:
        super().__init__(*args)
        self._timeout_s = timeout_s

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """Mark, then launch as Fabric does."""
        if not self.cluster_environment.creates_processes_externally:
            failures.mark_launcher(self, self._timeout_s)
        return super().launch(function, *args, **kwargs)


class PlaitFabricStrategy(DDPStrategy):
    """ZeRO for Lightning Fabric; arguments as :class:`plait.lightning.PlaitStrategy` (``precision``
    instead of ``precision_plugin``).

    Raises:
        PieceMissingError: an offload setting without a usable plait-offload-io.
        ValueError: contradictory settings (named, with the fix).
    """

    strategy_name = "plait"

    def __init__(self, zero: ZeroConfig | None = None, *, offload: Any = None, extensions: tuple = (),
                 init_fn: Any = None, verify_on_load: bool = True, config: PlaitConfig | None = None,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision: Any = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", sp_size: int = 1, ep_size: int = 1) -> None:
        self.plait_config = build_config(config, zero, offload=offload, extensions=extensions, init_fn=init_fn,
                                         verify_on_load=verify_on_load, sp_size=sp_size, ep_size=ep_size)
        if self.plait_config.tp_size > 1:
            raise ValueError(f"PlaitConfig.tp_size={self.plait_config.tp_size} is supported by the Trainer strategy "
                             "(PlaitStrategy) only; for Fabric, apply parallelize_module yourself and call "
                             "plait.zero_sharding.zero_shard(..., mesh=mesh['dp']).")
        if self.plait_config.pp_size > 1:
            raise ValueError(f"PlaitConfig.pp_size={self.plait_config.pp_size} is supported by the Trainer strategy "
                             "(PlaitStrategy) only; for Fabric, build the stage yourself, shard it with "
                             "plait.zero_sharding.zero_shard(..., mesh=mesh['dp']) and run it with "
                             "plait.zero_sharding.pipelining.ZeroPipelineStage.")
        check_plan(self.plait_config, "32-true")
        self.device_mesh: Any = None  # the dp x sp / dp x ep mesh, built when the model is set up
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._backward_sync_control = _ZeroBackwardSyncControl()

    # ---- failures: no orphans (Fabric has no exception hook: rank 0 stops its ranks at exit) -----
    def _configure_launcher(self) -> None:
        parallel.check_world_size(self.plait_config.sp_size, self.plait_config.ep_size,
                                  self.num_processes * self.num_nodes)  # before any process starts
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            timeout_s = (self._timeout or default_pg_timeout).total_seconds()
            self._launcher = _GuardedScriptLauncher(timeout_s, self.cluster_environment, self.num_processes,
                                                    self.num_nodes)

    def setup_environment(self) -> None:
        """Arm the die-with-rank-0 guard in launched ranks, then set up as DDP does."""
        failures.die_with_launcher()
        super().setup_environment()
        collectives.ensure_publisher()  # report from the start, before this rank's first collective

    def _setup_distributed(self) -> None:
        """Join the process group restart-safely under torchrun (see
        :func:`plait.lightning.strategy.join_restart_safe`), then as DDP does."""
        join_restart_safe(self)
        super()._setup_distributed()

    @property
    def precision(self) -> PlaitFabricPrecision:  # type: ignore[override]
        return self._precision if self._precision is not None else PlaitFabricPrecision("32-true")

    @precision.setter
    def precision(self, plugin: Any) -> None:
        if plugin is None:
            self._precision = None
            return
        name = precision_name_of(plugin)
        check_agreement(self.plait_config.zero, name)
        check_plan(self.plait_config, name)
        self._precision = plugin if isinstance(plugin, PlaitFabricPrecision) else PlaitFabricPrecision(name)

    # ---- sequence parallelism ---------------------------------------------------------------------
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With ``sp_size > 1`` the sampler splits over the ``dp`` ranks only (an sp group shares its batches)."""
        return parallel.sampler_kwargs(super().distributed_sampler_kwargs, self.plait_config.sp_size, self.global_rank)

    def split_batch(self, batch: Any) -> Any:
        """This rank's slice of the sequence (:func:`plait.lightning.parallel.split_batch`); the batch
        unchanged with ``sp_size == 1``.

        Raises:
            RuntimeError: called before ``fabric.setup`` built the mesh.
        """
        if self.plait_config.sp_size == 1:
            return batch
        if self.device_mesh is None:
            raise RuntimeError("split_batch needs the sp mesh, built by fabric.setup(model, optimizer); call it first.")
        return parallel.split_batch(batch, self.device_mesh)

    def _parallel_plan(self) -> tuple[PlaitConfig, Any]:
        plan, self.device_mesh, group = parallel_plan(self.plait_config, self.root_device.type, self.world_size)
        return with_nodes(plan, self.num_nodes, self.num_processes, group), group

    # ---- setup ----------------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``empty_init=True``: the modules' own constructors run and each rank keeps a slice of every
        parameter as it is built (see ``plait.zero_sharding.sharded_init``); ZeRO shards them."""
        if empty_init and self.plait_config.ep_size == 1:  # expert parallelism slices a whole model
            return sharded_init(init="meta" if self.plait_config.init_fn is not None else "construct")
        return super().module_init_context(empty_init=empty_init)

    def module_to_device(self, module: nn.Module) -> None:
        """Move the module (only its buffers while its parameters are sliced or on meta)."""
        move_module(module, self.root_device)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Any], Any]:
        """Shard the module with its one optimizer; re-bind the scheduler to the ZeroOptimizer.

        Raises:
            ValueError: other than one optimizer.
        """
        if len(optimizers) != 1:
            raise ValueError(f"fabric.setup got {len(optimizers)} optimizers; the plait strategies shard exactly one.")
        self.precision.device_type = self.root_device.type
        original = optimizers[0]
        plan, group = self._parallel_plan()
        module, zero_optimizer = shard_module(module, original, plan, self.precision.precision, group=group)
        if scheduler is not None:
            rebind_schedulers([scheduler], original, zero_optimizer)
        return module, [zero_optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard for evaluation only (an optimizer without state, SGD at lr 0)."""
        self.precision.device_type = self.root_device.type
        plan, group = self._parallel_plan()
        module, _ = shard_module(module, torch.optim.SGD, plan, self.precision.precision, lr=0.0, group=group)
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Refused: ZeRO builds the optimizer over its shards.

        Raises:
            ValueError: always, with the call to use instead.
        """
        raise ValueError("the plait strategies set the model and optimizer up together: call "
                         "fabric.setup(model, optimizer) instead of setup_module() + setup_optimizers().")

    # ---- gradients ------------------------------------------------------------------------------
    def clip_gradients_norm(self, module: nn.Module, optimizer: Any, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Global L2 norm across every shard; clipping happens inside the next ``step()``.

        Raises:
            ValueError: a norm other than 2.
            RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: the plait strategies clip the global L2 norm only; use 2.0.")
        norm = torch.tensor(optimizer.clip_grad_norm_(float(max_norm)))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total gradient norm is {norm.item()}; pass error_if_nonfinite=False to go on.")
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: float | int) -> None:
        """Refused: ZeRO knows only the global norm of its sharded gradients.

        Raises:
            ValueError: always.
        """
        raise ValueError("clip_gradients(clip_val=...) is not supported with ZeRO; use max_norm=.")

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Any] | None = None) -> None:
        """Save ``state`` as a universal-checkpoint directory (collective).

        Raises:
            TypeError: ``storage_options`` or ``filter`` (not supported by directory checkpoints).
        """
        if storage_options is not None or filter:
            raise TypeError("the plait strategies save universal-checkpoint directories; storage_options and "
                            "filter are not supported.")
        step = state.get("step", state.get("global_step", 0))
        ckpt.save_directory(path, _for_checkpoint(state), step=int(step) if isinstance(step, int) else 0)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a directory checkpoint into ``state`` in place, resharding to this world size.

        Returns:
            Saved values whose keys are not in ``state``.

        Raises:
            ValueError: a directory checkpoint without a ``state`` dict to load into.
        """
        if not ckpt.is_directory_checkpoint(path):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            raise ValueError("a plait checkpoint directory loads into live objects: pass fabric.load(path, "
                             "{'model': model, 'optimizer': optimizer, ...}); for whole weights without a model use "
                             "plait.lightning.consolidated_state_dict(path).")
        keys = universal_ckpt.read_manifest(resolve(path)).keys
        missing = [k for k in state if k not in keys]
        if strict and missing:
            raise KeyError(f"keys {missing} are not in checkpoint {path} (it has {keys}); pass strict=False.")
        target = _for_checkpoint({k: v for k, v in state.items() if k in keys})
        extra = {k: None for k in keys if k not in state}
        loaded = {**target, **extra}
        ckpt.load_directory(path, loaded, verify=self.plait_config.verify_on_load, strict=False)
        for key, value in state.items():
            if key in loaded and not isinstance(value, (nn.Module, torch.optim.Optimizer)) \
                    and not hasattr(value, "load_state_dict"):
                state[key] = loaded[key]
        return {k: loaded[k] for k in extra}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the ``plait_*`` names in Fabric's registry."""
        from plait.lightning.config import register_names

        register_names(strategy_registry, cls)
