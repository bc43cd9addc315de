"""``with_plait(TrainerCls)``: any HF ``Trainer`` subclass (TRL's included) trained on plait ZeRO.

The mixin keeps Accelerate in plain DDP / single-process mode for data loading, logging and
collectives, and takes over what sharding changes; each override is listed, with its reason, in
``docs/patches.md``:

* ``_build_accelerator_args``: no Accelerate mixed precision (plait owns dtypes and fp16 loss
  scaling) and no optimizer device placement (its state round-trip would copy every shard).
* ``create_accelerator_and_postprocess``: the contradiction checks, the extensions' ``check``
  (:func:`~plait.zero_sharding.composition.check_extensions`), before any work starts.
* ``create_optimizer``: sequence/expert parallelism added to the extensions on their mesh, the
  extensions applied (:func:`~plait.zero_sharding.composition.apply_extensions`, as the Lightning
  strategy does), then the Trainer's own optimizer (weight-decay groups, ``optim``,
  ``optimizer_cls_and_kwargs``; or the 1-bit optimizer over its groups, split by expert parallelism)
  handed to ``zero_shard`` with the model, the extensions' keyword arguments and the offload
  placement; schedulers are built afterwards on the returned ``ZeroOptimizer``.
* ``_wrap_model``: a thin :class:`PlaitModel` instead of DDP; it gives the Trainer ``no_sync``
  (gradient accumulation without communication) and a ``zero_grad`` that clears ZeRO's shards.
* ``_clip_grad_norm`` / ``_get_grad_norm``: the global norm over every shard (none is logged for
  a 1-bit optimizer past its warm-up: the shards hold no gradients then).
* ``compute_loss`` / ``prediction_step``: with ``sp_size > 1``, each rank's slice of its sp group's
  micro-batch (:mod:`plait.transformers.parallel`); predictions (sliced logits) refused.
* ``_get_dataloader``: under ``tp_size`` a tp group shares batches (:mod:`.tensor_parallel`).
* checkpoints and ``save_model``: see :mod:`plait.transformers.checkpoint`.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.transformers import checkpoint as ckpt
from plait.transformers import ds_route, loading, onebit, parallel, settings, tensor_parallel
from plait.transformers.config import (
    PlaitConfig,
    check_features,
    check_plan,
    check_training_args,
    load_config,
    zero_config_for,
)
from plait.zero_sharding import ZeroModule, ZeroOptimizer, zero_shard
from plait.zero_sharding.composition import apply_extensions

# The transformers range these overrides were read against and tested on.
TRANSFORMERS_RANGE = ((5, 19), (5, 20))  # tested on 5.19 only (CI installs 5.19.x)
_classes: dict[tuple[type, PlaitConfig | None], type] = {}


def compile_sharded(model: nn.Module, backend: str | None, mode: str | None) -> None:
    """``TrainingArguments(torch_compile=True)`` for a plait-sharded model (once per model).

    The Trainer compiles through Accelerate's ``prepare_model``, which the plait route does not
    take (the sharded model is not handed to Accelerate to wrap), so the request is honoured here:
    ``model.compile(...)`` in place, after ``zero_shard``, with the arguments' backend and mode. The
    module keeps its identity and parameter names (checkpoints are unchanged); ZeRO's hooks are
    excluded from the compiled graphs (``torch.compiler.disable``), so a stage-3 model breaks only
    around its units' hook calls, never inside a block.

    Args:
        model: the sharded model (a ``ZeroModule``).
        backend: ``TrainingArguments.torch_compile_backend`` (``None``: inductor).
        mode: ``TrainingArguments.torch_compile_mode``.
    """
    if getattr(model, "_plait_compiled", False):
        return
    model.compile(backend=backend or "inductor", mode=mode)
    model._plait_compiled = True


class PlaitModel(nn.Module):
    """What the Trainer calls for every step in place of ``DistributedDataParallel(model)``.

    Args:
        module: the sharded model (a ``ZeroModule``).
        autocast: ``torch.autocast`` dtype around forward (``bf16=``/``fp16=``), or ``None``.
    """

    def __init__(self, module: nn.Module, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.module = module
        self.autocast = autocast

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the sharded model (under autocast for the Trainer's mixed precision)."""
        if self.autocast is None:
            return self.module(*args, **kwargs)
        device = next(iter(self.module.buffers()), torch.empty(0)).device.type
        with torch.autocast(device_type=device, dtype=self.autocast):
            out = self.module(*args, **kwargs)
        loss = out.get("loss") if isinstance(out, dict) else None
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            # fp16: ZeRO's loss scaling returns the outputs as views of a custom Function, and the
            # Trainer scales the loss in place (``loss *= num_processes``), which autograd refuses
            # on such views; a copy of the scalar loss is free.
            out["loss"] = loss.clone()
        return out

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside keep gradients local (Accelerate's ``no_sync`` finds this)."""
        return self.module.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient ZeRO holds (``nn.Module.zero_grad`` would miss the shards)."""
        self.module.zero_optimizer.zero_grad(set_to_none=set_to_none)


def check_transformers_version() -> None:
    """Refuse a transformers release whose Trainer these overrides were not read against.

    Raises:
        ImportError: naming the installed version and the supported range.
    """
    import transformers

    parts = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    low, high = TRANSFORMERS_RANGE
    if not low <= parts < high:
        raise ImportError(f"plait.transformers supports transformers>={low[0]}.{low[1]},<{high[0]}.{high[1]}; "
                          f"{transformers.__version__} is installed. Install a supported version.")


def ensure_process_group() -> None:
    """A one-process group when the script runs without a launcher (``python train.py``): ZeRO
    always shards over a process group, and the Trainer creates one only under torchrun. plait
    made it, so plait destroys it at exit: a gloo group left to the interpreter's teardown can
    abort the process ("terminate called without an active exception") after training succeeded."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(_destroy_own_group)


def _destroy_own_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class PlaitTrainerMixin:
    """The overrides (see the module docstring). Use :func:`with_plait` rather than this directly."""

    plait_default: PlaitConfig | None = None
    # Set by plait.transformers.launch: a run with neither $PLAIT_CONFIG nor a DeepSpeed config is refused.
    plait_require_source: bool = False

    # ---- configuration ---------------------------------------------------------------------------
    def _plait_resolve(self) -> PlaitConfig:
        """The config from ``with_plait(..., config)``, ``args.plait_config`` or ``$PLAIT_CONFIG`` (one only).

        Raises:
            ValueError: more than one of them is given.
        """
        deepspeed = getattr(self.args, ds_route.ATTRIBUTE, None)
        given = {"with_plait(config=...)": self.plait_default,
                 "TrainingArguments.plait_config": getattr(self.args, "plait_config", None),
                 "$PLAIT_CONFIG": settings.config_source(),
                 "TrainingArguments.deepspeed (run by plait.transformers.launch)": deepspeed}
        present = {name: value for name, value in given.items() if value is not None}
        if len(present) > 1:
            raise ValueError(f"a plait config is given by {' and '.join(present)}; give it in one place only.")
        if not present and self.plait_require_source:
            raise ValueError("plait.transformers.launch found no config: set $PLAIT_CONFIG to a plait JSON file, or "
                             "give the script's TrainingArguments a DeepSpeed config (--deepspeed ds_config.json).")
        self._plait_ds_plan = None
        if deepspeed is not None:
            config, self._plait_ds_plan = ds_route.plan_for(deepspeed, self.args, world_size=self.args.world_size,
                                                            model=self.model)
            return config
        return load_config(next(iter(present.values()), PlaitConfig()))

    def create_accelerator_and_postprocess(self) -> None:
        """Resolve and check the plait config, then build Accelerate's state as the Trainer does."""
        check_transformers_version()
        self.plait_config = self._plait_resolve()
        check_training_args(self.plait_config, self.args)
        self.plait_config.check_offload_installed()
        check_features(self.plait_config, self.args)
        check_plan(self.plait_config, self.args)
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        # The launcher's world is known now (the process group may not exist yet).
        parallel.check_world_size(self.plait_config.sp_size, self.plait_config.ep_size, self.args.world_size)
        tensor_parallel.check_start(self.model, self.plait_config.tp_size, self.args.world_size)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        args["mixed_precision"] = "no"
        args["device_placement"] = False
        return args

    # ---- sharding --------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The extensions applied to the model, the Trainer's optimizer built on the result, then
        ``zero_shard`` of the model with it (once).

        Raises:
            ValueError: an extension refuses, or supplies ``param_groups`` (the Trainer's optimizer
                defines the groups here); a 1-bit config and an optimizer given to the Trainer.
        """
        if isinstance(self.model, ZeroModule):
            return self.optimizer
        zero = zero_config_for(self.plait_config, self.args)
        check_plan(self.plait_config, self.args)
        given = self.optimizer is not None  # optimizers=(opt, sched) passed to the Trainer
        if self.plait_config.onebit is not None and (given or self.optimizer_cls_and_kwargs is not None):
            raise ValueError("PlaitConfig.onebit is set and the Trainer was also given an optimizer (optimizers= "
                             "or optimizer_cls_and_kwargs=); give the optimizer in one place only.")
        ensure_process_group()
        extensions, group = self._plait_parallel()
        weights = loading.pending_weights(self.model)
        # As the Lightning strategy: extensions transform the module and supply zero_shard's keyword
        # arguments over the mesh ZeRO shards over; offload is the engine-wide placement. They run
        # before the Trainer builds its optimizer, so its weight-decay groups hold the final parameters.
        module, kwargs = apply_extensions(self.model, extensions, group)
        if module is not self.model:
            if model is self.model:
                model = module
            self.model = self.model_wrapped = module
        if "param_groups" in kwargs:
            raise ValueError("PlaitConfig.extensions: an extension supplies zero_shard(param_groups=...), which the "
                             "HF Trainer integration cannot take yet (the Trainer's optimizer defines the parameter "
                             "groups here); supply an engine-wide reducer/gatherer instead, or call zero_shard "
                             "directly with the extension's groups.")
        if self.plait_config.offload is not None:
            kwargs["placement"] = self.plait_config.placement()
        self._plait_deepspeed_optimizer(given)
        original = super().create_optimizer(model)  # type: ignore[misc]
        # Weights come from the files right after sharding: skip initialising what they overwrite.
        init = (lambda module: None) if weights is not None else None
        optimizer, options = self._plait_optimizer_arguments(original, extensions, kwargs)
        _, sharded = zero_shard(self.model, optimizer, zero, mesh=group, init_fn=init, **kwargs, **options)
        if weights is not None:
            loading.load_into_shards(self.model, weights)
        scheduler = getattr(self, "lr_scheduler", None)
        if scheduler is not None and getattr(scheduler, "optimizer", None) is original:
            scheduler.optimizer = sharded  # a scheduler passed in optimizers=(opt, sched)
        self.optimizer = sharded
        self._plait_skips_seen = 0
        sharded.register_step_post_hook(self._plait_report_skip)
        return sharded

    def _plait_deepspeed_optimizer(self, given: bool) -> None:
        """The DeepSpeed config's ``optimizer`` block as the Trainer's optimizer (DeepSpeed route only).

        Raises:
            ValueError: the block and an optimizer given to the Trainer (``optimizers=`` or
                ``optimizer_cls_and_kwargs=``).
        """
        plan = getattr(self, "_plait_ds_plan", None)
        if plan is None or plan.optimizer is None:
            return
        if given or self.optimizer_cls_and_kwargs is not None:
            raise ValueError("the DeepSpeed config has an optimizer block and the Trainer was also given an optimizer "
                             "(optimizers= or optimizer_cls_and_kwargs=); remove one of them.")
        self.optimizer = ds_route.optimizer_for(plan, self.model)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """DeepSpeed's schedule when the DeepSpeed config has a ``scheduler`` block (its ``"auto"``
        step counts from ``num_training_steps``, as HF fills them); otherwise the Trainer's own.

        Raises:
            ValueError: a scheduler key contradicting ``TrainingArguments`` (named).
        """
        plan = getattr(self, "_plait_ds_plan", None)
        if plan is None or plan.scheduler is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]
        from plait.zero_sharding.deepspeed.schedules import build_schedule

        _, final = ds_route.plan_for(getattr(self.args, ds_route.ATTRIBUTE), self.args,
                                     world_size=self.args.world_size, model=self.model,
                                     num_training_steps=num_training_steps)
        self.lr_scheduler = build_schedule(optimizer or self.optimizer, final.scheduler)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _plait_parallel(self) -> tuple[list[Any], Any]:
        """Extensions plus sp/ep on their mesh (collective), and ZeRO's group: tp's dp, sp's dp x sp, or the world."""
        config = self.plait_config
        self._plait_sp = self._plait_ep = None
        if config.tp_size > 1:  # the model's tp_plan on "tp", ZeRO over "dp" (plait.transformers.tensor_parallel)
            return [*config.extensions], tensor_parallel.parallelize(self.model, config.tp_size, self.args.device.type)
        parallel.check_world_size(config.sp_size, config.ep_size, dist.get_world_size())
        mesh = parallel.build_mesh(config.sp_size, config.ep_size, self.args.device.type)
        added: list[Any] = []
        if config.sp_size > 1:
            self._plait_sp = parallel.SequenceParallel(mesh)
            added.append(self._plait_sp)
        if config.ep_size > 1:
            self._plait_ep = parallel.ExpertParallel(mesh)
            added.append(self._plait_ep)
        return [*config.extensions, *added], (mesh if mesh is not None and config.ep_size == 1 else None)

    def _plait_optimizer_arguments(self, original: torch.optim.Optimizer, extensions: list[Any],
                                   kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """What ``zero_shard`` gets for the optimizer: the Trainer's own instance, or (with a 1-bit
        optimizer or expert parallelism) its class, groups and options, the groups split by the
        extensions that ``regroup`` them."""
        regroupers = [ext for ext in sorted(extensions, key=lambda e: e.order) if hasattr(ext, "regroup")]
        onebit_config = self.plait_config.onebit
        if onebit_config is None and not regroupers:
            return original, {}
        if onebit_config is not None:
            cls, groups, options = onebit.zero_shard_arguments(onebit_config, original, self.args)
        else:
            cls, groups, options = type(original), [dict(g) for g in original.param_groups], {}
            accepted = inspect.signature(cls).parameters
            options = {k: v for k, v in original.defaults.items() if k in accepted}
        for ext in regroupers:
            groups = ext.regroup(groups)
        kwargs["param_groups"] = groups
        return cls, options

    def _plait_report_skip(self, optimizer: ZeroOptimizer, args: Any, kwargs: Any) -> None:
        """The Trainer steps the LR scheduler unless ``accelerator.optimizer_step_was_skipped``,
        which knows only Accelerate's own loss scaler; tell it when ZeRO's fp16 scaler skipped the
        step (an overflow), so the schedule does not advance over a step that did not happen."""
        skipped = optimizer.skipped_steps != self._plait_skips_seen
        self._plait_skips_seen = optimizer.skipped_steps
        wrapper = self.optimizer  # Accelerate's AcceleratedOptimizer around ``optimizer`` once prepared
        if wrapper is not optimizer and hasattr(wrapper, "_is_overflow"):
            wrapper._is_overflow = skipped

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loader; under ``tp_size`` a tp group shares batches (``share_batches``)."""
        loader = super()._get_dataloader(*args, **kwargs)  # type: ignore[misc]
        return tensor_parallel.share_batches(loader, self.plait_config.tp_size, self.args.process_index)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if loading.pending_weights(model) is not None:
            loading.move_buffers(model, device)  # parameters are on meta until sharded
            return None
        return super()._move_model_to_device(model, device)  # type: ignore[misc]

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if isinstance(model, PlaitModel):
            return model
        if not isinstance(self.model, ZeroModule):
            return super()._wrap_model(model, training, dataloader)  # type: ignore[misc]
        if training and self.args.torch_compile:
            compile_sharded(self.model, self.args.torch_compile_backend, self.args.torch_compile_mode)
        compute = self.model.zero_engine.config.compute_dtype
        return PlaitModel(self.model, autocast=None if compute == torch.float32 else compute)

    @property
    def plait_optimizer(self) -> ZeroOptimizer:
        """The ZeroOptimizer under Accelerate's wrapper."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if not isinstance(self.model, ZeroModule):
            return super()._clip_grad_norm(model)  # type: ignore[misc]
        return self.plait_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if not isinstance(self.model, ZeroModule):
            return super()._get_grad_norm(model, grad_norm)  # type: ignore[misc]
        if grad_norm is None:
            # Not clipping: the global norm still comes from the shards (p.grad, which the Trainer
            # would read, is empty at stages 2 and 3); a ZeroConfig.max_grad_norm keeps applying.
            optimizer = self.plait_optimizer
            if getattr(optimizer.engine.reducer, "compressing", False):
                return None  # a 1-bit optimizer after warm-up: the shards hold no gradients to measure
            grad_norm = optimizer.clip_grad_norm_(optimizer.engine.config.max_grad_norm or sys.float_info.max)
        return grad_norm

    # ---- sequence parallelism ----------------------------------------------------------------------
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """With ``sp_size > 1``: this rank's slice of the sp group's micro-batch goes to the model
        (:meth:`plait.transformers.parallel.SequenceParallel.split`); otherwise the Trainer's own.

        Raises:
            ValueError: a ``compute_loss_func`` under ``sp_size > 1`` (it would see sliced, shifted labels).
        """
        sp = getattr(self, "_plait_sp", None)
        if sp is not None:
            if self.compute_loss_func is not None:
                raise ValueError(f"Trainer(compute_loss_func=...) with PlaitConfig.sp_size={sp.sp}: each rank holds a "
                                 "slice of the sequence with labels already shifted, which a whole-sequence loss "
                                 "function cannot take; drop compute_loss_func or set sp_size=1.")
            inputs = sp.split(inputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                    num_items_in_batch=num_items_in_batch)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        """The Trainer's, refusing predictions under ``sp_size > 1`` (each rank's logits are a slice).

        Raises:
            ValueError: ``predict()`` or ``compute_metrics`` under ``sp_size > 1``.
        """
        sp = getattr(self, "_plait_sp", None)
        if sp is not None and not prediction_loss_only:
            raise ValueError(f"PlaitConfig.sp_size={sp.sp}: predictions and compute_metrics need whole-sequence "
                             "logits, and each rank holds a slice of the sequence; evaluate the loss only "
                             "(no compute_metrics, prediction_loss_only=True) or predict with sp_size=1.")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)  # type: ignore[misc]

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Inside ``save_steps`` checkpoints: the sharded universal checkpoint. Called by the user:
        consolidated safetensors plus ``config.json`` that ``from_pretrained`` loads. Collective."""
        if not isinstance(self.model, ZeroModule):
            return super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        output_dir = output_dir or self.args.output_dir
        if _internal_call:
            ckpt.save_training_state(output_dir, self.model, self.plait_optimizer, step=self.state.global_step)
        else:
            ep = getattr(self, "_plait_ep", None)
            ckpt.export_pretrained(output_dir, self.model, self.processing_class,
                                   args=self.args if self.args.should_save else None,
                                   rename=ep.hf_names if ep is not None else None)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not isinstance(self.model, ZeroModule):
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        if self.args.save_only_model:
            return None
        if self.args.should_save:
            # The optimizer's moments and options are in the universal checkpoint already.
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, ckpt.SCHEDULER_NAME))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if ckpt.has_training_state(resume_from_checkpoint) or ckpt.deepspeed_tag(resume_from_checkpoint):
            return None  # loaded after sharding, in _load_optimizer_and_scheduler
        return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not isinstance(self.model, ZeroModule):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        tag = ckpt.deepspeed_tag(checkpoint) if not ckpt.has_training_state(checkpoint) else None
        if tag is not None:
            return self._plait_load_deepspeed(checkpoint, tag)
        if not ckpt.has_training_state(checkpoint):
            raise ValueError(f"{checkpoint} has no plait checkpoint ({ckpt.STATE_DIR}/); its weights were loaded, "
                             "but its optimizer state cannot be split into ZeRO shards. Resume from a checkpoint "
                             "saved by a plait Trainer, or start a fresh run from these weights.")
        ckpt.load_training_state(checkpoint, self.model, self.plait_optimizer, verify=self.plait_config.verify_on_load)
        path = os.path.join(checkpoint, ckpt.SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
        return None

    def _plait_load_deepspeed(self, checkpoint: str, tag: Any) -> None:
        """Resume a checkpoint the Trainer wrote under DeepSpeed: shards from its tag directory, the
        schedule from ``scheduler.pt`` (the Trainer's own) or from DeepSpeed's state (a config block)."""
        saved = ckpt.load_deepspeed_state(tag, self.model, self.plait_optimizer)
        path = os.path.join(checkpoint, ckpt.SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
        elif saved.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(saved["lr_scheduler"])


def with_plait(trainer_cls: type, config: PlaitConfig | str | os.PathLike | dict | None = None) -> type:
    """A subclass of ``trainer_cls`` that trains with plait (``Trainer``, TRL's ``SFTTrainer``...).

    Args:
        trainer_cls: a ``transformers.Trainer`` subclass (or ``Trainer`` itself).
        config: a :class:`PlaitConfig`, a :class:`~plait.zero_sharding.ZeroConfig`, a dict or a JSON
            file path; ``None`` takes it from ``TrainingArguments.plait_config`` or ``$PLAIT_CONFIG``,
            else ZeRO stage 3.

    Returns:
        The subclass (cached: the same class for the same arguments).

    Raises:
        TypeError: ``trainer_cls`` is not a ``transformers.Trainer`` subclass.
        ValueError: the config is refused (named field).
    """
    from transformers import Trainer

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"with_plait needs a transformers.Trainer subclass, got {trainer_cls!r}.")
    if issubclass(trainer_cls, PlaitTrainerMixin) and config is None:
        return trainer_cls
    if config is not None and type(config).__name__ == "ZeroConfig":
        config = PlaitConfig(zero=config)
    resolved = None if config is None else load_config(config)
    key = (trainer_cls, resolved)
    try:
        cached = _classes.get(key)
    except TypeError:  # an unhashable OffloadConfig field: no caching
        cached, key = None, None
    if cached is None:
        cached = type(f"Plait{trainer_cls.__name__}", (PlaitTrainerMixin, trainer_cls),
                      {"plait_default": resolved, "__module__": trainer_cls.__module__})
        if key is not None:
            _classes[key] = cached
    return cached
