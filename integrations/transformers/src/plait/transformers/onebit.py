"""1-bit optimizers under the HF Trainer: DeepSpeed's ``"optimizer"`` block, checks, and what
``zero_shard`` is given.

A config selects one with ``PlaitConfig(onebit=OnebitAdamConfig(freeze_step=400))`` (plait's own
dataclasses; the config's class says which optimizer) or, in a JSON file, with DeepSpeed's block::

    {"zero": {"stage": 2},
     "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 400, "lr": "auto", "cuda_aware": false,
                                                    "comm_backend_name": "nccl"}}}

As with the Trainer's own DeepSpeed route, the optimizer replaces ``TrainingArguments.optim`` and
its hyperparameters come from ``TrainingArguments`` (``learning_rate``, ``adam_beta1/2``,
``adam_epsilon``, ``weight_decay`` with HF's no-decay groups, the scheduler): in the block they
may only be ``"auto"``. The optimizer composes with ZeRO through its own ``compose_with_zero``
hook (plait-onebit-optim), which :func:`check_onebit` runs once as a dry run when the Trainer is
built, so every combination that package refuses (ZeRO-3, fp16, ZeRO++, an optimizer not yet
composable with ZeRO) is refused before any work, in its words, prefixed with the field.
"""

from __future__ import annotations

import importlib.util
from typing import Any

# DeepSpeed's optimizer "type" -> (plait class, plait config class).
TYPES = {"OneBitAdam": ("OnebitAdam", "OnebitAdamConfig"), "OneBitLamb": ("OnebitLamb", "OnebitLambConfig"),
         "ZeroOneAdam": ("ZeroOneAdam", "ZeroOneAdamConfig")}
CONFIG_CLASSES = {config: cls for cls, config in TYPES.values()}
# Hyperparameters the Trainer gives (DeepSpeed's "auto" values).
AUTO_ONLY = {"lr": "learning_rate", "betas": "adam_beta1/adam_beta2", "eps": "adam_epsilon",
             "weight_decay": "weight_decay"}
INSTALL = "pip install plait-onebit-optim  (or: pip install 'plait-transformers[onebit]')"


def onebit_class(config: Any) -> type:
    """The optimizer class of a plait 1-bit config (``OnebitAdamConfig`` -> ``OnebitAdam``...).

    Raises:
        ImportError: plait-onebit-optim is not installed (with the pip line).
    """
    if importlib.util.find_spec("plait.onebit_optim") is None:
        raise ImportError(f"PlaitConfig.onebit={config!r} needs plait-onebit-optim: {INSTALL}")
    import plait.onebit_optim as onebit_optim

    return getattr(onebit_optim, CONFIG_CLASSES[type(config).__name__])


def _check_deepspeed_only(kind: str, params: dict[str, Any], source: str) -> None:
    """DeepSpeed's communication settings: the values that describe what plait does are accepted."""
    if params.pop("cuda_aware", False) is not False:
        raise ValueError(f"{source}: optimizer.params.cuda_aware=true selects DeepSpeed's CUDA-aware MPI path, which "
                         "plait does not have (it exchanges through the torch.distributed process group the Trainer "
                         "runs); remove it or set false.")
    backend = params.pop("comm_backend_name", "nccl")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{source}: optimizer.params.comm_backend_name={backend!r}; plait's {kind} exchanges "
                         "through the torch.distributed process group (NCCL on GPU, gloo on CPU): use 'nccl' "
                         "(DeepSpeed's default) or remove the key.")
    explicit = {k: params.pop(k) for k in list(params) if k in AUTO_ONLY}
    fixed = {k: v for k, v in explicit.items() if v != "auto"}
    if fixed:
        names = ", ".join(f"{k} -> TrainingArguments.{AUTO_ONLY[k]}" for k in fixed)
        raise ValueError(f"{source}: optimizer.params {sorted(fixed)} are set; under the HF Trainer they come from "
                         f"TrainingArguments ({names}), as in its DeepSpeed route: write \"auto\" or remove them.")


def onebit_from_deepspeed(block: Any, source: str) -> Any:
    """A plait 1-bit config from DeepSpeed's ``"optimizer"`` block.

    Raises:
        ValueError: not a 1-bit type (named, with the known ones), an unknown or refused parameter.
        ImportError: plait-onebit-optim is not installed.
    """
    if not isinstance(block, dict) or "type" not in block or set(block) - {"type", "params"}:
        raise ValueError(f"{source}: 'optimizer' must be DeepSpeed's block {{\"type\": \"OneBitAdam\", \"params\": "
                         f"{{...}}}}, got {block!r}.")
    kind = block["type"]
    if kind not in TYPES:
        raise ValueError(f"{source}: optimizer.type={kind!r}; plait takes the 1-bit types {sorted(TYPES)} here. For "
                         "Adam/AdamW remove the 'optimizer' block: TrainingArguments.optim builds it.")
    params = dict(block.get("params") or {})
    _check_deepspeed_only(kind, params, source)
    if importlib.util.find_spec("plait.onebit_optim") is None:
        raise ImportError(f"{source}: optimizer.type={kind!r} needs plait-onebit-optim: {INSTALL}")
    from plait.onebit_optim import config_from_dict

    try:
        return config_from_dict(TYPES[kind][0], params)
    except ValueError as exc:
        raise ValueError(f"{source}: optimizer.params: {exc}") from exc


def hyperparameters(args: Any) -> dict[str, Any]:
    """The optimizer's hyperparameters from ``TrainingArguments`` (what "auto" means)."""
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay}


def check_onebit(onebit: Any, zero: Any, args: Any, ep_size: int) -> None:
    """Refuse what cannot compose, before any work: the package's own ``compose_with_zero`` rules
    (run as a dry run on the ZeroConfig the Trainer will use), the Trainer's own clipping (the
    engine's ``ZeroConfig.max_grad_norm`` is the 1-bit route to clip), expert parallelism.

    Args:
        onebit: the plait 1-bit config.
        zero: the effective ``ZeroConfig`` (precision already filled from ``TrainingArguments``).
        args: the ``TrainingArguments``.
        ep_size: ``PlaitConfig.ep_size``.

    Raises:
        ValueError: naming the field and the fix.
        ImportError: plait-onebit-optim is not installed.
    """
    cls = onebit_class(onebit)
    name = cls.__name__
    clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
    if clip > 0:
        raise ValueError(f"TrainingArguments.max_grad_norm={clip} with PlaitConfig.onebit ({name}): the Trainer clips "
                         "the shards before the step, which hold exchanged momentum after the warm-up. Set "
                         "max_grad_norm=0, and to clip give ZeroConfig.max_grad_norm (\"zero\": {\"max_grad_norm\": "
                         "...} in the file): the 1-bit exchange then clips at the step, after the warm-up against the "
                         "ranks' local gradient norms (plait-onebit-optim's rule), not the averaged gradient's norm.")
    if ep_size > 1:
        raise ValueError(f"PlaitConfig.ep_size={ep_size} with PlaitConfig.onebit ({name}): the 1-bit exchange shards "
                         "every parameter over one group and expert parallelism needs a second (the experts'); use "
                         "ep_size=1 or AdamW (TrainingArguments.optim).")
    try:
        cls.compose_with_zero(cls, zero, param_groups=None, reducer=None, onebit_config=onebit,
                               **hyperparameters(args))
    except ValueError as exc:
        raise ValueError(f"PlaitConfig.onebit ({name}, DeepSpeed optimizer.type) with ZeroConfig(stage={zero.stage}): "
                         f"{exc}") from exc


def zero_shard_arguments(onebit: Any, optimizer: Any, args: Any) -> tuple[type, list[dict[str, Any]], dict[str, Any]]:
    """``(class, param_groups, options)`` for ``zero_shard``: the 1-bit optimizer over the groups the
    Trainer built (its weight-decay split), hyperparameters from ``TrainingArguments``.

    Args:
        onebit: the plait 1-bit config.
        optimizer: the Trainer's optimizer (``create_optimizer``'s, never stepped).
        args: the ``TrainingArguments``.
    """
    groups = [{"params": list(g["params"]), "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return onebit_class(onebit), groups, {**hyperparameters(args), "onebit_config": onebit}
