"""How a strategy composes plait's pieces around a module: extensions first, then ZeRO.

The strategy's core only ever calls :func:`shard_module`. Features that arrive later (sequence
parallelism, MoE expert placement, 1-bit optimizers) plug in as
:class:`~plait.zero_sharding.composition.ShardingExtension` objects (the protocol lives in
plait-zero-sharding, so every integration composes the same way) in
:class:`~plait.lightning.config.PlaitConfig.extensions`: an extension may transform the module
before ZeRO sees it and may supply ZeRO's reducer, gatherer, placement or parameter groups.
Offloading is the built-in case of a placement, found in plait-offload-io when that is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from typing import Any

import torch
from torch import nn

from plait.lightning.config import PlaitConfig
from plait.zero_sharding import ZeroOptimizer, zero_shard
from plait.zero_sharding.composition import ShardingExtension, apply_extensions, check_extensions

OFFLOAD_INSTALL = "pip install plait-offload-io  (or: pip install 'plait-lightning[offload]')"
# Names plait-offload-io may expose for a zero_shard placement (a class or a factory taking its config).
_PLACEMENT_NAMES = ("zero_placement", "ZeroOffloadPlacement", "OffloadPlacement")
__all__ = ["PieceMissingError", "ShardingExtension", "check_plan", "offload_available", "offload_placement_factory",
           "shard_module"]


class PieceMissingError(ImportError):
    """A plait piece the configuration needs is not installed (the message has the pip line)."""


def offload_available() -> bool:
    """Whether plait-offload-io is importable."""
    return importlib.util.find_spec("plait.offload_io") is not None


def offload_placement_factory() -> Any:
    """The ZeRO placement plait-offload-io provides.

    Raises:
        PieceMissingError: plait-offload-io is not installed, or the installed version has no
            placement for ZeRO.
    """
    if not offload_available():
        raise PieceMissingError(f"offloading needs plait-offload-io, which is not installed: {OFFLOAD_INSTALL}")
    module = importlib.import_module("plait.offload_io")
    for name in _PLACEMENT_NAMES:
        factory = getattr(module, name, None)
        if factory is not None:
            return factory
    raise PieceMissingError(
        "the installed plait-offload-io has no ZeRO placement (it exposes none of "
        f"{', '.join('plait.offload_io.' + n for n in _PLACEMENT_NAMES)}), so ZeRO cannot keep its state on "
        f"CPU or NVMe through it; upgrade it: {OFFLOAD_INSTALL.replace('install', 'install -U', 1)}")


def _offload_placement(plan: PlaitConfig) -> Any:
    factory = offload_placement_factory()
    offload = plan.offload
    if isinstance(offload, str):
        from plait.offload_io import OffloadConfig

        # As DeepSpeed's Lightning strategies "deepspeed_stage_3_offload(_nvme)": stage 3 moves the
        # parameter shards to the same device as the optimizer state (ZeRO-Infinity).
        params = offload if plan.zero.stage == 3 else "none"
        offload = OffloadConfig(device=offload, param_device=params,
                                **({"path": plan.nvme_path} if offload == "nvme" else {}))
    return factory(offload)


def check_plan(plan: PlaitConfig, precision: str) -> None:
    """Every check that can run before any process starts: offload installed, extensions agree.

    Raises:
        PieceMissingError: a needed piece is not installed.
        ValueError: extensions contradict each other or the precision.
    """
    if plan.offload is not None:
        offload_placement_factory()
    check_extensions(plan.extensions, plan, precision,
                     claimed={"placement": "offload"} if plan.offload is not None else None)


def _as_class(optimizer: torch.optim.Optimizer) -> tuple[type, list[dict[str, Any]], dict[str, Any]]:
    """An optimizer instance as (class, its groups, constructor options).

    ``zero_shard`` rebuilds an instance as ``cls(groups, **optimizer.defaults)``, but ``defaults``
    can hold keys the constructor does not take (torch's AdamW adds ``decoupled_weight_decay``), so
    only the constructor's own keywords are passed; the groups keep every option.

    Raises:
        ValueError: the optimizer already has state (ZeRO must shard it before the first step).
    """
    if optimizer.state:
        raise ValueError(f"optimizer {type(optimizer).__name__} already has state; the plait strategies shard it "
                         "before the first step, so configure_optimizers must return a fresh optimizer.")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer), [dict(g) for g in optimizer.param_groups], options


def shard_module(module: nn.Module, optimizer: Any, plan: PlaitConfig, precision: str, *,
                 gradient_clip_val: float | None = None, group: Any = None,
                 **optimizer_kwargs: Any) -> tuple[nn.Module, ZeroOptimizer]:
    """Apply the extensions, then ZeRO, to ``module`` (in place).

    Args:
        module: the model (parameters real or on the meta device).
        optimizer: an optimizer instance without state, or an optimizer class.
        plan: the strategy's configuration.
        precision: Lightning's precision flag.
        gradient_clip_val: the Trainer's clip value (``None``: none).
        group: the process group to shard over (``None``: the world).
        **optimizer_kwargs: options when ``optimizer`` is a class.

    Returns:
        ``(module, ZeroOptimizer)``.
    """
    check_plan(plan, precision)
    zero = plan.zero_config_for(precision, gradient_clip_val=gradient_clip_val)
    module, kwargs = apply_extensions(module, plan.extensions, group)
    if plan.offload is not None:
        kwargs["placement"] = _offload_placement(plan)
    # Extensions with ``regroup`` (expert parallelism) split the optimizer's own groups instead.
    regroupers = [ext for ext in sorted(plan.extensions, key=lambda e: e.order) if hasattr(ext, "regroup")]
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer, param_groups, optimizer_kwargs = _as_class(optimizer)
        if "param_groups" in kwargs:
            raise ValueError("an extension supplies param_groups, so configure_optimizers must return an optimizer "
                             "class with options (the extension's groups replace the optimizer's own).")
        kwargs["param_groups"] = param_groups
    elif regroupers and "param_groups" not in kwargs:
        kwargs["param_groups"] = [{"params": list(module.parameters())}]
    for ext in regroupers:
        kwargs["param_groups"] = ext.regroup(kwargs["param_groups"])
    return zero_shard(module, optimizer, zero, mesh=group, init_fn=plan.init_fn, **kwargs, **optimizer_kwargs)


def with_nodes(plan: PlaitConfig, num_nodes: int, devices: int, group: Any) -> PlaitConfig:
    """``plan`` with ``ZeroConfig.ranks_per_node = devices`` when the run spans ``num_nodes > 1`` nodes.

    Lightning numbers ranks node by node (``node_rank x devices + local_rank``), so the world's
    nodes are runs of ``devices`` consecutive ranks and ZeRO-3 can reduce in two hops across them
    without reading the layout from the environment. Left as it is when ZeRO shards over a
    subgroup (``group`` not ``None``: its nodes are not the world's runs), on one node, or when
    the user set ``ranks_per_node`` already.
    """
    if num_nodes <= 1 or group is not None or plan.zero.ranks_per_node != "auto":
        return plan
    return dataclasses.replace(plan, zero=dataclasses.replace(plan.zero, ranks_per_node=devices))
