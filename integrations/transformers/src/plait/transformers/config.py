"""PlaitConfig: what plait does under the HF Trainer, and how ``TrainingArguments`` translate into it.

The Trainer states precision (``bf16=``/``fp16=``) and clipping (``max_grad_norm=``) on its
``TrainingArguments``; plait states them on :class:`~plait.zero_sharding.ZeroConfig`. This module
holds the one translation between the two, the checks that refuse contradictions (a plait config
together with ``deepspeed=`` or ``fsdp=``, a ZeroConfig dtype that contradicts ``bf16=``), and the
JSON config-file reader used by scripts nobody edits (``--plait_config file.json`` or
``PLAIT_CONFIG=file.json``).

Feature packages compose with ZeRO here exactly as under Lightning, through
:mod:`plait.zero_sharding.composition`: :func:`check_plan` runs every extension's ``check`` when
the Trainer is built, and the Trainer applies them right before ``zero_shard``. Offloading is the
built-in engine-wide ``placement``, so no extension may supply another one alongside it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from plait.transformers.onebit import CONFIG_CLASSES, check_onebit, onebit_from_deepspeed
from plait.transformers.parallel import check_installed
from plait.zero_sharding import ZeroConfig
from plait.zero_sharding.composition import ShardingExtension, check_extensions

OFFLOAD_DEVICES = ("cpu", "nvme")
OFFLOAD_INSTALL = "pip install plait-offload-io  (or: pip install 'plait-transformers[offload]')"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlaitConfig:
    """Everything plait does for one Trainer.

    Attributes:
        zero: the ZeRO settings (default stage 3). ``compute_dtype``/``reduce_dtype`` left at
            their defaults are filled from ``TrainingArguments.bf16``/``fp16``; set explicitly they
            must agree with them. Clipping comes from ``TrainingArguments.max_grad_norm``.
        offload: ``None``, ``"cpu"`` or ``"nvme"`` (needs plait-offload-io), or a
            ``plait.offload_io.OffloadConfig``. With stage 3 the string forms move parameter shards,
            fp32 masters and optimizer state (ZeRO-Infinity, like DeepSpeed's
            ``offload_param`` + ``offload_optimizer``); with stage 2 the optimizer state only.
        offload_path: directory for ``offload="nvme"`` (default ``./plait-offload``).
        verify_on_load: check every hash when a checkpoint is resumed.
        extensions: objects following :class:`plait.zero_sharding.composition.ShardingExtension`
            (sequence parallelism, MoE expert placement, a reducer...), applied in ascending
            ``order`` right before ZeRO shards the model; their ``check`` gets this config and the
            precision as Lightning spells it (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, see
            :func:`precision_name`). Python objects, so code only: a JSON config file cannot give them.
        sp_size: Ulysses sequence parallelism over this many consecutive ranks (plait-ulysses-sp;
            1: off); must divide the world size. See :mod:`plait.transformers.parallel`.
        ep_size: expert parallelism over this many ranks for MoE models (plait-moe-layers; HF
            Mixtral / Qwen2-MoE / Qwen3-MoE blocks are converted); 1: off.
        tp_size: tensor parallelism over this many consecutive ranks with the model's own
            ``tp_plan`` (transformers' styles), ZeRO over the ``world / tp_size`` data-parallel
            ranks; 1: off. Not with ``sp_size``/``ep_size`` above 1. See
            :mod:`plait.transformers.tensor_parallel`.
        onebit: a 1-bit optimizer, given by its plait config (``plait.onebit_optim.OnebitAdamConfig``,
            ``OnebitLambConfig`` or ``ZeroOneAdamConfig``; in JSON, DeepSpeed's ``"optimizer"``
            block). It replaces ``TrainingArguments.optim``; see :mod:`plait.transformers.onebit`.
    """

    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    offload: Any = None
    offload_path: str | None = None
    verify_on_load: bool = True
    extensions: tuple[Any, ...] = ()
    sp_size: int = 1
    ep_size: int = 1
    tp_size: int = 1
    onebit: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.zero, ZeroConfig):
            raise ValueError(f"PlaitConfig.zero={self.zero!r} must be a plait.zero_sharding.ZeroConfig, "
                             "e.g. ZeroConfig(stage=3).")
        if isinstance(self.offload, str) and self.offload not in OFFLOAD_DEVICES:
            raise ValueError(f"PlaitConfig.offload={self.offload!r}; use None, 'cpu', 'nvme' or an OffloadConfig.")
        if self.offload is not None and not isinstance(self.offload, str) \
                and type(self.offload).__name__ != "OffloadConfig":
            raise ValueError(f"PlaitConfig.offload={self.offload!r}; use None, 'cpu', 'nvme' or a "
                             "plait.offload_io.OffloadConfig.")
        if self.offload is not None and self.zero.stage == 1:
            raise ValueError("PlaitConfig.offload is set with ZeroConfig.stage=1; offloading needs the partitioned "
                             "gradients of stage 2 or 3: use ZeroConfig(stage=2) or stage=3.")
        if self.offload_path is not None and not isinstance(self.offload_path, str | os.PathLike):
            raise ValueError(f"PlaitConfig.offload_path={self.offload_path!r} must be a directory path or None.")
        if not isinstance(self.verify_on_load, bool):
            raise ValueError(f"PlaitConfig.verify_on_load={self.verify_on_load!r} must be True or False.")
        if not isinstance(self.extensions, tuple | list):
            raise ValueError(f"PlaitConfig.extensions={self.extensions!r} must be a tuple of ShardingExtension "
                             "objects, e.g. extensions=(my_extension,).")
        for field in ("sp_size", "ep_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PlaitConfig.{field}={value!r} must be a positive int (1: off) dividing the world "
                                 "size.")
        from plait.transformers.tensor_parallel import check_tp_size

        check_tp_size(self.tp_size, self.sp_size, self.ep_size)
        if self.onebit is not None and type(self.onebit).__name__ not in CONFIG_CLASSES:
            raise ValueError(f"PlaitConfig.onebit={self.onebit!r}; give a plait.onebit_optim OnebitAdamConfig, "
                             "OnebitLambConfig or ZeroOneAdamConfig (or DeepSpeed's 'optimizer' block in JSON).")
        object.__setattr__(self, "extensions", tuple(self.extensions))
        for index, ext in enumerate(self.extensions):
            missing = [m for m in ("order", "check", "apply", "zero_kwargs") if not hasattr(ext, m)]
            if missing or not isinstance(ext, ShardingExtension):
                raise ValueError(f"PlaitConfig.extensions[{index}]={ext!r} lacks {missing or 'the protocol'}; give "
                                 "objects with order, check(settings, precision), apply(module, mesh) and "
                                 "zero_kwargs(), see plait.zero_sharding.composition.ShardingExtension.")
            if not isinstance(ext.order, int) or isinstance(ext.order, bool):
                raise ValueError(f"PlaitConfig.extensions[{index}]={ext!r} has order={ext.order!r}; order must be an "
                                 "int (10 sequence parallel, 20 MoE expert placement, 30 activation "
                                 "checkpointing/offload; ZeRO comes last).")

    def check_offload_installed(self) -> None:
        """Raise now, before any work, when :attr:`offload` needs plait-offload-io and it is missing.

        Raises:
            ImportError: with the pip line.
        """
        if self.offload is not None and importlib.util.find_spec("plait.offload_io") is None:
            raise ImportError(f"PlaitConfig.offload={self.offload!r} needs plait-offload-io: {OFFLOAD_INSTALL}")

    def placement(self) -> Any:
        """The ``zero_shard(placement=...)`` for :attr:`offload`, or ``None`` without offload.

        Raises:
            ImportError: offloading is asked for and plait-offload-io is not installed.
        """
        if self.offload is None:
            return None
        try:
            from plait.offload_io import OffloadConfig, zero_placement
        except ImportError as exc:
            raise ImportError(f"PlaitConfig.offload={self.offload!r} needs plait-offload-io: {OFFLOAD_INSTALL}") \
                from exc
        offload = self.offload
        if isinstance(offload, str):
            params = offload if self.zero.stage == 3 else "none"
            path = {"path": self.offload_path or "./plait-offload"} if offload == "nvme" else {}
            offload = OffloadConfig(device=offload, param_device=params, **path)
        return zero_placement(offload)


# Python-only fields: a JSON file cannot hold them.
_CODE_ONLY_KEYS = {"extensions"}
# In JSON the 1-bit optimizer is DeepSpeed's "optimizer" block (PlaitConfig.onebit in code).
_TOP_KEYS = ({f.name for f in dataclasses.fields(PlaitConfig)} - _CODE_ONLY_KEYS - {"onebit"}) | {"optimizer"}
_ZERO_KEYS = {f.name for f in dataclasses.fields(ZeroConfig)}


def config_from_dict(data: dict[str, Any], *, source: str = "plait config") -> PlaitConfig:
    """Build a :class:`PlaitConfig` from plain data (a parsed JSON file).

    The shape is ``{"zero": {ZeroConfig fields}, "offload": "cpu", "offload_path": ..., "verify_on_load": ...,
    "sp_size": 2, "ep_size": 2, "optimizer": {"type": "OneBitAdam", "params": {...}}}``; ``offload`` may
    also be a dict of ``plait.offload_io.OffloadConfig`` fields; ``optimizer`` is DeepSpeed's block for
    a 1-bit optimizer (:func:`plait.transformers.onebit.onebit_from_deepspeed`). ``extensions`` are
    Python objects and cannot be given this way (an error says so).

    Args:
        data: the parsed content.
        source: where it came from (named in errors).

    Returns:
        The validated config.

    Raises:
        ValueError: not a JSON object, an unknown key (named, with the known ones), or a field the
            config classes refuse.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object like {{\"zero\": {{\"stage\": 3}}}}, "
                         f"got {type(data).__name__}.")
    code_only = sorted(set(data) & _CODE_ONLY_KEYS)
    if code_only:
        raise ValueError(f"{source}: {code_only} cannot be given in a config file (extensions are Python objects "
                         "following plait.zero_sharding.composition.ShardingExtension); remove the key and pass them "
                         "in code: with_plait(Trainer, PlaitConfig(extensions=(...,))).")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; the known keys are {sorted(_TOP_KEYS)}.")
    zero = data.get("zero", {})
    if not isinstance(zero, dict):
        raise ValueError(f"{source}: 'zero' must be an object of ZeroConfig fields, got {zero!r}.")
    unknown = sorted(set(zero) - _ZERO_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {[f'zero.{k}' for k in unknown]}; ZeroConfig's fields are "
                         f"{sorted(_ZERO_KEYS)}.")
    offload = data.get("offload")
    if isinstance(offload, dict):
        try:
            from plait.offload_io import OffloadConfig
        except ImportError as exc:
            raise ImportError(f"{source}: 'offload' needs plait-offload-io: {OFFLOAD_INSTALL}") from exc
        offload = OffloadConfig(**offload)
    fields = {k: v for k, v in data.items() if k not in ("zero", "offload", "optimizer")}
    if "optimizer" in data:
        fields["onebit"] = onebit_from_deepspeed(data["optimizer"], source)
    try:
        return PlaitConfig(zero=ZeroConfig(**zero), offload=offload, **fields)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def load_config(source: str | os.PathLike | dict[str, Any] | PlaitConfig) -> PlaitConfig:
    """A :class:`PlaitConfig` from a config, a dict, a JSON file path or a JSON string.

    Raises:
        ValueError: the file is missing or is not valid JSON, or its content is refused (see
            :func:`config_from_dict`).
    """
    if isinstance(source, PlaitConfig):
        return source
    if isinstance(source, dict):
        return config_from_dict(source)
    text = str(source)
    if text.lstrip().startswith("{"):
        name, raw = "plait config (inline JSON)", text
    else:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"plait config file {str(path)!r} does not exist; pass a JSON file such as "
                             "{\"zero\": {\"stage\": 3}}.")
        name, raw = f"plait config file {str(path)!r}", path.read_text()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    return config_from_dict(data, source=name)


def precision_of(args: Any) -> tuple[torch.dtype, torch.dtype]:
    """``(compute_dtype, reduce_dtype)`` for the Trainer's ``bf16``/``fp16`` flags: low-precision
    parameters with fp32 masters and fp32 gradient reduction, as the Trainer's own mixed precision."""
    if getattr(args, "bf16", False):
        return torch.bfloat16, torch.float32
    if getattr(args, "fp16", False):
        return torch.float16, torch.float32
    return torch.float32, torch.float32


def precision_name(args: Any) -> str:
    """The Trainer's ``bf16``/``fp16`` flags as the precision string extensions' ``check`` receives
    (Lightning's spelling, so one extension checks both integrations the same way)."""
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    if getattr(args, "fp16", False):
        return "16-mixed"
    return "32-true"


def check_plan(config: PlaitConfig, args: Any) -> list[Any]:
    """Every extension's ``check``, and no two supplying one engine-wide piece (offload is the
    ``placement``); runs when the Trainer is built and again right before sharding.

    Returns:
        The extensions in composition order.

    Raises:
        ValueError: an extension refuses, or two claim the same reducer/gatherer/placement.
    """
    return check_extensions(config.extensions, config, precision_name(args),
                            claimed={"placement": "offload"} if config.offload is not None else None)


def check_training_args(config: PlaitConfig, args: Any) -> None:
    """Refuse ``TrainingArguments`` that contradict plait (called before any work starts).

    Raises:
        ValueError: naming both settings and the fix.
    """
    if getattr(args, "deepspeed", None):
        raise ValueError(f"TrainingArguments.deepspeed={args.deepspeed!r} is set together with plait; both shard "
                         "the model. Remove deepspeed= (plait replaces it) or drop the plait config.")
    if getattr(args, "fsdp", None):
        raise ValueError(f"TrainingArguments.fsdp={args.fsdp!r} is set together with plait; both shard the model. "
                         "Remove fsdp= (plait replaces it) or drop the plait config.")
    if getattr(args, "load_best_model_at_end", False):
        raise ValueError("TrainingArguments.load_best_model_at_end=True is not supported with plait yet: its "
                         "checkpoints hold universal checkpoints, not the weight files the Trainer reloads; set it to "
                         "False and export the chosen checkpoint-N with trainer.save_model after resuming from it.")
    if getattr(args, "push_to_hub", False):
        raise ValueError("TrainingArguments.push_to_hub=True is not supported with plait yet: the Trainer pushes "
                         "what its checkpoints hold, universal checkpoints rather than weight files; set it to False "
                         "and push the folder trainer.save_model(dir) writes (model.safetensors + config.json).")
    compute, _ = precision_of(args)
    zero = config.zero
    if zero.compute_dtype != torch.float32 and zero.compute_dtype != compute:
        raise ValueError(f"ZeroConfig.compute_dtype={zero.compute_dtype} contradicts TrainingArguments(bf16="
                         f"{getattr(args, 'bf16', False)}, fp16={getattr(args, 'fp16', False)}); set the precision on "
                         "TrainingArguments only and leave compute_dtype unset.")
    if zero.loss_scale and compute != torch.float16:
        raise ValueError(f"ZeroConfig.loss_scale={zero.loss_scale} only applies with TrainingArguments(fp16=True); "
                         "remove loss_scale or train in fp16.")
    clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
    if zero.max_grad_norm is not None and clip > 0 and clip != zero.max_grad_norm:
        raise ValueError(f"TrainingArguments.max_grad_norm={clip} contradicts ZeroConfig.max_grad_norm="
                         f"{zero.max_grad_norm}; set one of them (they mean the same thing).")


def check_features(config: PlaitConfig, args: Any) -> None:
    """Refuse what sequence parallelism, expert parallelism and the 1-bit optimizer cannot do under
    these ``TrainingArguments`` (when the Trainer is built, before any work; the world size is
    checked once the process group exists, see :func:`plait.transformers.parallel.check_world_size`).

    Raises:
        ValueError: naming the field and the fix.
        ImportError: a needed plait package is missing (with the pip line).
    """
    check_installed("sp_size", config.sp_size)
    check_installed("ep_size", config.ep_size)
    if config.sp_size > 1 and float(getattr(args, "label_smoothing_factor", 0.0) or 0.0) > 0:
        raise ValueError(f"TrainingArguments.label_smoothing_factor={args.label_smoothing_factor} with PlaitConfig."
                         f"sp_size={config.sp_size}: the label smoother shifts whole-sequence labels, but each rank "
                         "holds a slice with labels already shifted; set label_smoothing_factor=0 or sp_size=1.")
    if config.onebit is not None:
        check_onebit(config.onebit, zero_config_for(config, args), args, config.ep_size)


def zero_config_for(config: PlaitConfig, args: Any) -> ZeroConfig:
    """The ZeroConfig actually used under these ``TrainingArguments``.

    Raises:
        ValueError: see :func:`check_training_args`.
    """
    check_training_args(config, args)
    compute, reduce = precision_of(args)
    changes: dict[str, Any] = {"compute_dtype": compute}
    if config.zero.reduce_dtype is None:
        changes["reduce_dtype"] = reduce
    return dataclasses.replace(config.zero, **changes)
