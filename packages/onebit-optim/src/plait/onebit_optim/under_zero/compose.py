"""What ``zero_shard`` builds for 1-bit Adam, 1-bit LAMB and 0/1 Adam: the checks, the engine-wide
reducer (:mod:`plait.onebit_optim.under_zero.exchange`; 0/1 Adam's in
:mod:`plait.onebit_optim.under_zero.adam01`) and the inner optimizer over the fp32 master shards
(:mod:`plait.onebit_optim.under_zero.onebit_adam`, :mod:`plait.onebit_optim.under_zero.onebit_lamb`,
:mod:`plait.onebit_optim.under_zero.adam01`). The optimizers' ``compose_with_zero`` hook
delegates here (installed by :mod:`plait.onebit_optim` at import)."""

from __future__ import annotations

from typing import Any

import torch

from plait.onebit_optim.config import OnebitAdamConfig, OnebitLambConfig, ZeroOneAdamConfig
from plait.onebit_optim.data_parallel.base import check_hyperparameters
from plait.onebit_optim.under_zero.adam01 import ShardedZeroOneAdam, ZeroOneZeroExchange
from plait.onebit_optim.under_zero.exchange import OnebitZeroExchange
from plait.onebit_optim.under_zero.onebit_adam import ShardedOnebitAdam
from plait.onebit_optim.under_zero.onebit_lamb import ShardedOnebitLamb
from plait.onebit_optim.under_zero.replicated_lamb import ReplicatedLambExchange
from plait.onebit_optim.under_zero.replicated_update import ReplicatedUpdateExchange

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# The optimizers that compose with ZeRO-1/2: their config class.
COMPOSABLE = {"OnebitAdam": OnebitAdamConfig, "OnebitLamb": OnebitLambConfig, "ZeroOneAdam": ZeroOneAdamConfig}


def compose_with_zero(optimizer: Any, zero_config: Any, *, param_groups: list[dict[str, Any]] | None,
                      reducer: Any, **kwargs: Any) -> tuple[type, list[dict[str, Any]] | None, dict[str, Any], Any]:
    """What ``zero_shard`` builds for a 1-bit optimizer (see the module docstring).

    Args:
        optimizer: ``OnebitAdam``, ``OnebitLamb`` or ``ZeroOneAdam`` (the class) or an instance
            without state.
        zero_config: the ``ZeroConfig``.
        param_groups: ``zero_shard``'s ``param_groups`` (class form only).
        reducer: ``zero_shard``'s ``reducer`` (must be ``None``: the exchange is the reducer).
        **kwargs: the optimizer's keyword arguments (class form): hyperparameters, ``config``
            (or ``onebit_config``), ``momentum_masks``.

    Returns:
        ``(inner optimizer class, param_groups, hyperparameter kwargs, reducer)`` for ``zero_shard``.

    Raises:
        ValueError: ZeRO-3, ZeRO++, another reducer, a ``process_group`` (naming what works).
    """
    cls = type(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    name = cls.__name__
    _check_composable(name, zero_config, reducer)
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError(f"optimizer {name} already has state; shard before the first step.")
        if param_groups is not None or kwargs:
            raise ValueError("pass either an optimizer instance or an optimizer class with options, not both.")
        param_groups = [dict(g) for g in optimizer.param_groups]
        config = optimizer.config
        masks = {pid: mask for pid, mask in optimizer.masks.items()}
        hyper = {k: optimizer.defaults[k] for k in HYPERPARAMETERS}
    else:
        config, masks, hyper = _class_options(name, kwargs)
    for field, fix in (("max_grad_norm", "ZeroConfig.max_grad_norm"),
                       ("loss_scaling", "ZeroConfig's fp16 compute dtype")):
        if getattr(config, field, None) is not None:
            raise ValueError(f"{name} under ZeRO: {type(config).__name__}.{field} is for plain data parallel; ZeRO "
                             f"clips and scales itself: leave it None and use {fix}.")
    for g in param_groups or []:
        for key in ("zero_reducer", "zero_group"):
            if key in g:
                raise ValueError(f"{name} under ZeRO: param_groups carry {key!r}; the 1-bit exchange shards "
                                 "every group over ZeRO's group with its own reducer: drop the key.")
        check_hyperparameters(name, *(g.get(k, hyper[k]) for k in HYPERPARAMETERS))
    check_hyperparameters(name, *(hyper[k] for k in HYPERPARAMETERS))
    if param_groups is not None:
        param_groups = [{k: v for k, v in g.items() if k not in ("onebit_config", "momentum_masks")}
                        for g in param_groups]
    exchange = _exchange_class(name, config)(config, masks)
    base = {"OnebitAdam": ShardedOnebitAdam, "OnebitLamb": ShardedOnebitLamb, "ZeroOneAdam": ShardedZeroOneAdam}[name]
    inner = type(name, (base,), {"EXCHANGE": exchange, "__module__": __name__})
    return inner, param_groups, hyper, exchange


def _exchange_class(name: str, config: Any) -> type:
    """The reducer for ``name``: 0/1 Adam's, 1-bit Adam's or 1-bit LAMB's without the post-step
    gather (``zero_param_sync="update"``), or the 1-bit exchange with ZeRO's exact gather."""
    if name == "ZeroOneAdam":
        return ZeroOneZeroExchange
    if getattr(config, "zero_param_sync", "gather") == "update":
        return ReplicatedLambExchange if name == "OnebitLamb" else ReplicatedUpdateExchange
    return OnebitZeroExchange


def _check_composable(name: str, zero_config: Any, reducer: Any) -> None:
    """Refuse, naming what works, what a 1-bit optimizer cannot honour under ZeRO."""
    if name not in COMPOSABLE:
        raise ValueError(
            f"optimizer {name} does not compose with ZeRO sharding (any stage); only {', '.join(COMPOSABLE)} do, at "
            f"stages 1 and 2: it exchanges its own compressed momentum over the whole model. Use {name} on the "
            "plain, unwrapped model (no zero_shard, no DDP), or one of those / torch.optim.AdamW with ZeRO.")
    stage = zero_config.stage
    if stage not in (1, 2):
        raise ValueError(
            f"{name} composes with ZeroConfig(stage=1) and stage=2, not stage={stage}: after warm-up every rank "
            "needs the whole unit's momentum (held in 1 bit; 0/1 Adam: its own whole copy of the parameters for "
            "local steps) and its own local gradient bucket at each step, and stage 3 frees parameters and "
            "gathers them per module; use stage=1 or 2 (the fp32 masters and optimizer state are sharded there "
            "too), or torch.optim.AdamW with stage 3.")
    problems = []
    if reducer is not None:
        problems.append(f"reducer= is given, but {name}'s 1-bit exchange is the reducer; drop it")
    if getattr(zero_config, "zeropp", None) is not None:
        problems.append("ZeroConfig.zeropp is set; its quantized reduce replaces the 1-bit exchange: use one of them")
    if problems:
        raise ValueError(f"zero_shard with {name}: " + "; ".join(problems) + ".")


def _class_options(name: str, kwargs: dict[str, Any]) -> tuple[Any, dict[int, torch.Tensor], dict[str, Any]]:
    """``(config, masks keyed by parameter id, hyperparameters)`` from the class form's options."""
    config_cls = COMPOSABLE[name]
    config = kwargs.pop("onebit_config", None) or kwargs.pop("config", None) or config_cls()
    if not isinstance(config, config_cls):
        raise ValueError(f"{name}: config must be a {config_cls.__name__}, got {type(config).__name__}.")
    if kwargs.pop("process_group", None) is not None:
        raise ValueError(f"{name} under ZeRO exchanges over ZeRO's sharding group; drop process_group= "
                         "(pass mesh= to zero_shard instead).")
    masks = {id(p): m.to(torch.float32) for p, m in (kwargs.pop("momentum_masks", None) or {}).items()}
    unknown = sorted(set(kwargs) - set(HYPERPARAMETERS))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; it takes {list(HYPERPARAMETERS)}, "
                         "onebit_config, momentum_masks.")
    return config, masks, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **kwargs}
