"""Translate a DeepSpeed ``ds_config`` (dict or JSON file) into plait settings, before any work.

Every leaf key is looked up in :data:`~plait.zero_sharding.deepspeed.keys.KEYS`: mapped keys
set a field of :class:`DeepSpeedPlan`, accepted keys are recorded with the reason they change
nothing, and refused keys (or unknown ones) raise ``ValueError`` naming the dotted path and what
to do. All problems are collected and raised together, so one run shows every key to fix.

``"auto"`` values are resolved from the ``auto=`` mapping (dotted path -> value), which
:func:`hf_auto_values` fills from ``TrainingArguments`` and the model config as DeepSpeed's HF
integration does; an ``"auto"`` left unresolved is refused naming its key.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from typing import Any

import torch

from plait.zero_sharding.config import ZeroConfig
from plait.zero_sharding.deepspeed.keys import EXTENSIONS, load_package_keys, lookup
from plait.zero_sharding.deepspeed.schedules import SCHEDULES
from plait.zero_sharding.zeropp.config import ZeroPPConfig

_ADAM_KWARGS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
                "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

#: optimizer ``type`` (lower case) -> builder(params dict) -> (class, kwargs); plait-onebit-optim adds its types.
OPTIMIZERS: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The optimizer a ``ds_config`` names.

    Attributes:
        name: DeepSpeed's ``optimizer.type``.
        cls: the optimizer class plait builds.
        kwargs: its keyword arguments (from ``optimizer.params``).
    """

    name: str
    cls: type
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedPlan:
    """Everything a ``ds_config`` asks for, in plait's terms.

    Attributes:
        zero: the :class:`~plait.zero_sharding.ZeroConfig`.
        train_batch_size: global batch per optimizer step (``None`` when translated without a
            world size: a framework's own loader then sets the batch).
        micro_batch_size: per-rank batch per forward/backward (``None`` likewise).
        gradient_accumulation_steps: micro batches per optimizer step (``None`` likewise).
        optimizer: the optimizer block, or ``None`` (the script brings its own).
        scheduler: the ``scheduler`` block (validated), or ``None``.
        sequence_parallel_size: ranks per sequence-parallel group (1: none).
        gather_16bit_weights_on_model_save: save full (gathered) weights with each checkpoint.
        extensions: values built by keys other packages registered (e.g. ``"offload"``).
        accepted: ``(path, reason)`` for each present key that changes nothing in plait.
    """

    zero: ZeroConfig
    train_batch_size: int | None
    micro_batch_size: int | None
    gradient_accumulation_steps: int | None
    optimizer: OptimizerSpec | None = None
    scheduler: dict[str, Any] | None = None
    sequence_parallel_size: int = 1
    gather_16bit_weights_on_model_save: bool = False
    extensions: dict[str, Any] = dataclasses.field(default_factory=dict)
    accepted: tuple[tuple[str, str], ...] = ()


def _from_base64(text: str) -> dict[str, Any] | None:
    """The config of a base64-encoded JSON string (the form HF's ``--deepspeed`` also takes), or
    ``None`` when ``text`` is not one."""
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii") + b"=" * (-len(text) % 4)).decode("utf-8")
        loaded = json.loads(decoded)
    except (ValueError, UnicodeError):
        return None
    return loaded if isinstance(loaded, dict) else None


def load_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Return the ``ds_config`` dict (a copy) from a dict, a JSON file path, or a base64-encoded
    JSON string (as DeepSpeed's HF integration accepts for ``--deepspeed``).

    Raises:
        ValueError: the file is not JSON or not an object; FileNotFoundError: a string that is
        neither a file nor base64 JSON; TypeError: neither dict nor string/path.
    """
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    if isinstance(config, str) and not os.path.exists(config):
        decoded = _from_base64(config)
        if decoded is not None:
            return decoded
    if isinstance(config, str | os.PathLike):
        with open(config, encoding="utf-8") as handle:
            try:
                loaded = json.load(handle)
            except json.JSONDecodeError as exc:
                raise ValueError(f"DeepSpeed config {os.fspath(config)!r} is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"DeepSpeed config {os.fspath(config)!r} must hold a JSON object at the top level.")
        return loaded
    raise TypeError(f"config must be a dict, a path to a JSON file or base64 JSON, got {type(config).__name__}.")


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.extend(_leaves(value, path + "."))
        else:
            out.append((path, value))
    return out


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        tree = tree[part]
    tree[last] = value


def resolve_auto(config: dict[str, Any], auto: dict[str, Any] | None) -> list[str]:
    """Replace ``"auto"`` values in place from ``auto``; return the problems for those left."""
    problems = []
    for path, value in _leaves(config):
        if value != "auto":
            continue
        if auto is not None and auto.get(path) is not None:
            _set(config, path, auto[path])
        else:
            problems.append(f"{path}: \"auto\" has nothing to resolve it outside the HF Trainer; write the value")
    return problems


def check_keys(config: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """Return (problems, accepted) for every leaf key of ``config``."""
    problems, accepted = [], []
    for path, value in _leaves(config):
        key = lookup(path)
        if key is None:
            problems.append(f"{path}: not a DeepSpeed key plait knows; remove it (or check its spelling)")
        elif key.action == "refused":
            problems.append(f"{path}: {key.effect}")
        else:
            refusal = key.check(value) if key.check is not None else None
            if refusal is not None:
                problems.append(f"{path}={value!r}: {refusal}")
            elif key.action == "accepted":
                accepted.append((path, key.effect))
    return problems, accepted


def batch_sizes(config: dict[str, Any], world_size: int) -> tuple[int, int, int]:
    """Apply DeepSpeed's batch rule: train_batch_size = micro batch x accumulation x data-parallel world.

    Returns:
        ``(train_batch_size, micro_batch_size, gradient_accumulation_steps)``.

    Raises:
        ValueError: the three disagree, none of the batch keys is given, or one is not a positive int.
    """
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    steps = config.get("gradient_accumulation_steps")
    for name, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if total is not None and micro is not None and steps is not None:
        pass
    elif total is not None and micro is not None:
        steps = total // (micro * world_size)
    elif total is not None and steps is not None:
        micro = total // (steps * world_size)
    elif micro is not None:
        steps = steps or 1
        total = micro * steps * world_size
    elif total is not None:
        steps, micro = 1, total // world_size
    else:
        raise ValueError("the DeepSpeed config sets none of train_batch_size and train_micro_batch_size_per_gpu; "
                         "set at least one of them.")
    if micro <= 0 or steps <= 0 or total != micro * steps * world_size:
        raise ValueError(f"train_batch_size={total} must equal train_micro_batch_size_per_gpu={micro} x "
                         f"gradient_accumulation_steps={steps} x world size {world_size}; fix one of them.")
    return total, micro, steps


def _optimizer(block: dict[str, Any] | None) -> OptimizerSpec | None:
    if not block:
        return None
    name = str(block.get("type", ""))
    params = dict(block.get("params") or {})
    builder = OPTIMIZERS.get(name.lower())
    if builder is not None:
        cls, kwargs = builder(params)
        return OptimizerSpec(name=name, cls=cls, kwargs=kwargs)
    if name.lower() not in ("adam", "adamw"):
        raise ValueError(f"optimizer.type={name!r} is not available; use Adam or AdamW, install the plait package "
                         "that provides it (plait-onebit-optim for the 1-bit family), or pass optimizer= yourself.")
    adam_w = bool(params.pop("adam_w_mode", True)) or name.lower() == "adamw"
    for ignored in ("torch_adam", "fused"):
        params.pop(ignored, None)
    unknown = sorted(set(params) - set(_ADAM_KWARGS))
    if unknown:
        raise ValueError(f"optimizer.params.{unknown[0]} is not an Adam/AdamW parameter; plait takes "
                         f"{list(_ADAM_KWARGS)} (and adam_w_mode, torch_adam, fused).")
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return OptimizerSpec(name=name, cls=torch.optim.AdamW if adam_w else torch.optim.Adam, kwargs=params)


def _zero_config(config: dict[str, Any]) -> ZeroConfig:
    zero = config.get("zero_optimization") or {}
    fp16, bf16 = config.get("fp16") or {}, config.get("bf16") or {}
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one of them.")
    if not zero or "stage" not in zero:
        raise ValueError("zero_optimization.stage is missing: DeepSpeed would run stage 0 (plain data parallel); "
                         "set zero_optimization.stage to 1, 2 or 3, or use DDP for stage 0.")
    fields: dict[str, Any] = {"stage": zero["stage"]}
    if "reduce_bucket_size" in zero:
        fields["reduce_bucket_elements"] = int(zero["reduce_bucket_size"])
    if "overlap_comm" in zero:
        fields["overlap_comm"] = bool(zero["overlap_comm"])
    threshold = zero.get("stage3_param_persistence_threshold", zero.get("param_persistence_threshold"))
    if threshold is not None:
        fields["param_persistence_threshold"] = int(threshold)
    clip = config.get("gradient_clipping")
    fields["max_grad_norm"] = float(clip) if clip else None
    if bf16.get("enabled"):
        fields["compute_dtype"] = torch.bfloat16
    elif fp16.get("enabled"):
        fields["compute_dtype"] = torch.float16
        fields["loss_scale_window_offset"] = 1  # DeepSpeed grows one good step later after the start/an overflow
        for ds_name, ours in (("loss_scale", "loss_scale"), ("initial_scale_power", "initial_scale_power"),
                              ("loss_scale_window", "loss_scale_window"), ("hysteresis", "hysteresis"),
                              ("min_loss_scale", "min_loss_scale")):
            if ds_name in fp16:
                fields[ours] = fp16[ds_name]
    if config.get("communication_data_type") is not None:
        name = str(config["communication_data_type"]).lower()
        if name not in _DTYPE_NAMES:
            raise ValueError(f"communication_data_type={name!r}; use 'fp32', 'fp16' or 'bf16'.")
        fields["reduce_dtype"] = _DTYPE_NAMES[name]
    fields["zeropp"] = ZeroPPConfig.from_deepspeed(zero)
    return ZeroConfig(**fields)


def translate(config: dict[str, Any] | str | os.PathLike[str], *, world_size: int | None,
              auto: dict[str, Any] | None = None) -> DeepSpeedPlan:
    """Translate a DeepSpeed config into a :class:`DeepSpeedPlan`, refusing before any work.

    Args:
        config: the ``ds_config`` dict or a path to its JSON file.
        world_size: data-parallel ranks (for the batch rule); ``None`` skips the batch rule
            (for Lightning, whose loaders and Trainer set the batch; the keys are still checked).
        auto: values for ``"auto"`` keys by dotted path (see :func:`hf_auto_values`).

    Returns:
        The plan.

    Raises:
        ValueError: every refused, unknown, unresolved or inconsistent key, named by its dotted
            path with what to do, in one message.
    """
    tree = load_config(config)
    load_package_keys()
    problems = resolve_auto(tree, auto)
    key_problems, accepted = check_keys(tree)
    problems += key_problems
    scheduler = tree.get("scheduler") or None
    if scheduler is not None and scheduler.get("type") not in SCHEDULES:
        problems.append(f"scheduler.type={scheduler.get('type')!r}: use one of {sorted(SCHEDULES)}, or pass "
                        "lr_scheduler= yourself")
    if problems:
        raise ValueError("the DeepSpeed config has keys plait cannot run:\n  " + "\n  ".join(problems))
    total, micro, steps = batch_sizes(tree, world_size) if world_size is not None else (None, None, None)
    zero = tree.get("zero_optimization") or {}
    sp = tree.get("sequence_parallel_size", 1)
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sequence_parallel_size={sp!r} must be a positive integer.")
    gather = zero.get("stage3_gather_16bit_weights_on_model_save",
                      zero.get("stage3_gather_fp16_weights_on_model_save", False))
    extensions = {name: value for name, build in EXTENSIONS.items() if (value := build(tree)) is not None}
    return DeepSpeedPlan(zero=_zero_config(tree), train_batch_size=total, micro_batch_size=micro,
                         gradient_accumulation_steps=steps, optimizer=_optimizer(tree.get("optimizer")),
                         scheduler=scheduler, sequence_parallel_size=sp,
                         gather_16bit_weights_on_model_save=bool(gather), extensions=extensions,
                         accepted=tuple(accepted))


def hf_auto_values(args: Any, *, world_size: int, hidden_size: int | None = None,
                   num_training_steps: int | None = None) -> dict[str, Any]:
    """The values DeepSpeed's HF integration puts in place of ``"auto"``, by dotted path.

    Args:
        args: ``transformers.TrainingArguments`` (or an object with the same attributes).
        world_size: data-parallel ranks.
        hidden_size: the model config's ``hidden_size`` (for the bucket/threshold keys).
        num_training_steps: total optimizer steps (for the scheduler's step counts).

    Returns:
        ``{dotted path: value}``; keys whose source is unknown are absent (and stay refused).
    """
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps,
        "train_batch_size": world_size * micro * steps, "gradient_clipping": args.max_grad_norm,
        "optimizer.params.lr": args.learning_rate, "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon, "optimizer.params.weight_decay": args.weight_decay,
        "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": args.learning_rate,
        "fp16.enabled": bool(args.fp16 or getattr(args, "fp16_full_eval", False)),
        "bf16.enabled": bool(args.bf16 or getattr(args, "bf16_full_eval", False)),
    }
    if hidden_size is not None:
        values["zero_optimization.reduce_bucket_size"] = hidden_size * hidden_size
        values["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
        values["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden_size
    if num_training_steps is not None:
        values["scheduler.params.total_num_steps"] = num_training_steps
        values["scheduler.params.warmup_num_steps"] = max(1, args.get_warmup_steps(num_training_steps))
    return values
