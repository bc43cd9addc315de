"""PlaitConfig: what a plait strategy does, and how Lightning's own settings translate into it.

Lightning states precision and gradient clipping on the Trainer (or Fabric); plait states them on
:class:`~plait.zero_sharding.ZeroConfig`. This module holds the one translation table between
the two, and the checks that refuse a combination that contradicts itself, so both the Trainer
strategy and the Fabric strategy refuse the same inputs with the same words, before any process
is started.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.zero_sharding import ZeroConfig


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """How one Lightning precision string is carried out by ZeRO.

    Attributes:
        compute_dtype: dtype of the parameters during forward and backward (fp32 masters are
            kept by ZeRO whenever this is not fp32).
        reduce_dtype: dtype gradients are reduced in, unless the user's ZeroConfig says otherwise.
        autocast: dtype of ``torch.autocast`` around forward, or ``None`` for no autocast.
        cast_inputs: cast floating inputs to ``compute_dtype`` (the "true" precisions).
    """

    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    autocast: torch.dtype | None
    cast_inputs: bool


# "mixed": low-precision parameters under autocast, gradients reduced in fp32; "true": everything
# in the low dtype (fp32 masters remain, because the optimizer step needs them).
PRECISIONS: dict[str, PrecisionPlan] = {
    "32-true": PrecisionPlan(torch.float32, torch.float32, None, False),
    "bf16-mixed": PrecisionPlan(torch.bfloat16, torch.float32, torch.bfloat16, False),
    "bf16-true": PrecisionPlan(torch.bfloat16, torch.bfloat16, None, True),
    "16-mixed": PrecisionPlan(torch.float16, torch.float32, torch.float16, False),
}
# Lightning's short spellings.
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}
OFFLOAD_DEVICES = ("cpu", "nvme")


def normalize_precision(precision: Any) -> str:
    """Lightning's precision flag as one of :data:`PRECISIONS`.

    Raises:
        ValueError: a precision plait cannot honour (``16-true``, ``64-true``, transformer-engine...),
            naming the supported ones.
    """
    value = _ALIASES.get(precision, precision)
    if value not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by the plait strategies; use one of "
            f"{', '.join(repr(p) for p in PRECISIONS)}. ('16-true' would run the optimizer without fp32 "
            "masters and '64-true' has no ZeRO compute path; ZeRO always keeps fp32 masters.)"
        )
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlaitConfig:
    """Everything a plait strategy composes, in the design's fixed order: extensions that transform
    the module first (sequence parallelism, MoE expert placement, activation checkpointing), then
    ZeRO with its offload and communication policies.

    Attributes:
        zero: the ZeRO settings. ``compute_dtype``/``reduce_dtype``/``max_grad_norm`` left at their
            defaults are filled from the Trainer's ``precision`` and ``gradient_clip_val``; set
            explicitly they must agree with them.
        offload: ``None``, ``"cpu"`` or ``"nvme"`` (needs plait-offload-io), or an
            ``plait.offload_io.OffloadConfig``.
        offload_path: directory for ``offload="nvme"`` (default ``$PLAIT_OFFLOAD_PATH`` or
            ``./plait-offload``).
        extensions: objects following :class:`plait.zero_sharding.composition.ShardingExtension`, applied in
            ascending ``order``.
        init_fn: ``None`` (default): models built in ``configure_model`` /
            ``fabric.init_module(empty_init=True)`` run their own constructors, sliced as they are
            built, and start from exactly the weights a plain build with the same seed has. A
            callable: parameters go to the meta device instead and ZeRO initialises each module
            with ``init_fn(module)`` (for models whose weights are loaded right after, say).
        verify_on_load: check every hash when a checkpoint is loaded.
        sp_size: Ulysses sequence-parallel ranks (plait-ulysses-sp): the strategy builds a
            ``dp x sp`` mesh, applies Ulysses to the module's HF models and splits every batch
            along the sequence (:mod:`plait.lightning.parallel`). 1: off.
        ep_size: expert-parallel ranks (plait-moe-layers): a ``dp x ep`` mesh, ``E / ep``
            experts of every plait MoE layer per rank, experts sharded by ZeRO over the
            expert-data-parallel group under their global names. 1: off.
        tp_size: tensor-parallel ranks (Trainer strategy only): a ``(data_parallel,
            tensor_parallel)`` mesh given to the LightningModule as ``self.device_mesh`` before
            ``configure_model``, which applies torch's ``parallelize_module`` on
            ``device_mesh["tensor_parallel"]``; ZeRO shards over ``device_mesh["data_parallel"]``
            (:mod:`plait.lightning.tensor_parallel`). Not with ``sp_size``/``ep_size`` above 1 yet.
            1: off.
        pp_size: pipeline stages (Trainer strategy only): a ``(data_parallel,
            pipeline_parallel)`` mesh given to the LightningModule as ``self.device_mesh`` before
            ``configure_model``, which builds this rank's stage; ZeRO shards each stage over
            ``device_mesh["data_parallel"]`` and the module trains under manual optimization with
            :func:`plait.lightning.pipeline_parallel.pipeline_step`. With ``tp_size`` too, a
            ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh (3-D parallelism,
            :mod:`plait.lightning.parallel_3d`). Not with ``sp_size`` or ``ep_size`` above 1 yet. 1: off.
    """

    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    offload: Any = None
    offload_path: str | None = None
    extensions: tuple[Any, ...] = ()
    init_fn: Callable[[nn.Module], None] | None = None
    verify_on_load: bool = True
    sp_size: int = 1
    ep_size: int = 1
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        from plait.lightning.parallel import check_parallel_sizes  # (it imports this module)
        from plait.lightning.pipeline_parallel import check_pp_size
        from plait.lightning.tensor_parallel import check_tp_size

        check_parallel_sizes(self.sp_size, self.ep_size)
        check_tp_size(self.tp_size, self.sp_size, self.ep_size)
        check_pp_size(self.pp_size, sp_size=self.sp_size, ep_size=self.ep_size, tp_size=self.tp_size)
        if not isinstance(self.zero, ZeroConfig):
            raise ValueError(f"PlaitConfig.zero={self.zero!r} must be a plait.zero_sharding.ZeroConfig, "
                             "e.g. ZeroConfig(stage=3).")
        if isinstance(self.offload, str) and self.offload not in OFFLOAD_DEVICES:
            raise ValueError(f"PlaitConfig.offload={self.offload!r}; use None, 'cpu', 'nvme' or an OffloadConfig.")
        if self.offload is not None and self.zero.stage == 1:
            raise ValueError("PlaitConfig.offload is set with ZeroConfig.stage=1; offloading needs the partitioned "
                             "gradients of stage 2 or 3: use ZeroConfig(stage=2) or stage=3.")
        object.__setattr__(self, "extensions", tuple(self.extensions))
        for ext in self.extensions:
            missing = [m for m in ("order", "check", "apply", "zero_kwargs") if not hasattr(ext, m)]
            if missing:
                raise ValueError(f"PlaitConfig.extensions: {ext!r} lacks {missing}; see "
                                 "plait.zero_sharding.composition.ShardingExtension.")
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(f"PlaitConfig.init_fn={self.init_fn!r} must be callable(module) or None.")

    @property
    def nvme_path(self) -> str:
        """Where ``offload="nvme"`` keeps its files."""
        return self.offload_path or os.environ.get("PLAIT_OFFLOAD_PATH", "./plait-offload")

    def zero_config_for(self, precision: str, *, gradient_clip_val: float | None = None) -> ZeroConfig:
        """The ZeroConfig actually used under Lightning's ``precision`` and clip value.

        Raises:
            ValueError: the ZeroConfig contradicts the precision or the clip value.
        """
        check_agreement(self.zero, precision, gradient_clip_val=gradient_clip_val)
        plan = PRECISIONS[normalize_precision(precision)]
        zero = self.zero
        changes: dict[str, Any] = {"compute_dtype": plan.compute_dtype}
        if zero.reduce_dtype is None:
            changes["reduce_dtype"] = plan.reduce_dtype
        return dataclasses.replace(zero, **changes)


def check_agreement(zero: ZeroConfig, precision: Any, *, gradient_clip_val: float | None = None,
                    gradient_clip_algorithm: str | None = None) -> None:
    """Refuse a ZeroConfig that contradicts the Trainer's (or Fabric's) own arguments.

    Raises:
        ValueError: naming both settings and the fix.
    """
    name = normalize_precision(precision)
    plan = PRECISIONS[name]
    if zero.compute_dtype != torch.float32 and zero.compute_dtype != plan.compute_dtype:
        raise ValueError(
            f"ZeroConfig.compute_dtype={zero.compute_dtype} contradicts precision={name!r} (which computes in "
            f"{plan.compute_dtype}); set the precision on the Trainer/Fabric only and leave compute_dtype unset.")
    if zero.loss_scale and plan.compute_dtype != torch.float16:
        raise ValueError(f"ZeroConfig.loss_scale={zero.loss_scale} only applies to precision='16-mixed', got {name!r}; "
                         "remove loss_scale or use precision='16-mixed'.")
    if gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(
            f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not supported with ZeRO (gradients are "
            "sharded, so only the global norm is known); use gradient_clip_algorithm='norm'.")
    if gradient_clip_val and zero.max_grad_norm is not None and float(gradient_clip_val) != zero.max_grad_norm:
        raise ValueError(
            f"Trainer(gradient_clip_val={gradient_clip_val}) contradicts ZeroConfig.max_grad_norm="
            f"{zero.max_grad_norm}; set one of them (they mean the same thing).")


# The strategy names ``import plait.lightning`` registers for the Trainer and for Fabric. The offload
# names are always registered, so that without plait-offload-io (or with a version that has no ZeRO
# placement) ``Trainer(strategy="plait_zero3_offload")`` fails at once with the exact pip line
# instead of Lightning's generic "unknown strategy" message.
# name -> (ZeRO stage, offload device or None, description)
NAMES: dict[str, tuple[int, str | None, str]] = {
    "plait_zero1": (1, None, "plait ZeRO stage 1: optimizer state partitioned"),
    "plait_zero2": (2, None, "plait ZeRO stage 2: optimizer state and gradients partitioned"),
    "plait_zero3": (3, None, "plait ZeRO stage 3: optimizer state, gradients and parameters partitioned"),
    "plait_zero2_offload": (2, "cpu", "plait ZeRO stage 2, optimizer state on CPU (plait-offload-io)"),
    "plait_zero3_offload": (3, "cpu", "plait ZeRO stage 3, parameter shards, fp32 masters and optimizer state on CPU "
                                      "(plait-offload-io)"),
    "plait_zero3_offload_nvme": (3, "nvme", "plait ZeRO stage 3, parameter shards, fp32 masters and optimizer state "
                                            "on NVMe (plait-offload-io)"),
    "plait_zeropp": (3, None, "plait ZeRO stage 3 with ZeRO++: int8 weight gathers, int4 gradient reduction in two "
                              "hops across nodes, hierarchical partition sized to the node"),
}
# The names that switch ZeroConfig.zeropp on (with ZeroPPConfig's defaults).
ZEROPP_NAMES = frozenset({"plait_zeropp"})


def register_names(registry: Any, strategy_cls: type) -> None:
    """Register every name of :data:`NAMES` for ``strategy_cls`` in a Lightning strategy registry
    (idempotent: registering again replaces the entries)."""
    for name, (stage, offload, description) in NAMES.items():
        registry.register(name, strategy_cls, description=description, override=True,
                          zero=ZeroConfig(stage=stage, zeropp=name in ZEROPP_NAMES or None), offload=offload)
