"""``deepspeed.initialize``, ``init_distributed`` and ``add_config_arguments`` with plait's ZeRO underneath."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.zero_sharding.api import zero_shard
from plait.zero_sharding.deepspeed.config import DeepSpeedPlan, load_config, translate
from plait.zero_sharding.deepspeed.engine import DeepSpeedEngine
from plait.zero_sharding.deepspeed.schedules import build_schedule


def init_distributed(dist_backend: str | None = None, timeout: Any = None, init_method: str | None = None,
                     **_: Any) -> None:
    """Initialise ``torch.distributed`` from the launcher's environment if it is not yet (DeepSpeed's call).

    Args:
        dist_backend: ``"gloo"``/``"nccl"``; ``None``: nccl with CUDA, else gloo.
        timeout: a ``datetime.timedelta`` for collectives, or ``None`` for torch's default.
        init_method: torch's ``init_method`` (default ``env://``).
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    options = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend=backend, init_method=init_method or "env://", **options)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` and ``--local_rank`` to ``parser``.

    Returns:
        The same parser.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run on plait)")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (plait's ZeRO)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    if not any("--local_rank" in action.option_strings for action in parser._actions):
        group.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)),
                           help="local rank passed by the launcher")
    return parser


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    given = config if config is not None else config_params
    if given is not None and from_args is not None:
        raise ValueError("initialize got both config= and args.deepspeed_config; pass one of them.")
    if given is None and from_args is None:
        raise ValueError("initialize needs a DeepSpeed config: config=dict/path or args.deepspeed_config.")
    return given if given is not None else from_args


def _optimizer_and_groups(model: nn.Module, optimizer: Any, model_parameters: Iterable[Any] | None,
                          plan: DeepSpeedPlan) -> tuple[Any, list[dict[str, Any]] | None, dict[str, Any]]:
    if optimizer is not None and plan.optimizer is not None:
        raise ValueError("initialize got optimizer= and the config has an optimizer block; remove one of them.")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer | type):
        optimizer = optimizer(list(model_parameters) if model_parameters is not None else model.parameters())
    if optimizer is not None:
        return optimizer, None, {}
    if plan.optimizer is None:
        raise ValueError("no optimizer: pass optimizer= to initialize or add an optimizer block to the config.")
    groups = None
    if model_parameters is not None:
        params = list(model_parameters)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    return plan.optimizer.cls, groups, dict(plan.optimizer.kwargs)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, config_params: Any = None,
               **_: Any) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize`` on plait: translate the config, shard the model, build the rest.

    Args:
        args: an argparse namespace (``args.deepspeed_config`` is read when ``config`` is not given).
        model: the ``nn.Module`` to train.
        optimizer: an optimizer instance, or a callable taking the parameters; ``None``: the
            config's ``optimizer`` block.
        model_parameters: the parameters (or parameter-group dicts) the optimizer trains.
        training_data: a dataset: a ``DataLoader`` over it with the micro batch size and a
            ``DistributedSampler`` is returned.
        lr_scheduler: a scheduler, or a callable taking the optimizer; ``None``: the config's block.
        distributed_port, dist_init_required: accepted for DeepSpeed's signature.
        mpu: model-parallel unit; refused (plait shards over the whole data-parallel world).
        collate_fn: the data loader's ``collate_fn``.
        config, config_params: the DeepSpeed config (dict or JSON path).

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)`` as DeepSpeed returns them.

    Raises:
        ValueError: config problems (every one named by its key), or conflicting arguments.
    """
    if model is None:
        raise ValueError("initialize needs model=.")
    if mpu is not None:
        raise ValueError("initialize(mpu=...): model-parallel units are not supported by plait's shim; "
                         "use plait's DeviceMesh APIs for tensor/sequence parallelism.")
    tree = load_config(_config_source(args, config, config_params))
    init_distributed()
    plan = translate(tree, world_size=dist.get_world_size())
    opt, groups, kwargs = _optimizer_and_groups(model, optimizer, model_parameters, plan)
    if "offload" in plan.extensions:  # registered (and so installed) by plait-offload-io
        from plait.offload_io import zero_placement

        kwargs["placement"] = zero_placement(plan.extensions["offload"])
    model, zero_opt = zero_shard(model, opt, plan.zero, param_groups=groups, **kwargs)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(zero_opt)
    elif lr_scheduler is None and plan.scheduler is not None:
        lr_scheduler = build_schedule(zero_opt, plan.scheduler)
    engine = DeepSpeedEngine(model, zero_opt, lr_scheduler, plan)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=dist.get_world_size(),
                                                      rank=dist.get_rank())
        loader = torch.utils.data.DataLoader(training_data, batch_size=plan.micro_batch_size, sampler=sampler,
                                             collate_fn=collate_fn)
    return engine, zero_opt, loader, lr_scheduler
